"""Per-layer attention policy: which op each layer runs, with which window and sinks.

A policy is data (a list of LayerPolicy) plus a registry of op kinds; adding a kind is one
class plus one registry entry. The model asks ``policy.op(i)`` and calls what it gets.

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

import torch

from .errors import LongattnError, check_int
from .ops import native
from .ops.dense import causal_attention, masked_attention
from .ops.masks import allowed_mask


@dataclass(frozen=True)
class LayerPolicy:
    kind: str = "window"          # "window" (None window = dense) | "sparse" | registered kinds
    window: Optional[int] = None  # keys per query including itself; None = full causal
    sinks: int = 0                # first positions always readable


def _same_positions(kept: torch.Tensor, pos: torch.Tensor) -> bool:
    return (kept.shape == pos.shape and kept.dtype == pos.dtype and kept.device == pos.device
            and bool(torch.equal(kept, pos)))


class MaskMemo:
    """The last boolean mask built per (window, sinks), reused while the positions match.

    Within one forward every layer gets the same query positions, and layers whose caches
    are alike hold the same key positions, so layers sharing a window and sinks share one
    ``allowed_mask``. A hit needs ``q_pos`` and ``k_pos`` equal in value to private copies
    taken when the mask was built. Value, not identity: a cache writes its position
    tensor in place and Python reuses the ids of freed tensors, so an identity key could
    hand back a mask built for other positions; the copies cannot change or be freed.
    Equal positions give the same mask, so a hit is bit-identical to building it again.
    One entry per (window, sinks): the next forward's positions replace it, which bounds
    memory to one mask per distinct setting (``clear()`` drops them).
    """

    def __init__(self):
        self._entries: dict = {}  # (window, sinks) -> (q_pos copy, k_pos copy, mask)
        self.hits = 0
        self.misses = 0

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int],
             sinks: int) -> torch.Tensor:
        """``allowed_mask(q_pos, k_pos, window, sinks)``, built once per distinct positions."""
        entry = self._entries.get((window, sinks))
        if entry is not None and _same_positions(entry[0], q_pos) and _same_positions(entry[1], k_pos):
            self.hits += 1
            return entry[2]
        self.misses += 1
        mask = allowed_mask(q_pos, k_pos, window, sinks)
        self._entries[(window, sinks)] = (q_pos.clone(), k_pos.clone(), mask)
        return mask

    def clear(self) -> None:
        self._entries.clear()


class WindowOp:
    """Masked attention by absolute positions; window None = dense causal.

    The prefill of a windowed layer may take the banded O(T*W) path (same mask, different
    arithmetic order); set ``banded_min_tokens`` to None to keep every path on masked SDPA.
    ``masks`` is shared by the ops of one policy so layers reuse each other's mask.
    Decode steps (one query per stream, float32, no softcap) read the cache through longattn's
    fused C++ kernel (ops/csrc/decode_attention.cpp; the same rule as ``allowed_mask``, decided
    from positions, masked slots skipped) where it is built, because the matmul form spends its
    time in two thin matmuls, a mask and a softmax.
    ``fused_decode=False`` keeps the matmul form (its reference).
    """

    def __init__(self, lp: LayerPolicy, banded_min_tokens: Optional[int] = None,
                 masks: Optional[MaskMemo] = None, fused_decode: bool = True):
        self.lp = lp
        self.banded_min_tokens = banded_min_tokens
        self.masks = masks if masks is not None else MaskMemo()
        self.fused_decode = fused_decode and native.available()

    def __call__(self, q, q_pos, k, v, k_pos, scale, softcap=None, layer=0, cache=None):
        lp = self.lp
        if self.fused_decode and q.shape[2] == 1 and softcap is None and \
                q.dtype == k.dtype == v.dtype == torch.float32:
            none = k[:, :, :0]  # no separate own key: the cache already holds it
            return torch.ops.longattn_cpu.decode_attention(q, k, v, k_pos, q_pos, none, none,
                                                           lp.window or 0, lp.sinks, float(scale))
        if self._banded_applies(q, q_pos, k_pos, softcap):
            from .ops.banded import banded_attention
            return banded_attention(q, k, v, lp.window, lp.sinks, scale)
        if self._plain_causal(q, q_pos, k_pos, softcap):
            return causal_attention(q, k, v, scale)
        mask = self.masks.mask(q_pos, k_pos, lp.window, lp.sinks)
        return masked_attention(q, k, v, mask, scale, softcap)

    def _plain_causal(self, q, q_pos, k_pos, softcap) -> bool:
        """A one-shot prefill whose mask is exactly causal (no window within reach, keys
        0..T-1) can use the fused causal kernel, which skips the masked half of the work.
        An unset window and any window >= T take this same path (bit-identical)."""
        lp, Tq, Tk = self.lp, q.shape[2], k_pos.shape[1]
        if softcap is not None or Tq != Tk or Tq <= 16 or q.shape[0] != 1:
            return False
        if lp.window is not None and lp.window < Tk:
            return False
        return _keys_from_zero(q_pos, k_pos)

    def _banded_applies(self, q, q_pos, k_pos, softcap) -> bool:
        """Banded pays off for long windowed prefills over keys laid out as 0..Tk-1."""
        lp, Tq, Tk = self.lp, q.shape[2], k_pos.shape[1]
        if (self.banded_min_tokens is None or lp.window is None or softcap is not None
                or q.shape[0] != 1 or Tq < self.banded_min_tokens or lp.window >= Tk):
            return False
        return _keys_from_zero(q_pos, k_pos)


def _keys_from_zero(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when stream 0's keys are exactly positions 0..Tk-1 and its queries are the
    last Tq of them (a one-shot prefill, or a chunk over a cache that holds every earlier
    position in order): the layout the causal and banded kernels assume."""
    Tq, Tk = q_pos.shape[1], k_pos.shape[1]
    ar = torch.arange(Tk, dtype=k_pos.dtype)
    return bool(torch.equal(k_pos[0], ar) and torch.equal(q_pos[0], ar[Tk - Tq:]))


