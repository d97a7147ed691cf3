"""Time vs context: one decode step (growing cache vs ring) and prefill attention kernels.

Decode: the cache is filled with T tokens of random K/V through ``cache.update`` (the values
do not change the arithmetic's cost, and prefilling T real tokens would dominate the run),
then the model decodes single tokens at position T, T+1, ...; the median over ``repeats``
steps (after ``warmup`` steps) is reported, the growing and ring steps taken in turn so that
background load hits both alike. A growing cache reads all T keys per layer each
step; a ring of W slots reads W, so its step time stays flat once T >= W.

Prefill attention (one layer's op, ``[1, H, T, D]`` queries, ``Hkv`` key heads):
* dense: fused SDPA with ``is_causal=True`` (full attention; skips the upper triangle);
* masked: fused SDPA with the boolean window mask from ``allowed_mask`` (reads T^2 pairs);
* banded: ``ops.banded.banded_attention`` (blocks of queries read only their band, O(T*W)).
Medians of ``repeats`` after one warm-up call, the three kernels timed in turn. Threads are whatever ``torch`` is set to;
the result records ``torch.get_num_threads()``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import LongattnError
from ..policy import AttentionPolicy


def _interleaved_medians_ms(fns: dict, repeats: int, warmup: int = 1) -> dict:
    """Median milliseconds of each callable in ``fns``, timed in turn within every repeat so
    that background load drifting during the run hits every variant alike (ratios stay fair)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _check(contexts, repeats) -> None:
    if not contexts or any((not isinstance(t, int)) or t < 1 for t in contexts):
        raise LongattnError(f"contexts must be positive integers, got {list(contexts)}")
    if repeats < 1:
        raise LongattnError("--repeats must be >= 1")


def decode_step_times(model, contexts: Sequence[int], window: int, sinks: int = 0, repeats: int = 5,
                      warmup: int = 2, progress: Optional[Callable[[str], None]] = None,
                      kv_dtype: torch.dtype = torch.float32) -> dict:
    """Median decode-step milliseconds at each context, full growing cache vs ring.

    The growing cache runs the dense policy (every key read); the ring runs W (+ sinks) on
    every layer in ring caches from ``make_cache``. The two are stepped in turn (see
    ``_interleaved_medians_ms``). Returns ``contexts``, ``growing_ms``, ``ring_ms``,
    ``growing_cache_bytes`` / ``ring_cache_bytes`` (bytes of the tokens held after the timed
    steps) and ``speedup`` lists. ``kv_dtype``: both caches' storage format (cache/kv_format.py).
    """
    from ..cache.factory import make_cache
    from ..cache.kv_format import row_bytes
    from .cachebytes import fill_cache
    _check(contexts, repeats)
    cfg = model.config
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = AttentionPolicy.build(cfg, "dense")
    ring = AttentionPolicy.build(cfg, "window", window=window, sinks=sinks)
    out = {"contexts": list(contexts), "window": window, "sinks": sinks, "growing_ms": [], "ring_ms": [],
           "growing_cache_bytes": [], "ring_cache_bytes": []}
    tok = torch.tensor([[1 % cfg.vocab_size]])
    per_token = 2 * cfg.num_kv_heads * row_bytes(kv_dtype, cfg.head_dim)  # K + V, one layer

    def stepper(cache, pol, T):
        pos = [T]

        def step():
            model(tok, torch.tensor([[pos[0]]]), cache=cache, policy=pol, logits="last")
            pos[0] += 1
        return step
    for T in contexts:
        caches = {"growing": make_cache(cfg, dense, batch=1, kind="growing", dtype=kv_dtype),
                  "ring": make_cache(cfg, ring, batch=1, kind="auto", dtype=kv_dtype)}
        for c in caches.values():
            fill_cache(c, cfg, T)
        ms = _interleaved_medians_ms({"growing": stepper(caches["growing"], dense, T),
                                      "ring": stepper(caches["ring"], ring, T)}, repeats, warmup)
        for name, c in caches.items():
            out[f"{name}_ms"].append(ms[name])
            out[f"{name}_cache_bytes"].append(per_token * sum(c.tokens()))
        del caches
        if progress:
            progress(f"decode T={T}")
    out["speedup"] = [g / r for g, r in zip(out["growing_ms"], out["ring_ms"])]
    return out


