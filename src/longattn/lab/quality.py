"""Quality of windowed attention: bits/token on the second half of book passages.

For each passage of T tokens the model reads all T tokens and we score the predictions of
the tokens at positions ``T//2 .. T-1`` (each from the logits one position earlier), so
every scored token has at least T//2 tokens of context -- the part a window hides. Each
(window, sinks) cell is compared with the checkpoint's own policy: full attention for
models trained without windows (SmolLM2, Qwen2.5), the trained local windows with full
global layers for Gemma 3.

Imposed windows: ``mode="window"`` puts W on every layer; ``mode="global"`` keeps a hybrid
checkpoint's trained windows and puts W on its global layers only; ``"auto"`` picks
"global" for a hybrid checkpoint (windowed and global layers) and "window" otherwise (a
checkpoint windowed on every layer, Mistral or Phi-3, has no global layer to put W on).

Position re-indexing (``reindex=True``): the passage is fed in chunks through ring caches
built with ``make_cache(..., reindex=True)`` (StreamingLLM: attention sees positions within
the cache, so distances never exceed sinks + window). The re-indexing only moves the sinks
(cache/ring.py), so with ``sinks=0`` it is the plain windowed model, and the full baseline
has no ring to re-index: it always runs as a plain forward. Without ``reindex`` a passage
longer than the trained context simply runs at its absolute positions.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import torch

from ..errors import LongattnError
from ..policy import AttentionPolicy

LOG2E = 1.0 / math.log(2.0)
MODES = ("auto", "window", "global")


def resolve_mode(cfg, mode: str) -> str:
    """"auto" -> "global" for hybrid checkpoints (windowed and global layers), else "window"."""
    if mode not in MODES:
        raise LongattnError(f"unknown quality mode '{mode}'; use {', '.join(MODES)}")
    if mode != "auto":
        return mode
    ws = cfg.layer_windows
    return "global" if any(w is None for w in ws) and any(w is not None for w in ws) else "window"


def baseline_label(cfg) -> str:
    return "checkpoint windows" if any(w is not None for w in cfg.layer_windows) else "full attention"


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm + LM head (+ softcap) on hidden states ``[B, T, hidden]`` -> ``[B, T, V]``.

    The same arithmetic as the end of ``Transformer.forward``; used so the head runs only on
    the scored positions, a slice at a time (Gemma's 262K vocabulary makes full logits big).
    """
    x = model.model.norm(hidden)
    out = model.head(x)
    fc = model.config.final_softcap
    if fc:
        out = fc * torch.tanh(out / fc)
    return out


def score_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, slice_rows: int = 128) -> torch.Tensor:
    """-log2 p(target) from hidden states ``[N, hidden]`` and ``targets [N]`` -> ``[N]`` float64."""
    out = []
    for s in range(0, hidden.shape[0], slice_rows):
        logits = head_logits(model, hidden[None, s:s + slice_rows])[0].float()  # [n, V]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[s:s + slice_rows, None])[:, 0]
        out.append(-lp.double() * LOG2E)
    return torch.cat(out)


def passage_hidden(model, ids: torch.Tensor, policy, reindex: bool = False, chunk: int = 256,
                   kv: str = "f32") -> torch.Tensor:
    """Last hidden states ``[T, hidden]`` of one passage ``ids [T]`` under ``policy``.

    Plain full forward, or (``reindex``, or a cache format ``kv`` other than f32) chunked
    through caches (rings on windowed layers) storing keys and values as ``kv`` says.
    """
    if not reindex and kv == "f32":
        return model(ids[None], policy=policy, logits="none")[0]
    from ..cache.factory import make_cache
    from ..cache.kv_format import KV_FORMATS
    cache = make_cache(model.config, policy, batch=1, kind="auto", model=model, reindex=reindex,
                       dtype=KV_FORMATS[kv])
    outs = []
    for s in range(0, ids.numel(), chunk):
        outs.append(model(ids[None, s:s + chunk], cache=cache, policy=policy, logits="none")[0])
    return torch.cat(outs)


def passage_bits(model, ids: torch.Tensor, policy, reindex: bool = False, chunk: int = 256,
                 kv: str = "f32") -> tuple:
    """(sum of -log2 p, count) over the targets at positions ``T//2 .. T-1`` of ``ids [T]``."""
    T = int(ids.numel())
    h = T // 2
    hidden = passage_hidden(model, ids, policy, reindex=reindex, chunk=chunk, kv=kv)  # [T, hidden]
    bits = score_hidden(model, hidden[h - 1:T - 1], ids[h:T])
    return float(bits.sum()), int(bits.numel())


