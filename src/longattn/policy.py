"""Per-layer attention policy: which op each layer runs, with which window and sinks.

A policy is data (frozen: a LayerPolicy per layer) plus a registry of op kinds; adding a kind
is one class plus one registry entry. The model asks ``policy.op(i)`` and calls what it gets.

Sources of a policy:
- the checkpoint (default): each layer's trained window (Gemma 3: 512 on local layers);
- imposed: ``window=W, sinks=S`` on every layer, a per-layer list, or on the global
  (full-attention) layers only of a hybrid model;
- ``dense``: every window off (a different function than a windowed model was trained as).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

from .errors import LongattnError, check_int
from .ops.attention import BANDED_MIN_TOKENS, WindowOp  # noqa: F401  (WindowOp re-exported)


@dataclass(frozen=True)
class LayerPolicy:
    kind: str = "window"          # "window" (None window = dense) | "sparse" | registered kinds
    window: Optional[int] = None  # keys per query including itself; None = full causal
    sinks: int = 0                # first positions always readable
    # sparse layers: frozen thresholds per KV head (None = that head attends exactly), taken
    # instead of calibrating (sparse.policy.with_taus); None = calibrate in the first steps
    taus: Optional[tuple] = None


def _window_factory(lp: LayerPolicy, policy: "AttentionPolicy", layer: int) -> WindowOp:
    return WindowOp(lp.window, lp.sinks, policy.banded_min_tokens, policy.fused_decode)


# kind -> factory(layer_policy, attention_policy, layer_index) returning the layer's op.
OP_REGISTRY: dict = {"window": _window_factory}


def register_op(kind: str, factory: Callable) -> None:
    """Add an attention kind: ``factory(lp, policy, layer) -> op`` where ``op(q, q_pos, view,
    scale, softcap=None, sink_logits=None)`` (``view`` a cache.base.KVView) returns
    ``[B, H, Tq, D]``. An op holds settings only: per-stream state goes in ``view.state``."""
    OP_REGISTRY[kind] = factory


@dataclass(frozen=True)
class AttentionPolicy:
    """Which op each layer runs, with which settings: data only (frozen). The ops it hands out
    (``op(i)``) are made from that data once and keep no state of their own; what an op keeps
    for a stream lives in the stream's cache (``KVView.state``)."""

    layers: tuple = ()  # [L] LayerPolicy
    banded_min_tokens: Optional[int] = BANDED_MIN_TOKENS
    sparse_config: Optional[object] = None  # SCSAConfig for "sparse" layers
    fused_decode: bool = True  # decode steps through the C++ kernel where built (see WindowOp)
    ops: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        # Kinds register themselves where they are defined (longattn.sparse.policy registers
        # "sparse"; only its builders make sparse layers), so this module knows none of them.
        object.__setattr__(self, "layers", tuple(self.layers))
        for lp in self.layers:
            check_int("window", lp.window, allow_none=True)
            check_int("sinks", lp.sinks)
            if lp.kind not in OP_REGISTRY:
                raise LongattnError(f"unknown attention kind '{lp.kind}'; known: {', '.join(OP_REGISTRY)}")
        object.__setattr__(self, "ops", tuple(OP_REGISTRY[lp.kind](lp, self, i) for i, lp in enumerate(self.layers)))

    def op(self, i: int):
        return self.ops[i]

    @property
    def windows(self) -> list:
        return [lp.window for lp in self.layers]

    @property
    def max_window(self) -> Optional[int]:
        ws = [w for w in self.windows if w]
        return max(ws) if ws and len(ws) == len(self.layers) else None

    @classmethod
    def from_config(cls, cfg, **kw) -> "AttentionPolicy":
        """The checkpoint's own windows (no sinks)."""
        return cls([LayerPolicy("window", w, 0) for w in cfg.layer_windows], **kw)

    @classmethod
    def build(cls, cfg, mode: str = "checkpoint", window=None, sinks: int = 0,
              windows: Optional[list] = None, **kw) -> "AttentionPolicy":
        """Make a policy for ``cfg``.

        mode:
            "checkpoint": trained windows; ``sinks`` added to windowed layers.
            "dense": no window anywhere (warns when the checkpoint has windows).
            "window": ``window`` (and ``sinks``) on every layer.
            "global": ``window`` on the layers the checkpoint leaves global; trained
                windows kept elsewhere.
            "layers": ``windows`` is a per-layer list of int|None.
        """
        check_int("window", window, allow_none=True)
        check_int("sinks", sinks)
        L = cfg.num_layers
        trained = list(cfg.layer_windows)
        if window == 0:
            window = None
        if mode == "checkpoint":
            ws = trained
        elif mode == "dense":
            if any(w is not None for w in trained):
                warnings.warn("dense policy on a checkpoint trained with sliding windows: this runs a "
                              "different function than the one the model was trained as", stacklevel=2)
            ws = [None] * L
        elif mode == "window":
            if window is None:
                raise LongattnError("--policy window needs --window W (a positive integer)")
            ws = [window] * L
        elif mode == "global":
            if window is None:
                raise LongattnError("--policy global needs --window W for the global layers")
            # With no global layer the window would land nowhere and the run would quietly be
            # the checkpoint's own policy under another name.
            if all(t is not None for t in trained):
                raise LongattnError("--policy global puts --window on the checkpoint's global layers, and this "
                                    "checkpoint windows every layer; use --policy window to replace its windows")
            ws = [window if t is None else t for t in trained]
        elif mode == "layers":
            if windows is None or len(windows) != L:
                n = "none" if windows is None else len(windows)
                raise LongattnError(f"per-layer window list has {n} entries; the model has {L} layers")
            for w in windows:
                check_int("window", w, allow_none=True)
            ws = [None if not w else int(w) for w in windows]
        else:
            raise LongattnError(f"unknown policy mode '{mode}'; use checkpoint, dense, window, global or layers")
        if sinks and all(w is None for w in ws):
            raise LongattnError("sinks only matter with a window; pass --window W too")
        return cls([LayerPolicy("window", w, sinks if w is not None else 0) for w in ws], **kw)
