"""SCSA over one stream of a paged KV pool, read in place.

A served stream's keys and values live in the pool's blocks (``ops.attention.PagedRows``), not in
one tensor. SCSA reads few of them per call: the index (clusters, summaries, packed copies,
outliers) is built from the sealed rows once, and a call reads exactly only the sinks and the
unsealed suffix. So the paged form never gathers the whole stream:

- ``StreamRows`` lets ``ClusterIndex.update`` read a stream's slots through its block table (a
  block range as it seals one, the last sealed row it compares, the outliers it copies);
- ``exact_rows`` copies the rows a call reads exactly into a short tensor laid out as the kernel
  reads a whole cache (sinks, room for the outliers it takes from the index's copies, the
  suffix), so ``longattn_cpu::scsa_decode`` reads the very rows it would read from a contiguous
  cache, in the same order: the same bits as ``SCSALayer.attend`` over the gathered stream.
"""

from __future__ import annotations

import torch

from ..ops.attention import PagedRows


class StreamRows:
    """Stream ``b`` of ``rows`` as the ``[Hkv, N, W]`` tensor ``ClusterIndex`` reads, without
    copying it: each read gathers only its own slots from the pool. ``length``: N, the first
    slots only (default: all ``rows.length``), as ``k[:, :N]`` cuts a tensor."""

    def __init__(self, rows: PagedRows, b: int = 0, length: int | None = None):
        self.pool = rows.pool[0]                       # [Hkv, R, W]
        self.table = rows.table[b]                     # [NB]
        self.bs = rows.block_size
        n = rows.length if length is None else min(length, rows.length)
        self.shape = torch.Size((self.pool.shape[0], n, self.pool.shape[2]))
        self.dtype = self.pool.dtype

    def dim(self) -> int:
        return 3

    def pool_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The pool rows (dimension 1) holding the stream's ``slots`` (any int64 shape)."""
        return self.table[slots // self.bs] * self.bs + slots % self.bs

    def range(self, lo: int, hi: int) -> torch.Tensor:
        """Slots ``[lo, hi)``: ``[Hkv, hi - lo, W]``."""
        return self.pool.index_select(1, self.pool_rows(torch.arange(lo, hi)))

    def select(self, dim: int, i: int) -> torch.Tensor:
        if dim not in (1, -2):
            raise IndexError("StreamRows selects a slot (dimension -2) only")
        return self.range(i, i + 1)[:, 0]

    def __getitem__(self, key):
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None)):
            raise IndexError("StreamRows reads [:, slots] only")
        s = key[1]
        if isinstance(s, int):
            return self.select(1, s)
        lo, hi, step = s.indices(self.shape[1])
        if step != 1:
            raise IndexError("StreamRows reads contiguous slot ranges only")
        return self.range(lo, hi)

    def gather(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """``torch.gather(k, 1, index)`` for ``index [Hkv, X, W]`` (one slot per row, expanded)."""
        if dim != 1:
            raise IndexError("StreamRows gathers slots (dimension 1) only")
        rows = self.pool_rows(index[..., :1])          # [Hkv, X, 1]
        return self.pool.gather(1, rows.expand(-1, -1, self.shape[2]))


def exact_rows(k: StreamRows, v: StreamRows, s0: int, s1: int, n: int, x: int):
    """The rows a call over slots ``[0, n)`` reads exactly, laid out for ``scsa_decode``:
    ``(k_e, v_e)`` ``[1, Hkv, s0 + x + n - s1, W]`` with slots ``[0, s0)`` first and ``[s1, n)``
    last; the ``x`` rows between are left unwritten (the kernel reads the outliers from the
    index's copies, ``extra_k``/``extra_v``), so a call passes slots ``s0 .. s0 + x`` as the
    outliers and ``s0 + x`` as the suffix's start."""
    slots = torch.cat([torch.arange(s0), torch.arange(s1, n)])
    rows = k.pool_rows(slots)
    out = []
    for t in (k, v):
        e = t.pool.new_empty(t.shape[0], s0 + x + n - s1, t.shape[2])
        e[:, :s0] = t.pool.index_select(1, rows[:s0])
        e[:, s0 + x:] = t.pool.index_select(1, rows[s0:])
        out.append(e.unsqueeze(0))
    return out[0], out[1]