def prefill_attention_times(contexts: Sequence[int], window: int, heads: int = 9, kv_heads: int = 3,
                            head_dim: int = 64, sinks: int = 0, repeats: int = 3, seed: int = 0,
                            progress: Optional[Callable[[str], None]] = None) -> dict:
    """Median milliseconds of one prefill attention call over T tokens: dense causal SDPA,
    SDPA under the window mask, and banded attention (see module doc)."""
    from ..ops.banded import banded_attention
    from ..ops.dense import masked_attention
    from ..ops.masks import allowed_mask
    _check(contexts, repeats)
    if heads % kv_heads:
        raise LongattnError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    g = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    out = {"contexts": list(contexts), "window": window, "sinks": sinks, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "dense_ms": [], "masked_ms": [], "banded_ms": []}
    for T in contexts:
        q = torch.randn(1, heads, T, head_dim, generator=g)        # [B, H, T, D]
        k = torch.randn(1, kv_heads, T, head_dim, generator=g)     # [B, Hkv, T, D]
        v = torch.randn(1, kv_heads, T, head_dim, generator=g)
        pos = torch.arange(T)[None]                                # [1, T]
        mask = allowed_mask(pos, pos, window, sinks)               # [1, 1, T, T] bool
        gqa = heads != kv_heads
        ms = _interleaved_medians_ms({
            "dense": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa),
            "masked": lambda: masked_attention(q, k, v, mask, scale),
            "banded": lambda: banded_attention(q, k, v, window, sinks, scale)}, repeats)
        for name in ("dense", "masked", "banded"):
            out[f"{name}_ms"].append(ms[name])
        del mask
        if progress:
            progress(f"prefill T={T}")
    return out


def scaling_run(model, decode_contexts: Sequence[int], prefill_contexts: Sequence[int], window: int,
                sinks: int = 0, repeats: int = 5, prefill_repeats: int = 3,
                progress: Optional[Callable[[str], None]] = None) -> dict:
    """Both measurements; prefill shapes (heads, KV heads, head_dim) follow ``model.config``."""
    cfg = model.config
    return {"experiment": "scaling", "model": cfg.name, "threads": torch.get_num_threads(),
            "decode": decode_step_times(model, decode_contexts, window, sinks, repeats, progress=progress)
            if decode_contexts else None,
            "prefill": prefill_attention_times(prefill_contexts, window, cfg.num_heads, cfg.num_kv_heads,
                                               cfg.head_dim, sinks, prefill_repeats, progress=progress)
            if prefill_contexts else None}


def plot_scaling(result: dict, path) -> None:
    """Left: decode step ms vs context. Right: prefill attention ms vs context."""
    from .plots import new_figure, save_figure
    fig, _ = new_figure(width=10.0, height=4.0)
    fig.clf()
    a1, a2 = fig.subplots(1, 2)
    d = result.get("decode")
    if d:
        a1.plot(d["contexts"], d["growing_ms"], "o-", label="full (growing) cache")
        a1.plot(d["contexts"], d["ring_ms"], "s-", label=f"ring W={d['window']}+{d['sinks']}")
        a1.set_xscale("log", base=2)
        a1.set_xlabel("context T (tokens)")
        a1.set_ylabel("decode step (ms, median)")
        a1.set_title(f"{result['model']} decode, {result['threads']} threads", fontsize=9)
        a1.legend(fontsize=8)
        a1.grid(alpha=0.3)
    p = result.get("prefill")
    if p:
        for key, lab in (("dense_ms", "dense (causal SDPA)"), ("masked_ms", "masked SDPA (window mask)"),
                         ("banded_ms", "banded")):
            a2.plot(p["contexts"], p[key], "o-", label=lab)
        a2.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.set_xlabel("prompt T (tokens)")
        a2.set_ylabel("one layer's attention (ms, median)")
        a2.set_title(f"prefill attention H={p['heads']}/{p['kv_heads']} D={p['head_dim']} W={p['window']}",
                     fontsize=9)
        a2.legend(fontsize=8)
        a2.grid(alpha=0.3, which="both")
    save_figure(fig, path)