def quality_sweep(model, passages: Sequence[torch.Tensor], windows: Sequence[int],
                  sinks: Sequence[int] = (0, 1, 4), mode: str = "auto", reindex: bool = False,
                  chunk: int = 256, progress: Optional[Callable[[str], None]] = None, kv: str = "f32") -> dict:
    """Bits/token on the second half of each passage for every (window, sinks) and the baseline.

    Args:
        model: a Transformer.
        passages: token-id tensors ``[T]`` (T >= 4; all scored the same way).
        windows: imposed windows W (keys per query including itself), each >= 1.
        sinks: sink counts S to try with every window.
        mode: "auto" | "window" | "global" (module doc).
        reindex: StreamingLLM position re-indexing on ring layers (module doc).
        chunk: tokens per forward through caches (the re-indexed path, a ``kv`` other than f32).
        progress: called with a label after each (config, passage) forward.
        kv: the caches' storage format (cache/kv_format.py), the baseline's included.
    Returns:
        dict with ``baseline`` (label, bits_per_token, per_passage), ``rows`` (one per
        (window, sinks): bits_per_token, per_passage, delta vs baseline), and the settings.
        bits/token = mean -log2 p over all scored targets (positions T//2..T-1 of each passage).
    """
    cfg = model.config
    if not passages:
        raise LongattnError("need at least one passage")
    lengths = sorted({int(p.numel()) for p in passages})
    if lengths[0] < 4:
        raise LongattnError("passages need at least 4 tokens")
    check_grid(windows, sinks)
    m = resolve_mode(cfg, mode)

    def run(policy, label, use_reindex):
        per = []
        for ids in passages:
            per.append(passage_bits(model, ids, policy, reindex=use_reindex, chunk=chunk, kv=kv))
            if progress:
                progress(label)
        return per

    base = run(AttentionPolicy.build(cfg, "checkpoint"), "baseline", False)
    arms = []
    for w in windows:
        for s in sinks:
            pol = AttentionPolicy.build(cfg, m, window=w, sinks=s)
            arms.append((w, s, run(pol, f"W={w} S={s}", reindex)))
    return quality_result(cfg, m, reindex, lengths, base, arms)


def check_grid(windows, sinks) -> None:
    if not windows or any((not isinstance(w, int)) or w < 1 for w in windows):
        raise LongattnError(f"windows must be positive integers, got {list(windows)}")
    if any((not isinstance(s, int)) or s < 0 for s in sinks):
        raise LongattnError(f"sinks must be non-negative integers, got {list(sinks)}")


def quality_result(cfg, mode: str, reindex: bool, lengths: list, base: list, arms: list) -> dict:
    """The quality document from per-passage ``(bits, scored tokens)``.

    Args:
        base: ``[(bits, count)]`` per passage under the checkpoint's own attention.
        arms: ``[(window, sinks, [(bits, count)] per passage)]``, passages in the same order.
    Returns:
        dict with ``baseline`` and ``rows``: bits/token (total bits / total scored tokens),
        per-passage bits/token, a 95% bootstrap interval over passages (``ci``) and, for rows,
        ``delta_bits`` with the paired bootstrap interval of the delta (``delta_ci``).
    """
    from .stats import paired_delta_interval, ratio_interval

    def bpt(per):
        return sum(b for b, _ in per) / sum(c for _, c in per)

    def split(per):
        return [b for b, _ in per], [float(c) for _, c in per]

    bb, bc = split(base)
    rows = []
    for w, s, per in arms:
        ab, ac = split(per)
        rows.append({"window": w, "sinks": s, "bits_per_token": bpt(per), "ci": list(ratio_interval(ab, ac)),
                     "per_passage": [b / c for b, c in per], "delta_bits": bpt(per) - bpt(base),
                     "delta_ci": list(paired_delta_interval(bb, bc, ab, ac))})
    return {
        "experiment": "quality",
        "model": cfg.name,
        "mode": mode,
        "reindex": bool(reindex),
        "passages": len(base),
        "lengths": lengths,
        "scored_positions": "targets at positions T//2..T-1 of each passage (logits one earlier)",
        "intervals": "95% percentile bootstrap over passages (ratio of sums); delta_ci paired over the same passages",
        "trained_windows": list(cfg.layer_windows),
        "max_context": cfg.max_context,
        "baseline": {"label": baseline_label(cfg), "bits_per_token": bpt(base), "ci": list(ratio_interval(bb, bc)),
                     "per_passage": [b / c for b, c in base]},
        "rows": rows,
    }


