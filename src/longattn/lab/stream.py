"""Score a long token stream through a model in bounded memory.

The text goes through the model chunk by chunk; a windowed policy with a bounded (ring)
cache keeps memory constant. Every predicted token (positions 1..N-1) is scored from all it
may read under the policy: position t's logits predict token t+1, and the last logits of a
chunk predict the first token of the next one.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from ..errors import LongattnError

LOG2E = 1.0 / math.log(2.0)


def resident_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@dataclass
class StreamResult:
    tokens: int = 0                 # tokens fed
    scored: int = 0                 # predictions scored (tokens - 1)
    nll_bits: float = 0.0           # sum of -log2 p over scored predictions
    seconds: float = 0.0
    cache_bytes: int = 0            # at the end
    max_cache_bytes: int = 0        # the largest seen
    max_cache_tokens: int = 0       # largest number of filled slots in any layer
    rss_bytes: int = 0              # resident memory at the end
    peak_rss_bytes: int = 0
    peak_rss_early: int = 0         # peak resident memory after the first `early_tokens`
    early_tok_s: float = 0.0        # throughput over the first quarter (after warm-up)
    late_tok_s: float = 0.0         # throughput over the last quarter
    # [(tokens, running bits/token, running tok/s, cache bytes, rss, segment bits/token, segment tok/s)]
    # where a segment is the stretch since the previous point: flatness is read from segments,
    # since running averages hide a late slowdown behind the early ones.
    curve: list = field(default_factory=list)

    @property
    def bits_per_token(self) -> float:
        return self.nll_bits / self.scored if self.scored else float("nan")

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "curve"}
        d["bits_per_token"] = self.bits_per_token
        d["tok_s"] = self.tokens / self.seconds if self.seconds else float("nan")
        d["curve"] = self.curve
        return d


def nll_bits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log2 p(target) for ``logits [N, V]`` and ``targets [N]`` -> ``[N]`` float64."""
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
    return (-lp.double()) * LOG2E


def stream_score(model, ids: torch.Tensor, policy, cache, chunk: int = 256,
                 on_chunk: Optional[Callable[[int, "StreamResult"], None]] = None,
                 early_tokens: int = 10_000, curve_every: int = 0) -> StreamResult:
    """Feed ``ids [N]`` through ``model`` in chunks; score every predicted token.

    Args:
        policy: AttentionPolicy; cache: a KVCache (ring layers keep it bounded).
        chunk: tokens per forward.
        on_chunk: called with (tokens in this chunk, running result) after each chunk.
        early_tokens: where "early" peak resident memory is taken.
        curve_every: record a curve point about every this many tokens (0 = per 1/50 of N).
    """
    N = int(ids.numel())
    if N < 2:
        raise LongattnError("need at least 2 tokens to score a stream")
    if chunk < 1:
        raise LongattnError("chunk must be >= 1")
    res = StreamResult()
    every = curve_every or max(chunk, N // 50)
    next_mark = every
    prev_last = None
    t0 = time.perf_counter()
    times = []  # (tokens so far, elapsed)
    mark = (0, 0.0, 0.0, 0)  # tokens, elapsed, nll bits, scored at the previous curve point
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        x = ids[s:e][None]
        logits = model(x, cache=cache, policy=policy, logits="all")[0]  # [t, V]
        if prev_last is not None:
            res.nll_bits += float(nll_bits(prev_last[None], ids[s:s + 1]).sum())
            res.scored += 1
        if e - s > 1:
            res.nll_bits += float(nll_bits(logits[:-1], ids[s + 1:e]).sum())
            res.scored += e - s - 1
        prev_last = logits[-1]
        res.tokens = e
        cb = cache.nbytes()
        res.max_cache_bytes = max(res.max_cache_bytes, cb)
        res.max_cache_tokens = max(res.max_cache_tokens, max(cache.tokens()))
        rss = resident_bytes()
        res.peak_rss_bytes = max(res.peak_rss_bytes, rss)
        if e <= early_tokens or res.peak_rss_early == 0:
            res.peak_rss_early = res.peak_rss_bytes
        el = time.perf_counter() - t0
        times.append((e, el))
        if e >= next_mark or e == N:
            seg_bpt = (res.nll_bits - mark[2]) / max(1, res.scored - mark[3])
            seg_rate = (e - mark[0]) / (el - mark[1]) if el > mark[1] else 0.0
            res.curve.append((e, res.bits_per_token, e / el if el else 0.0, cb, rss, seg_bpt, seg_rate))
            mark = (e, el, res.nll_bits, res.scored)
            next_mark += every
        if on_chunk:
            on_chunk(e - s, res)
    res.seconds = time.perf_counter() - t0
    res.cache_bytes = cache.nbytes()
    res.rss_bytes = resident_bytes()
    res.early_tok_s, res.late_tok_s = _quarter_rates(times)
    return res


def _quarter_rates(times: list) -> tuple:
    """Throughput over the 2nd quarter (after warm-up) and over the last quarter of the run."""
    if len(times) < 8:
        tot = times[-1][0] / times[-1][1] if times and times[-1][1] else 0.0
        return tot, tot
    n = len(times)

    def rate(a, b):
        (ta, sa), (tb, sb) = times[a], times[b]
        return (tb - ta) / (sb - sa) if sb > sa else 0.0
    return rate(n // 4, n // 2), rate(3 * n // 4, n - 1)
