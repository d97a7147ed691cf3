"""Next-token choice: greedy, temperature, top-k, top-p, with an explicit generator (seed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import LongattnError


@dataclass
class SamplingConfig:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: Optional[int] = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise LongattnError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LongattnError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LongattnError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            raise LongattnError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")


GREEDY_CHUNK = 512


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` -> ``[B]`` int64: the first index of each row's maximum, equal to
    ``logits.argmax(-1)`` (ties go to the first; a NaN counts as the maximum, as there).

    torch's argmax walks one long row on one thread, unvectorised, which is slow over a
    vocabulary as large as Gemma 3's (``amax`` is vectorised). Split into chunks of 512 the
    argmaxes run per chunk and only the chunk winners are compared.
    """
    B, V = logits.shape
    n = V // GREEDY_CHUNK * GREEDY_CHUNK
    if n < 16 * GREEDY_CHUNK:
        return logits.argmax(dim=-1)
    head = logits[:, :n].view(B, n // GREEDY_CHUNK, GREEDY_CHUNK)
    loc = head.argmax(-1)  # [B, chunks]
    val = head.gather(-1, loc[..., None])[..., 0]
    loc = loc + torch.arange(0, n, GREEDY_CHUNK)
    if n < V:
        tv, tl = logits[:, n:].max(-1)
        val, loc = torch.cat([val, tv[:, None]], 1), torch.cat([loc, tl[:, None] + n], 1)
    return loc.gather(1, val.argmax(-1, keepdim=True))[:, 0]


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row from ``logits [B, V]`` -> ``[B]`` int64."""
    if cfg.temperature == 0.0:
        return greedy(logits)
    # The row maximum is subtracted before dividing, so a temperature as small as 1e-300 (0 in
    # float32) gives 0 for the best tokens and -inf for the rest, a near-greedy choice, never
    # inf - inf or 0 / 0 = NaN.
    x = logits.float()
    x = x - x.amax(dim=-1, keepdim=True)
    x = torch.where(x == 0, x, x / cfg.temperature)
    if cfg.top_k > 0:
        kth = torch.topk(x, min(cfg.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sx, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sx, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sx, dim=-1) >= cfg.top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False  # the best token always stays (a top_p below float32's range drops none)
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sx)
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]
