"""KV-cache bytes vs context: measured on real cache objects beside the closed form.

For each policy and context T a cache is built with ``make_cache`` (ring caches on windowed
layers, growing caches elsewhere, growing layers sized exactly) and filled with T tokens --
either by ``cache.update`` with random K/V (fast, the default) or by prefilling T random
token ids through the model -- then read back:

* ``allocated_bytes`` = ``cache.nbytes()``, the storage the cache holds. A ring allocates
  ``sinks + W`` slots up front, so before it fills it holds more than it uses.
* ``held_bytes`` = per-layer filled slots x bytes per token, what the cache keeps.
* ``formula_bytes`` = ``arithmetic.hybrid_cache_bytes`` with the policy's windows
  (``min(T, sinks + W)`` tokens on windowed layers, T elsewhere).

``held_bytes == formula_bytes`` for every T, and ``allocated_bytes == formula_bytes`` once
every ring is full (T >= sinks + W).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch

from ..errors import LongattnError
from ..policy import AttentionPolicy
from ..cache.kv_format import row_bytes
from .arithmetic import hybrid_cache_bytes

FILLS = ("update", "model")


def policy_shape(cfg, policy) -> SimpleNamespace:
    """A config-like object whose ``layer_windows`` are the policy's (for the formula)."""
    return SimpleNamespace(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, layer_windows=list(policy.windows))


def policy_sinks(policy) -> int:
    s = {lp.sinks for lp in policy.layers if lp.window is not None}
    if len(s) > 1:
        raise LongattnError("the cache formula needs one sink count for every windowed layer")
    return s.pop() if s else 0


def fill_cache(cache, cfg, T: int, chunk: int = 4096, model=None, policy=None, seed: int = 0) -> None:
    """Put T tokens in ``cache``: random float32 K/V through ``cache.update`` (``model`` None;
    the cache stores them in its own format) or random token ids prefilled through ``model``
    under ``policy``, ``chunk`` at a time."""
    g = torch.Generator().manual_seed(seed)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        pos = torch.arange(s, e, dtype=torch.int64)[None]  # [1, t]
        if model is not None:
            ids = torch.randint(0, cfg.vocab_size, (1, e - s), generator=g)
            model(ids, pos, cache=cache, policy=policy, logits="none")
            continue
        shape = (1, cfg.num_kv_heads, e - s, cfg.head_dim)  # [B, Hkv, t, D]
        for layer in range(cfg.num_layers):
            k = torch.randn(shape, generator=g)
            cache.update(layer, k, k, pos)
        cache.advance(pos)


def measure_cache(cfg, policy, T: int, dtype=torch.float32, model=None, chunk: int = 4096) -> dict:
    """Build and fill one cache; return its allocated, held and formula bytes (totals and per layer)."""
    from ..cache.factory import make_cache
    cache = make_cache(cfg, policy, batch=1, kind="auto", dtype=dtype, model=model, exact_capacity=True)
    fill_cache(cache, cfg, T, chunk=chunk, model=model, policy=policy)
    per_token = 2 * cfg.num_kv_heads * row_bytes(dtype, cfg.head_dim)
    held = [per_token * t for t in cache.tokens()]
    shape = policy_shape(cfg, policy)
    sinks = policy_sinks(policy)
    return {"tokens": T, "allocated_bytes": cache.nbytes(), "held_bytes": sum(held),
            "formula_bytes": hybrid_cache_bytes(shape, T, dtype, sinks),
            "layer_allocated": cache.layer_bytes(), "layer_held": held,
            "layer_formula": hybrid_cache_bytes(shape, T, dtype, sinks, per_layer=True)}