# Prefill chunks at least this long take the banded path on windowed layers; below it the
# fused causal kernel wins (benchmarks/prefill_attention.py measures the crossover).
BANDED_MIN_TOKENS = 2048

def _window_factory(lp: LayerPolicy, policy: "AttentionPolicy", layer: int) -> WindowOp:
    return WindowOp(lp, policy.banded_min_tokens, policy.masks, policy.fused_decode)


# kind -> factory(layer_policy, attention_policy, layer_index) returning the layer's op.
OP_REGISTRY: dict = {"window": _window_factory}


def register_op(kind: str, factory: Callable) -> None:
    """Add an attention kind: ``factory(lp, policy, layer) -> op`` where ``op(q, q_pos, k, v,
    k_pos, scale, softcap, layer, cache)`` returns ``[B, H, Tq, D]``."""
    OP_REGISTRY[kind] = factory


@dataclass
class AttentionPolicy:
    layers: list = field(default_factory=list)  # [L] LayerPolicy
    banded_min_tokens: Optional[int] = BANDED_MIN_TOKENS
    sparse_config: Optional[object] = None  # SCSAConfig for "sparse" layers
    fused_decode: bool = True  # decode steps through the C++ kernel where built (see WindowOp)
    ops: list = field(default_factory=list, repr=False)
    masks: MaskMemo = field(default_factory=MaskMemo, init=False, repr=False, compare=False)

    def __post_init__(self):
        # Kinds register themselves where they are defined (longattn.sparse.policy registers
        # "sparse"; only its builders make sparse layers), so this module knows none of them.
        self.ops = []
        for lp in self.layers:
            check_int("window", lp.window, allow_none=True)
            check_int("sinks", lp.sinks)
            if lp.kind not in OP_REGISTRY:
                raise LongattnError(f"unknown attention kind '{lp.kind}'; known: {', '.join(OP_REGISTRY)}")
            self.ops.append(OP_REGISTRY[lp.kind](lp, self, len(self.ops)))

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
