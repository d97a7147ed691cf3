"""Next-token choice: greedy, temperature, top-k, top-p, with an explicit generator (seed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import LongattnError


@dataclass
class SamplingConfig:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 0:
            raise LongattnError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LongattnError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LongattnError(f"top-p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row from ``logits [B, V]`` -> ``[B]`` int64."""
    if cfg.temperature == 0.0:
        return logits.argmax(dim=-1)
    x = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(x, min(cfg.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sx, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sx, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sx, dim=-1) >= cfg.top_p  # keep the smallest set reaching top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sx)
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]
