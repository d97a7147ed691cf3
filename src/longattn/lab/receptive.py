"""Receptive field of stacked windows: how far a change at one position can travel.

Change the token at position p, run the model again under the same policy, and record, for
each later position t, the largest change of any logit. Each windowed layer moves
information at most W-1 positions forward, so with W on every one of L layers the change
reaches exactly L*(W-1) positions (``lab.arithmetic.reach``) and every logit beyond it is
bit-for-bit unchanged: rows of a matmul do not mix, and masked keys contribute an exact 0.
Both forwards run on one thread: a multithreaded GEMM may split a row's sum differently from
one call to the next (measured on 2 threads: about one process in fifteen saw a one-ulp change
beyond the reach, and the same input twice gave different logits), which would hide the
structural zero behind rounding noise.
A sink at or after p does not change that; p < sinks makes p readable from everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import LongattnError
from ..policy import AttentionPolicy
from .arithmetic import reach


def receptive_field(model, ids: torch.Tensor, window: int, position: int = 0, sinks: int = 0,
                    replacement: Optional[int] = None, policy=None) -> dict:
    """Largest logit change at each distance after changing the token at ``position``.

    Args:
        model: a Transformer.
        ids: ``[T]`` token ids.
        window: W on every layer (ignored when ``policy`` is given).
        position: p, the position whose token is changed.
        sinks: sink tokens with the window.
        replacement: the new token id (default: ``(ids[p] + 1) % vocab``).
        policy: an AttentionPolicy to use instead of W on every layer.
    Returns:
        dict: ``distances`` (0..T-1-p), ``max_logit_change`` per distance (float, 0.0 exact),
        ``reach`` = L*(W-1), ``last_nonzero_distance`` (-1 if none), settings.
    """
    cfg = model.config
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    T = int(ids.numel())
    if not 0 <= position < T:
        raise LongattnError(f"position {position} is outside the {T}-token input")
    if policy is None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise LongattnError(f"window must be a positive integer, got {window!r}")
        policy = AttentionPolicy.build(cfg, "window", window=window, sinks=sinks)
    new = (int(ids[position]) + 1) % cfg.vocab_size if replacement is None else int(replacement)
    if new == int(ids[position]):
        raise LongattnError("the replacement token equals the original one")
    alt = ids.clone()
    alt[position] = new
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = model(ids[None, :], policy=policy, logits="all")[0]  # [T, V]
        b = model(alt[None, :], policy=policy, logits="all")[0]
    finally:
        torch.set_num_threads(threads)
    change = (b[position:] - a[position:]).abs().amax(dim=-1).double()  # [T - p]
    nz = torch.nonzero(change > 0).flatten()
    windows = policy.windows
    uniform = len(set(windows)) == 1 and windows[0] is not None
    return {
        "experiment": "receptive",
        "model": cfg.name,
        "layers": cfg.num_layers,
        "window": windows[0] if uniform else None,
        "windows": windows,
        "sinks": policy.layers[0].sinks,
        "position": position,
        "tokens": T,
        "reach": reach(cfg.num_layers, windows[0]) if uniform else None,
        "distances": list(range(T - position)),
        "max_logit_change": [float(v) for v in change],
        "last_nonzero_distance": int(nz[-1]) if nz.numel() else -1,
        "zero_beyond_reach": (bool((change[int(reach(cfg.num_layers, windows[0])) + 1:] == 0).all())
                              if uniform else None),
    }


def plot_receptive(results: list, path) -> None:
    """Max logit change vs distance (log y), one line per window, reach marked."""
    from .plots import new_figure, save_figure
    fig, ax = new_figure()
    for r in results:
        d = [x for x, v in zip(r["distances"], r["max_logit_change"]) if v > 0]
        v = [v for v in r["max_logit_change"] if v > 0]
        line, = ax.plot(d, v, label=f"W={r['window']} (reach {r['reach']})", lw=1)
        if r["reach"] is not None and r["reach"] <= r["distances"][-1]:
            ax.axvline(r["reach"], color=line.get_color(), linestyle=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel(f"distance after the changed token (position {results[0]['position']})")
    ax.set_ylabel("max |change| of any logit (exact zeros not drawn)")
    ax.set_title(f"{results[0]['model']}: window on all {results[0]['layers']} layers; dotted = L(W-1)",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)
