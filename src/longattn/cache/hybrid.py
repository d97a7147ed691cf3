"""Hybrid local/global caches: which layer gets which storage, and what it costs.

A model trained with windows on some layers (Gemma 3: five local layers of window 512
for every global one) needs a ring on the local layers -- bounded at ``window + sinks``
slots -- and a growing cache on the global ones. ``plan_layers`` makes that choice from
the policy; ``factory.make_cache`` builds it; ``layer_report`` says what each layer holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LongattnError

CACHE_KINDS = ("auto", "growing", "bounded")


def _bounded(lp) -> bool:
    """A layer can live in a ring when it is a window op with a window."""
    return lp.kind == "window" and lp.window is not None and lp.window > 0


def plan_layers(policy, kind: str = "auto") -> list:
    """Per-layer LAYER_CACHES kind for ``policy``.

    kind:
        "auto": ring on windowed layers, growing on global (and sparse) layers -- the hybrid.
        "growing": growing everywhere (everything is kept; windows only mask).
        "bounded": like auto, but every layer must be windowed (constant memory promised).
    """
    if kind not in CACHE_KINDS:
        raise LongattnError(f"unknown cache kind '{kind}'; use {', '.join(CACHE_KINDS)}")
    if kind == "growing":
        return ["growing"] * len(policy.layers)
    plan = ["ring" if _bounded(lp) else "growing" for lp in policy.layers]
    if kind == "bounded" and "growing" in plan:
        bad = [str(i) for i, p in enumerate(plan) if p == "growing"]
        raise LongattnError(f"a bounded cache needs a window on every layer; layer(s) {', '.join(bad)} "
                            f"attend globally (use cache kind 'auto' for a hybrid cache)")
    return plan


@dataclass(frozen=True)
class LayerReport:
    layer: int
    kind: str        # class name of the layer cache
    slots: int       # allocated slots per stream
    tokens: int      # filled slots (max over streams)
    nbytes: int      # bytes of K and V storage


def layer_report(cache) -> list:
    """One LayerReport per layer of a KVCache (allocated slots, filled slots, bytes)."""
    out = []
    for i, layer in enumerate(cache.layers):
        out.append(LayerReport(i, type(layer).__name__, int(layer.k.shape[2]), layer.tokens(),
                               layer.nbytes()))
    return out