@functools.lru_cache(maxsize=4)
def _passages(encode, n: int, length: int) -> tuple:
    from .tasks import book_passages
    return tuple(book_passages(encode, n, length))


def run_cell(ctx, params: dict) -> dict:
    """Sweep cell: one passage (``index`` of ``passages`` book passages of ``length`` tokens)
    under one policy spec -> ``{"bits", "count"}`` on its second half."""
    from .sweep import build_policy
    ids = _passages(ctx.encode, params["passages"], params["length"])[params["index"]]
    bits, count = passage_bits(ctx.model, ids, build_policy(ctx.config, params["policy"]),
                               reindex=params["reindex"], chunk=params["chunk"], kv=params.get("kv", "f32"))
    return {"bits": bits, "count": count}


def quality_cells(model: str, weights: str, cfg, passages: int, length: int, windows, sinks, mode: str = "auto",
                  reindex: bool = False, chunk: int = 256, kv: str = "f32") -> list:
    """``[(Cell, (window, sinks) or None for the baseline, passage index)]`` of a quality sweep;
    every arm, the baseline included, runs on caches of format ``kv``."""
    from .sweep import Cell
    check_grid(windows, sinks)
    m = resolve_mode(cfg, mode)
    arms = [(None, {"mode": "checkpoint"}, False)]
    arms += [((w, s), {"mode": m, "window": w, "sinks": s}, reindex) for w in windows for s in sinks]
    out = []
    for arm, spec, rx in arms:
        for i in range(passages):
            params = {"passages": passages, "index": i, "length": length, "policy": spec, "reindex": bool(rx),
                      "chunk": chunk}
            if kv != "f32":  # absent for f32, so cells measured before formats existed keep their keys
                params["kv"] = kv
            out.append((Cell("quality", model, params, weights), arm, i))
    return out


def markdown_rows(result: dict) -> tuple:
    """(headers, rows) of the quality table for Markdown: bits/token and delta with intervals."""
    b = result["baseline"]
    heads = ["policy", "window", "sinks" if result["mode"] == "window" else "sinks (every windowed layer)",
             "bits/token [95% CI]", "delta [95% CI]"]
    rows = [[b["label"], "-", "-", f"{b['bits_per_token']:.4f} [{b['ci'][0]:.4f}, {b['ci'][1]:.4f}]", "-"]]
    kind = "window" if result["mode"] == "window" else "W on global layers"
    rows += [[kind, r["window"], r["sinks"], f"{r['bits_per_token']:.4f} [{r['ci'][0]:.4f}, {r['ci'][1]:.4f}]",
              f"{r['delta_bits']:+.4f} [{r['delta_ci'][0]:+.4f}, {r['delta_ci'][1]:+.4f}]"] for r in result["rows"]]
    return heads, rows


def plot_quality(result: dict, path) -> None:
    """bits/token vs window, one line per sinks value, dashed baseline; 95% intervals as bars
    (the baseline's as a band)."""
    from .plots import new_figure, save_figure
    fig, ax = new_figure()
    sinks = sorted({r["sinks"] for r in result["rows"]})
    for s in sinks:
        rs = sorted((r for r in result["rows"] if r["sinks"] == s), key=lambda r: r["window"])
        err = [[r["bits_per_token"] - r["ci"][0] for r in rs], [r["ci"][1] - r["bits_per_token"] for r in rs]]
        ax.errorbar([r["window"] for r in rs], [r["bits_per_token"] for r in rs], yerr=err, marker="o", capsize=3,
                    label=f"window + {s} sink{'s' if s != 1 else ''}")
    b = result["baseline"]
    ax.axhline(b["bits_per_token"], color="k", linestyle="--", label=b["label"])
    ax.axhspan(b["ci"][0], b["ci"][1], color="k", alpha=0.08)
    ax.set_xscale("log", base=2)
    ws = sorted({r["window"] for r in result["rows"]})
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_xlabel("window W (keys per query)")
    ax.set_ylabel("bits/token (second half of each passage)")
    mode = result["mode"] + (", re-indexed" if result["reindex"] else "")
    ax.set_title(f"{result['model']}: {result['passages']} passages x {result['lengths'][-1]} tokens ({mode})",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)
