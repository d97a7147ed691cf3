"""Quality of windowed attention: bits/token on the second half of book passages.

For each passage of T tokens the model reads all T tokens and we score the predictions of
the tokens at positions ``T//2 .. T-1`` (each from the logits one position earlier), so
every scored token has at least T//2 tokens of context -- the part a window hides. Each
(window, sinks) cell is compared with the checkpoint's own policy: full attention for
models trained without windows (SmolLM2, Qwen2.5), the trained local windows with full
global layers for Gemma 3.

Imposed windows: ``mode="window"`` puts W on every layer; ``mode="global"`` keeps a hybrid
checkpoint's trained windows and puts W on its global layers only; ``"auto"`` picks
"global" when the checkpoint has trained windows and "window" otherwise.

Position re-indexing (``reindex=True``): the passage is fed in chunks through ring caches
built with ``make_cache(..., reindex=True)`` (StreamingLLM: attention sees positions within
the cache, so distances never exceed sinks + window). The re-indexing only moves the sinks
(cache/ring.py), so with ``sinks=0`` it is the plain windowed model, and the full baseline
has no ring to re-index: it always runs as a plain forward. Without ``reindex`` a passage
longer than the trained context simply runs at its absolute positions.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from ..errors import LongattnError
from ..policy import AttentionPolicy

LOG2E = 1.0 / math.log(2.0)
MODES = ("auto", "window", "global")


def resolve_mode(cfg, mode: str) -> str:
    """"auto" -> "global" for checkpoints trained with windows, else "window"."""
    if mode not in MODES:
        raise LongattnError(f"unknown quality mode '{mode}'; use {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "global" if any(w is not None for w in cfg.layer_windows) else "window"


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


def passage_hidden(model, ids: torch.Tensor, policy, reindex: bool = False, chunk: int = 256) -> torch.Tensor:
    """Last hidden states ``[T, hidden]`` of one passage ``ids [T]`` under ``policy``.

    Plain full forward, or (``reindex``) chunked through ring caches that re-index positions.
    """
    if not reindex:
        return model(ids[None], policy=policy, logits="none")[0]
    from ..cache.factory import make_cache
    cache = make_cache(model.config, policy, batch=1, kind="auto", model=model, reindex=True)
    outs = []
    for s in range(0, ids.numel(), chunk):
        outs.append(model(ids[None, s:s + chunk], cache=cache, policy=policy, logits="none")[0])
    return torch.cat(outs)


def passage_bits(model, ids: torch.Tensor, policy, reindex: bool = False, chunk: int = 256) -> tuple:
    """(sum of -log2 p, count) over the targets at positions ``T//2 .. T-1`` of ``ids [T]``."""
    T = int(ids.numel())
    h = T // 2
    hidden = passage_hidden(model, ids, policy, reindex=reindex, chunk=chunk)  # [T, hidden]
    bits = score_hidden(model, hidden[h - 1:T - 1], ids[h:T])
    return float(bits.sum()), int(bits.numel())


def quality_sweep(model, passages: Sequence[torch.Tensor], windows: Sequence[int],
                  sinks: Sequence[int] = (0, 1, 4), mode: str = "auto", reindex: bool = False,
                  chunk: int = 256, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Bits/token on the second half of each passage for every (window, sinks) and the baseline.

    Args:
        model: a Transformer.
        passages: token-id tensors ``[T]`` (T >= 4; all scored the same way).
        windows: imposed windows W (keys per query including itself), each >= 1.
        sinks: sink counts S to try with every window.
        mode: "auto" | "window" | "global" (module doc).
        reindex: StreamingLLM position re-indexing on ring layers (module doc).
        chunk: tokens per forward on the re-indexed path.
        progress: called with a label after each (config, passage) forward.
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
    if not windows or any((not isinstance(w, int)) or w < 1 for w in windows):
        raise LongattnError(f"windows must be positive integers, got {list(windows)}")
    if any((not isinstance(s, int)) or s < 0 for s in sinks):
        raise LongattnError(f"sinks must be non-negative integers, got {list(sinks)}")
    m = resolve_mode(cfg, mode)

    def run(policy, label, use_reindex):
        tot, n, per = 0.0, 0, []
        for ids in passages:
            b, c = passage_bits(model, ids, policy, reindex=use_reindex, chunk=chunk)
            tot, n = tot + b, n + c
            per.append(b / c)
            if progress:
                progress(label)
        return tot / n, per

    base_bpt, base_per = run(AttentionPolicy.build(cfg, "checkpoint"), "baseline", False)
    rows = []
    for w in windows:
        for s in sinks:
            pol = AttentionPolicy.build(cfg, m, window=w, sinks=s)
            bpt, per = run(pol, f"W={w} S={s}", reindex)
            rows.append({"window": w, "sinks": s, "bits_per_token": bpt, "per_passage": per,
                         "delta_bits": bpt - base_bpt})
    return {
        "experiment": "quality",
        "model": cfg.name,
        "mode": m,
        "reindex": bool(reindex),
        "passages": len(passages),
        "lengths": lengths,
        "scored_positions": "targets at positions T//2..T-1 of each passage (logits one earlier)",
        "trained_windows": list(cfg.layer_windows),
        "max_context": cfg.max_context,
        "baseline": {"label": baseline_label(cfg), "bits_per_token": base_bpt, "per_passage": base_per},
        "rows": rows,
    }


def plot_quality(result: dict, path) -> None:
    """bits/token vs window, one line per sinks value, dashed baseline."""
    from .plots import new_figure, save_figure
    fig, ax = new_figure()
    sinks = sorted({r["sinks"] for r in result["rows"]})
    for s in sinks:
        rs = sorted((r for r in result["rows"] if r["sinks"] == s), key=lambda r: r["window"])
        ax.plot([r["window"] for r in rs], [r["bits_per_token"] for r in rs], marker="o",
                label=f"window + {s} sink{'s' if s != 1 else ''}")
    b = result["baseline"]
    ax.axhline(b["bits_per_token"], color="k", linestyle="--", label=b["label"])
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