def named_policies(cfg, window: int, sinks: int) -> list:
    """[(label, policy)] to compare: the checkpoint's own, and imposed windows.

    Models trained with windows also get "dense" (every layer growing); hybrid ones (Gemma 3:
    windowed and global layers) also "global W" (W on the global layers too: every layer bounded).
    """
    ws = cfg.layer_windows
    out = []
    if any(w is not None for w in ws):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(("dense", AttentionPolicy.build(cfg, "dense")))
        hybrid = any(w is None for w in ws)
        out.append(("checkpoint (hybrid)" if hybrid else "checkpoint windows", AttentionPolicy.build(cfg, "checkpoint")))
        if hybrid:
            out.append((f"global {window} + {sinks} sinks", AttentionPolicy.build(cfg, "global", window=window,
                                                                                  sinks=sinks)))
    else:
        out.append(("full", AttentionPolicy.build(cfg, "checkpoint")))
    out.append((f"window {window}", AttentionPolicy.build(cfg, "window", window=window)))
    if sinks:
        out.append((f"window {window} + {sinks} sinks", AttentionPolicy.build(cfg, "window", window=window,
                                                                              sinks=sinks)))
    return out


def cache_sweep(cfg, policies: list, contexts: Sequence[int], dtype=torch.float32,
                measure_max: Optional[int] = None, model=None, chunk: int = 4096,
                progress: Optional[Callable[[str], None]] = None) -> dict:
    """Bytes vs context for each ``(label, policy)``.

    Args:
        cfg: ModelConfig.
        policies: ``[(label, AttentionPolicy)]``.
        contexts: token counts T.
        dtype: K/V storage dtype.
        measure_max: measure caches only for T <= this (None = all); the formula covers every T.
        model: prefill random ids through it instead of filling by ``cache.update``.
    Returns:
        dict with ``rows``: one per (policy, T) with formula bytes and, where measured,
        allocated/held bytes and ``match`` (held == formula, and allocated == formula once full).
    """
    if any((not isinstance(t, int)) or t < 1 for t in contexts):
        raise LongattnError(f"contexts must be positive integers, got {list(contexts)}")
    rows = []
    for label, pol in policies:
        shape, sinks = policy_shape(cfg, pol), policy_sinks(pol)
        ring_cap = max([(lp.window or 0) + lp.sinks for lp in pol.layers if lp.window] or [0])
        for T in contexts:
            row = {"policy": label, "tokens": T, "windows": list(pol.windows), "sinks": sinks,
                   "formula_bytes": hybrid_cache_bytes(shape, T, dtype, sinks)}
            if measure_max is None or T <= measure_max:
                m = measure_cache(cfg, pol, T, dtype, model=model, chunk=chunk)
                full = T >= ring_cap
                row.update(allocated_bytes=m["allocated_bytes"], held_bytes=m["held_bytes"],
                           rings_full=full,
                           match=(m["held_bytes"] == m["formula_bytes"]
                                  and (not full or m["allocated_bytes"] == m["formula_bytes"])))
            rows.append(row)
            if progress:
                progress(f"{label} T={T}")
    return {"experiment": "cache", "model": cfg.name, "kv_dtype": str(dtype).replace("torch.", ""),
            "fill": "model prefill" if model is not None else "cache.update with random K/V",
            "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "trained_windows": list(cfg.layer_windows), "measure_max": measure_max,
            "policies": [label for label, _ in policies], "rows": rows}


def plot_cache(results: list, path) -> None:
    """Bytes vs context (log-log), one panel per model: lines = formula, dots = measured
    allocated bytes (above the line before a ring fills: rings allocate sinks + W up front)."""
    from .plots import new_figure, save_figure
    n = len(results)
    fig, _ = new_figure(width=max(5.0, 4.6 * n), height=4.4)
    fig.clf()
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, res in zip(axes, results):
        for label in res["policies"]:
            rs = [r for r in res["rows"] if r["policy"] == label]
            line, = ax.plot([r["tokens"] for r in rs], [r["formula_bytes"] / 2**20 for r in rs], label=label, lw=1.2)
            meas = [r for r in rs if "allocated_bytes" in r]
            ax.plot([r["tokens"] for r in meas], [r["allocated_bytes"] / 2**20 for r in meas], "o",
                    color=line.get_color(), ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context T (tokens)")
        ax.set_ylabel(f"KV cache MiB per sequence ({res['kv_dtype']})")
        ax.set_title(res["model"], fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("KV cache size: lines = hybrid_cache_bytes, dots = measured make_cache (allocated)", fontsize=9)
    save_figure(fig, path)
