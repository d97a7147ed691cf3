"""SCSA inside the compiled paged step: one opaque custom op per sparse layer.

The serving step (engine/paged_step.py) is one graph over rows of many streams; SCSA's index is
per stream and changes shape as it grows, so a sparse layer calls ``longattn::paged_scsa``, a
custom op whose body runs in Python at run time: the graph only sees ``[R, H, 1, D] ->
[R, H, 1, D]``. Each row names its stream (``streams [R]``: an index into the step's
``StepStreams``, -1 for a stream whose policy has no sparse layer); behind it, the stream's
layers keep their ``SCSALayer`` in the stream's own op state (``PagedStream.op_state``), as on
the eager path.

Per call: a sparse stream's single row (its decode step) runs ``SparseOp`` over the stream's
blocks read in place (``SCSALayer.attend_paged``: dense below ``min_context``, SCSA above); every
other row (other policies' rows, prefill chunks) runs the fused decode kernel over its stream's
slots in one call, as the dense build's layer does. A sparse stream's chunk then seals its full
blocks into the index (``SparseOp._grow_index``). Each row is computed the same way whatever
shares the call, so the invariance contract holds on this build too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..cache.base import KVView
from ..ops.attention import PagedRows, paged_rows_attention


class StepStreams:
    """The sparse streams of the step being run: ``entries[i] = (op_state, policy)`` for the
    stream whose rows carry ``i``. ``PagedStep`` sets them for each call (``using``); the op
    reads them (the graph cannot carry Python objects)."""

    entries: list = []

    @classmethod
    @contextmanager
    def using(cls, entries: list):
        cls.entries = entries
        try:
            yield
        finally:
            cls.entries = []


_LIB = torch.library.Library("longattn", "FRAGMENT")
_LIB.define("paged_scsa(Tensor q, Tensor q_pos, Tensor pool_k, Tensor pool_v, Tensor table, Tensor kpos, "
            "Tensor ws, Tensor streams, int layer, int block_size, float scale, Tensor? sink_logits=None) -> Tensor")


def paged_scsa(q, q_pos, pool_k, pool_v, table, kpos, ws, streams, layer: int, block_size: int, scale: float,
               sink_logits=None):
    """One sparse layer of the compiled paged step.

    Args:
        q: ``[R, H, 1, D]``; q_pos: ``[R, 1]``; pool_k, pool_v: ``[1, Hkv, P, W]`` the pool;
        table: ``[R, NB]`` each row's stream's blocks; kpos: ``[R, N]`` their positions;
        ws: int64 ``[2]`` the layer's window and sinks (0, 0 under the sparse policy; a request's
        own window otherwise); streams: int64 ``[R]``, each row's ``StepStreams`` entry or -1.
        layer, block_size, scale, sink_logits: the layer's index, the pool's block size, the
        score scale, learned sink logits ``[H]`` or None.
    Returns:
        ``[R, H, 1, D]``.
    """
    ids = streams.tolist()
    rows_of: dict = {}
    for r, s in enumerate(ids):
        if s >= 0:
            rows_of.setdefault(s, []).append(r)
    single = {rows[0] for rows in rows_of.values() if len(rows) == 1}
    out = torch.empty_like(q)
    rest = [r for r in range(len(ids)) if r not in single]
    if rest:
        idx = torch.tensor(rest, dtype=torch.int64)
        t = table.index_select(0, idx)
        n = kpos.shape[1]
        out[idx] = paged_rows_attention(q.index_select(0, idx), q_pos.index_select(0, idx),
                                        PagedRows(pool_k, t, block_size, n), PagedRows(pool_v, t, block_size, n),
                                        kpos.index_select(0, idx), None, 0, scale, sink_logits, None, ws)
    H, D = q.shape[1], q.shape[3]
    for s, rows in rows_of.items():
        state, policy = StepStreams.entries[s]
        op, last = policy.op(layer), rows[-1]
        length = int(q_pos[last, 0]) + 1  # a global layer's slot i holds position i
        view = _stream_view(pool_k, pool_v, table, kpos, last, block_size, length, state[layer])
        if len(rows) == 1:
            out[last:last + 1] = op(q[last:last + 1], q_pos[last:last + 1], view, scale, None, sink_logits)
        elif length >= op.cfg.min_context and op.cfg.index_in_prefill:
            op._grow_index(view, H, D)  # the chunk is stored: seal its full blocks
    return out


def _stream_view(pool_k, pool_v, table, kpos, row: int, block_size: int, length: int, state: dict) -> KVView:
    """The view of row ``row``'s stream over its first ``length`` slots, read in place."""
    t = table[row:row + 1]
    k, v = PagedRows(pool_k, t, block_size, length), PagedRows(pool_v, t, block_size, length)
    return KVView(k, v, kpos[row:row + 1, :length], None, None, state)


_LIB.impl("paged_scsa", paged_scsa, "CPU")


@torch.library.register_fake("longattn::paged_scsa")
def _(q, q_pos, pool_k, pool_v, table, kpos, ws, streams, layer, block_size, scale, sink_logits=None):
    return torch.empty_like(q)


class PagedSparseOp:
    """The compiled paged step's op for a sparse layer (see engine/paged_step.py)."""

    learned_sinks = True

    def __init__(self, ws: torch.Tensor, streams: torch.Tensor, layer: int, block_size: int):
        self.ws, self.streams, self.layer, self.block_size = ws, streams, layer, block_size

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        if softcap is not None:
            raise NotImplementedError("SCSA with score softcapping")  # refused when the policy is built
        return torch.ops.longattn.paged_scsa(q, q_pos, view.k.pool, view.v.pool, view.k.table, view.positions,
                                             self.ws, self.streams, self.layer, self.block_size, float(scale),
                                             sink_logits)
