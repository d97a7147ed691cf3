"""SCSA inside the static decode step: one opaque custom op per sparse layer.

The static step (engine/static_step.py) is one fixed-shape graph; SCSA's index is not (clusters grow,
blocks freeze every few hundred tokens, the first decode steps calibrate). So a sparse layer
calls ``longattn::scsa_step``, a custom op whose body runs in Python at run time: compiled or
not, the graph only sees ``[B, H, 1, D] -> [B, H, 1, D]``. Behind it, each (layer, stream)
keeps its own ``SCSALayer`` (index, calibrated taus, counters) in a ``SparseState`` that the
decoder owns; the op finds it through an integer key baked into the decoder's private graph.

Full-attention buffers hold slot = position, so a stream at position n has its cache in slots
``[0, n)`` and this step's key apart (``pending``). SCSA reads an append-only cache that holds
the query's own key, so the op first stores the step's key and value at slot n, the very
values the decoder writes there after the step (``StaticKV.write``): the write is idempotent
and no other part of the step reads that layer's buffer. Streams with position -1 (padding,
warm-up) output zeros and touch nothing. Below ``min_context`` cached tokens a stream's step is
read by the dense layer's own op (WindowOp), as the eager SparseOp reads it.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ..cache.base import KVView
from ..ops.attention import WindowOp
from .config import SCSAConfig
from .layer import SCSALayer

_STATES: "weakref.WeakValueDictionary[int, SparseState]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class SparseState:
    """The SCSA layers of one static decoder: ``layer(l, b)`` for model layer l, stream b."""

    def __init__(self, cfg: SCSAConfig, num_heads: int, num_kv_heads: int, head_dim: int,
                 taus: dict | None = None):
        self.cfg = cfg
        self.taus = dict(taus or {})  # layer -> frozen taus its streams start with (LayerPolicy.taus)
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.layers: dict = {}
        self.key = next(_KEYS)
        _STATES[self.key] = self
        # below min_context a sparse layer is a dense one: the dense layer's own op, as in the Session
        self.dense = WindowOp()
        self._positions = torch.arange(0).unsqueeze(0)  # [1, n] slot positions, grown as needed

    def positions(self, n: int) -> torch.Tensor:
        """``[1, n]`` int64 positions 0..n-1 (a view of one growing tensor: the dense route
        needs them every step, and a fresh arange per layer and step is avoidable work)."""
        if self._positions.shape[1] < n:
            self._positions = torch.arange(max(n, 2 * self._positions.shape[1])).unsqueeze(0)
        return self._positions[:, :n]

    def layer(self, layer: int, stream: int) -> SCSALayer:
        if (layer, stream) not in self.layers:
            self.layers[(layer, stream)] = SCSALayer(self.cfg, *self.shape, layer_index=layer,
                                                     taus=self.taus.get(layer))
        return self.layers[(layer, stream)]

    def reset(self) -> None:
        """New streams: every index is forgotten; calibrated taus and counters stay."""
        for layer in self.layers.values():
            layer.reset()

    def clear(self) -> None:
        """Drop every layer: the next steps build new indexes and calibrate afresh."""
        self.layers.clear()

    def of_layer(self, layer: int) -> list:
        """The SCSALayers of one model layer (one per stream that has decoded)."""
        return [sc for (l, _), sc in sorted(self.layers.items()) if l == layer]


# The op is defined on a Library with a plain CPU kernel rather than through
# torch.library.custom_op, whose Python wrappers (autograd, alias checks on the output) run on
# every call of every sparse layer. Neither is needed: decode runs under no_grad, and the output
# never aliases an input (attend returns a new tensor).
_LIB = torch.library.Library("longattn", "FRAGMENT")
_LIB.define("scsa_step(Tensor q, Tensor k, Tensor v, Tensor q_pos, Tensor k_new, Tensor v_new, int key, "
            "int layer, float scale, Tensor? sink_logits=None) -> Tensor")


def scsa_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, key: int, layer: int, scale: float,
              sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """SCSA decode attention of one layer over static buffers.

    Args:
        q: ``[B, H, 1, D]``; k, v: ``[B, Hkv, S, D]`` buffers (slot = position);
        q_pos: ``[B, 1]`` int64 (-1 = inactive); k_new, v_new: ``[B, Hkv, 1, D]`` this step's.
        key: the decoder's SparseState key. layer: model layer index. scale: score scale.
        sink_logits: ``[H]`` learned per-head sink logits (gpt-oss) or None.
    Returns:
        ``[B, H, 1, D]`` (zeros for inactive streams).
    """
    state = _STATES[key]
    if q.shape[0] == 1:  # one stream, the decode loop's case: its own tensors, no per-stream views
        return _stream(state, 0, q, k, v, int(q_pos), k_new, v_new, layer, scale, sink_logits)
    return torch.cat([_stream(state, b, q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1), n,
                              k_new.narrow(0, b, 1), v_new.narrow(0, b, 1), layer, scale, sink_logits)
                      for b, n in enumerate(q_pos[:, 0].tolist())])


def _stream(state: SparseState, b: int, q, k, v, n: int, k_new, v_new, layer: int, scale: float,
            sink_logits=None) -> torch.Tensor:
    """``scsa_step`` for stream ``b`` at position ``n``: q ``[1, H, 1, D]``, k, v ``[1, Hkv, S, D]``,
    k_new, v_new ``[1, Hkv, 1, D]``. Views are taken per stream only where there are several,
    because the Python around the kernel runs once per sparse layer and step."""
    if n < 0:
        return torch.zeros_like(q)
    # write-ahead of the step's own key and value (see the module docstring): idempotent
    k.narrow(2, n, 1).copy_(k_new)
    v.narrow(2, n, 1).copy_(v_new)
    kb, vb = k.narrow(2, 0, n + 1), v.narrow(2, 0, n + 1)
    sc = None if n + 1 < state.cfg.min_context else state.layer(layer, b)
    if sc is None or sc.runs_exact:  # short cache, or no tau meets the tolerance here
        if sc is not None:
            sc.count_exact_call(1, n + 1)
        pos = state.positions(n + 1)
        return state.dense(q, pos[:, n:], KVView(kb, vb, pos, k_new, v_new), scale, sink_logits=sink_logits)
    return sc.attend(q, kb, vb, scale, sink_logits)


_LIB.impl("scsa_step", scsa_step, "CPU")


@torch.library.register_fake("longattn::scsa_step")
def _(q, k, v, q_pos, k_new, v_new, key, layer, scale, sink_logits=None):
    return torch.empty_like(q)


class StaticSparseOp:
    """The static policy's op for a sparse layer (see static_decode._StaticPolicy)."""

    learned_sinks = True  # passed through to the dense op and SCSALayer.attend

    def __init__(self, state: SparseState, layer: int):
        self.state, self.layer = state, layer

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        if softcap is not None:
            raise NotImplementedError("SCSA with score softcapping")  # rejected at construction
        return torch.ops.longattn.scsa_step(q, view.k, view.v, q_pos, view.new_k, view.new_v, self.state.key,
                                            self.layer, float(scale), sink_logits)
