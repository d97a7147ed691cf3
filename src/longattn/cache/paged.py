"""Paged KV cache: fixed-size blocks from one pool, one block table per layer per stream.

Storage is a single ``BlockPool`` of ``num_blocks`` blocks of ``block_size`` token slots
(``[Hkv, num_blocks * block_size, D]`` for K and for V), shared by every layer of every
stream. A stream (``PagedStream``) owns, per layer, a table from logical block ``j``
(positions ``j*bs .. j*bs+bs-1``) to a physical block of the pool.

A windowed layer (window W, sinks S) frees a block as soon as every position in it has left
the window of the next query ``q`` (the block ends before ``q - W + 1``), except blocks that
hold a sink position (``j*bs < S``): a stream's memory on such a layer stays at most
``ceil(S/bs) + ceil((W - 1 + T)/bs) + 1`` blocks for chunks of T tokens, however long it
runs. Global layers keep every block.

``PagedLayerCache.update`` returns the same view every cache returns,
``(k_all [B, Hkv, N, D], v_all, k_pos [B, N])``: the held blocks of each stream in position
order (a gather from the pool), slots past a stream's end or padding a shorter row at -1.
While nothing has been freed the view is laid out exactly like a growing cache's (slot i =
position i), so attention over it is the growing cache's arithmetic. A decode step's view is
read in place: the fused decode kernel takes the pool and each stream's block table
(``ops.attention.PagedRows``) and reads the very rows a gathered view would hold, in the same
order, so its output is the same bits; a gather costs about twice the attention that reads it.
Prefill chunks, and decode where the kernels are not built, read a gathered copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import LongattnError, check_int
from ..ops.attention import PagedRows
from .base import KVCache, LayerCache
from .kv_format import encode, key_rotation, row_bytes, row_width


# the attention kinds a paged stream holds blocks for ("sparse": every block, as a global layer)
PAGED_KINDS = ("window", "sparse")


class PoolExhausted(LongattnError):
    """The pool has no free block (admission control should have prevented it)."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots of ``[Hkv, D]`` keys and values.

    Blocks are handed out and taken back by id; a block's slots are
    ``id * block_size .. id * block_size + block_size - 1`` of ``k`` / ``v`` (dimension 1).
    """

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype=torch.float32):
        check_int("KV pool blocks", num_blocks, minimum=1)
        check_int("KV block size", block_size, minimum=1)
        self.num_blocks, self.block_size = num_blocks, block_size
        # Uninitialised: a page of the pool is touched (and costs memory) only once a block on it
        # is first handed out, which zeroes it; block 0 is zeroed now, as views pad with it.
        # [Hkv, N*bs, W]: rows of head_dim values as the format stores them (kv_format.py)
        self.k = torch.empty(kv_heads, num_blocks * block_size, row_width(dtype, head_dim), dtype=dtype)
        self.v = torch.empty_like(self.k)
        self._zero(0)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest id is handed out first
        self.dtype, self.head_dim = dtype, head_dim

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one block holds."""
        return self.bytes_per_block(self.block_size, self.k.shape[0], self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_block(block_size: int, kv_heads: int, head_dim: int, dtype) -> int:
        """Bytes of K and V one block of such a pool holds (before any pool is made)."""
        return 2 * block_size * kv_heads * row_bytes(dtype, head_dim)

    def alloc(self) -> int:
        if not self._free:
            raise PoolExhausted(f"the KV pool's {self.num_blocks} blocks are all in use")
        block = self._free.pop()
        self._zero(block)  # slots a view reads before they are written hold zeros, never garbage
        return block

    def _zero(self, block: int) -> None:
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        self.k[:, rows].zero_()
        self.v[:, rows].zero_()

    def release(self, block: int) -> None:
        self._free.append(block)


class BlockTable(dict):
    """One layer's logical block -> physical block of a stream, in position order. ``version``
    changes with every change, so what is derived from the table (its blocks and positions as
    tensors, ``phys`` and ``positions``) is made again only when it changed: a decode step
    allocates a block once every ``block_size`` tokens."""

    __slots__ = ("version", "_phys", "_positions")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version, self._phys, self._positions = 0, None, None

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key):
        super().__delitem__(key)
        self.version += 1

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def clear(self):
        self.version += 1
        super().clear()

    def phys(self) -> torch.Tensor:
        """int64 ``[NB]``: the physical blocks in position order."""
        if self._phys is None or self._phys[0] != self.version:
            self._phys = (self.version, torch.tensor(list(self.values()), dtype=torch.int64))
        return self._phys[1]

    def positions(self, block_size: int) -> torch.Tensor:
        """int64 ``[NB * block_size]``: the position each slot of the blocks stands for."""
        if self._positions is None or self._positions[0] != self.version:
            logical = torch.tensor(list(self), dtype=torch.int64)
            self._positions = (self.version, (logical[:, None] * block_size + torch.arange(block_size)).reshape(-1))
        return self._positions[1]


@dataclass
class PagedStream:
    """One stream's pages: per layer, logical block -> physical block (in position order).

    ``windows[l]`` / ``sinks[l]``: the layer's window (None = global) and sinks, which decide
    what it may free. ``rewind``: windowed layers keep this many positions more than the next
    query reads, so the stream can still be continued from up to ``rewind`` positions back
    (``truncate``): a chat's next turn often re-renders the end of the last reply differently
    (a template that trims it, a word cut by max_tokens), and without the margin a window would
    already have freed what continuing from there reads. ``next_pos``: positions
    ``0 .. next_pos - 1`` have been stored. ``op_state``: per layer, what its attention op keeps
    across this stream's steps (``KVView.state``: a sparse layer's index and taus), read by a
    ``PagedKVCache`` over this stream alone; it lives and dies with the stream's blocks.
    """

    windows: list
    sinks: list
    tables: list = field(default_factory=list)
    next_pos: int = 0
    rewind: int = 0
    op_state: list = field(default_factory=list)

    def __post_init__(self):
        self.tables = [BlockTable(t) for t in self.tables] if self.tables else [BlockTable() for _ in self.windows]
        self.op_state = self.op_state or [{} for _ in self.windows]

    @classmethod
    def for_policy(cls, policy, rewind: int = 0) -> "PagedStream":
        """A stream whose layers free blocks by ``policy``'s windows and sinks (``rewind``: see
        the class); sparse layers keep every block, as global ones do."""
        for lp in policy.layers:
            if lp.kind not in PAGED_KINDS:
                raise LongattnError(f"the paged cache serves {', '.join(PAGED_KINDS)} layers only, not '{lp.kind}'")
        return cls([lp.window if lp.window else None for lp in policy.layers],
                   [lp.sinks if lp.window else 0 for lp in policy.layers], rewind=rewind)

    def blocks(self) -> int:
        """Blocks held over all layers."""
        return sum(len(t) for t in self.tables)

    def release(self, pool: BlockPool) -> None:
        """Give every block back to the pool (the stream is finished or abandoned), and what its
        ops kept about them."""
        for t in self.tables:
            for b in t.values():
                pool.release(b)
            t.clear()
        self.op_state = [{} for _ in self.windows]

    def can_truncate(self, n: int, pool: BlockPool) -> bool:
        """Whether every layer still holds what a query at ``n`` reads: its sinks and positions
        ``max(S, n - W + 1) .. n - 1`` on windowed layers, ``0 .. n - 1`` on global ones."""
        bs = pool.block_size
        if n > self.next_pos:
            return False
        for t, w, s in zip(self.tables, self.windows, self.sinks):
            lo = 0 if w is None else max(0, n - w + 1)
            need = set(range(0, -(-min(s, n) // bs))) | set(range(lo // bs, -(-n // bs)))
            if not need.issubset(t.keys()):
                return False
        return True

    def truncate(self, n: int, pool: BlockPool) -> bool:
        """Forget positions ``n ..`` so the stream can continue from position ``n``; possible
        only where ``can_truncate(n)``. Returns False (and changes nothing) otherwise."""
        bs = pool.block_size
        if not self.can_truncate(n, pool):
            return False
        for t in self.tables:
            for j in [j for j in t if j * bs >= n]:
                pool.release(t.pop(j))
        self.next_pos = n
        return True


    def free_out_of_window(self, layer: int, end: int, pool: BlockPool) -> None:
        """Give back the blocks of ``layer`` that no query from ``end`` on reads (windowed
        layers; sink blocks and the ``rewind`` margin stay)."""
        w, s = self.windows[layer], self.sinks[layer]
        if w is None:
            return
        bs, lo = pool.block_size, end - w + 1 - self.rewind  # first position kept: the next
        # query reads from end - w + 1; rewind more are kept to continue from further back
        table = self.tables[layer]
        for j in [j for j in table if (j + 1) * bs <= lo and j * bs >= s]:
            pool.release(table.pop(j))


def blocks_bound(window: Optional[int], sinks: int, tokens: int, chunk: int, block_size: int,
                 rewind: int = 0) -> int:
    """Most blocks one layer of a stream holds at once while storing ``tokens`` positions
    in chunks of at most ``chunk`` (a window frees what leaves it, keeping ``rewind`` positions
    more; global layers keep all)."""
    total = -(-tokens // block_size)
    if window is None:
        return total
    held = -(-min(sinks, tokens) // block_size) + -(-(window - 1 + chunk + rewind) // block_size) + 1
    return min(total, held)


class PagedLayerCache(LayerCache):
    """Layer ``layer`` of the streams ``streams`` (one batch row each), stored in ``pool``.

    ``gather_chunks``: a chunk of more than one token reads a gathered, widened copy of the view
    (the tensors a growing cache returns, so the causal and banded prefill kernels apply) instead
    of the pool in place (every query a row of the fused decode kernel, the same bits as decoding
    it: what the server needs). ``generate`` prefills this way: its prompt is stored once, in the
    pool's format, with the prefill kernels' speed."""

    def __init__(self, pool: BlockPool, layer: int, streams: list, kpos_memo: Optional[dict] = None,
                 gather_chunks: bool = False):
        self.pool, self.layer, self.streams = pool, layer, streams
        self.gather_chunks = gather_chunks
        # key positions by (logical blocks, row lengths), shared by the layers of one step:
        # layers with the same window hold the same logical blocks, so most find it made
        self.kpos_memo = {} if kpos_memo is None else kpos_memo

    def update(self, k, v, pos):
        """Store ``k, v [B, Hkv, T, D]`` at positions ``pos [B, T]`` (-1 = padding), return the
        held blocks as ``(k_all [B, Hkv, N, D], v_all, k_pos [B, N])``, then free what the next
        query cannot read. A row's positions must continue its stream (``next_pos`` on)."""
        pool, bs = self.pool, self.pool.block_size
        # Slots are worked out on Python ints: this runs for every layer of every step, and
        # per-stream tensor indexing cost more than the step's attention with many streams.
        rows = pos.tolist()
        slots, b_idx, t_idx, ends = [], [], [], []
        for b, (st, row) in enumerate(zip(self.streams, rows)):
            table, last = st.tables[self.layer], -1
            for t, p in enumerate(row):
                if p < 0:
                    continue
                blk = table.get(p // bs)
                if blk is None:
                    blk = table[p // bs] = pool.alloc()
                slots.append(blk * bs + p % bs)
                b_idx.append(b)
                t_idx.append(t)
                last = p
            ends.append(max(st.next_pos, last + 1))
        slots_t = torch.tensor(slots, dtype=torch.int64)
        if len(slots) == k.shape[0] * k.shape[2]:  # no padding: every (row, token) in order
            kk, vv = (x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3]) for x in (k, v))
        else:
            bi, ti = torch.tensor(b_idx, dtype=torch.int64), torch.tensor(t_idx, dtype=torch.int64)
            kk, vv = (x.permute(1, 0, 2, 3)[:, bi, ti] for x in (k, v))  # [Hkv, M, D]
        pool.k[:, slots_t] = encode(kk, pool.dtype)
        pool.v[:, slots_t] = encode(vv, pool.dtype)
        k_all, v_all, k_pos = self._view(ends)
        if self.gather_chunks and k.shape[2] > 1:
            k_all, v_all = (x.widened(k.shape[3], k.dtype) for x in (k_all, v_all))
        for st, end in zip(self.streams, ends):
            st.free_out_of_window(self.layer, end, pool)
        return k_all, v_all, k_pos

    def _view(self, ends: list):
        """Each stream's held blocks in position order, padded to the longest row:
        ``(k, v, k_pos [B, N])``, k and v as ``PagedRows``: the fused kernel reads them in place
        (decode steps and prefill chunks alike); ``ops.attention.attend`` gathers them block by
        block for any other kernel, so nothing is copied here."""
        bs = self.pool.block_size
        rows = [st.tables[self.layer] for st in self.streams]
        # a row ends at its stream's end, not its last block's: the slots past it hold
        # nothing, and a view of exactly the stored positions keeps the growing cache's shapes
        lens = [len(r) * bs - ((next(reversed(r)) + 1) * bs - end) if r else 0 for r, end in zip(rows, ends)]
        n, blocks = max(lens), max(len(r) for r in rows)
        # padding names block 0 (never read) at logical block -1 (positions < 0: empty)
        phys = torch.tensor([list(r.values()) + [0] * (blocks - len(r)) for r in rows], dtype=torch.int64)
        key = (tuple(tuple(r) for r in rows), tuple(lens))
        kpos = self.kpos_memo.get(key)
        if kpos is None:
            logical = torch.tensor([list(r) + [-1] * (blocks - len(r)) for r in rows], dtype=torch.int64)
            kpos = (logical[:, :, None] * bs + torch.arange(bs)).reshape(len(rows), blocks * bs)
            kpos = torch.where((logical[:, :, None] >= 0).expand(-1, -1, bs).reshape(kpos.shape)
                               & (torch.arange(blocks * bs) < torch.tensor(lens)[:, None]), kpos, -1)[:, :n]
            self.kpos_memo[key] = kpos
        k, v = (PagedRows(t.unsqueeze(0), phys, bs, n) for t in (self.pool.k, self.pool.v))
        return k, v, kpos

    def nbytes(self) -> int:
        return sum(len(st.tables[self.layer]) for st in self.streams) * self.pool.block_bytes

    def positions(self) -> torch.Tensor:
        return self._view([st.next_pos for st in self.streams])[2]


class PagedKVCache(KVCache):
    """The KVCache the model talks to for one forward over ``streams`` (one row each).

    Cheap to build: a scheduler makes one per step for whichever streams run in it, so
    streams join and leave the batch between steps while their blocks stay in the pool. Over one
    stream, its op state (KVView.state) is the stream's own (``PagedStream.op_state``), kept
    across steps (a sparse layer's index); over several it lasts one step.
    """

    def __init__(self, cfg, pool: BlockPool, streams: list, gather_chunks: bool = False):
        if not streams:
            raise LongattnError("a paged cache needs at least one stream")
        self.pool, self.streams = pool, list(streams)
        memo: dict = {}
        super().__init__(cfg, len(self.streams),
                         layers=[PagedLayerCache(pool, i, self.streams, memo, gather_chunks)
                                 for i in range(cfg.num_layers)],
                         dtype=pool.dtype)
        if len(self.streams) == 1:
            self.op_state = self.streams[0].op_state
        self.next_pos = torch.tensor([st.next_pos for st in self.streams], dtype=torch.int64)

    def advance(self, pos: torch.Tensor) -> None:
        super().advance(pos)
        for st, n in zip(self.streams, self.next_pos.tolist()):
            st.next_pos = n


@dataclass
class RowBatch:
    """The host side of one compiled paged step (engine/paged_step.py): every token is a row
    that carries its own stream's block table, so decode rows of many streams and a prefill
    chunk's rows share one call, and each row is computed the same way whatever shares it.

    ``R`` rows, streams in order, each stream's tokens in position order:
    tokens, pos: int64 ``[R]``.
    slots: per layer, int64 ``[R]``: the pool row each token's key and value are stored in.
    tables: per layer, int64 ``[R, NB]``: the row's stream's blocks in position order (padding
        names block 0, never read).
    kpos: per group of layers with one window and sinks, int64 ``[R, NB * block_size]``: the
        position each table slot holds (-1: empty or past the stream's end).
    ends: per stream, its ``next_pos`` once the step has run.
    """

    tokens: torch.Tensor
    pos: torch.Tensor
    slots: list
    tables: list
    kpos: list
    ends: list

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


def plan_rows(pool: BlockPool, streams: list, segments: list, groups: list) -> RowBatch:
    """Allocate the blocks a step stores into and lay out its inputs.

    Args:
        pool: the BlockPool. streams: PagedStreams, one per segment.
        segments: per stream ``(start, tokens)``: the token ids stored at positions
            ``start ..`` (``start`` is the stream's ``next_pos``).
        groups: lists of layers that share a window and sinks (they hold the same logical
            blocks, so one key-position tensor serves them).
    Returns:
        a RowBatch; ``finish_rows`` records it once the step has run.
    """
    bs = pool.block_size
    counts = [len(toks) for _, toks in segments]
    for st, (start, _) in zip(streams, segments):
        if start != st.next_pos:
            raise LongattnError(f"a stream at position {st.next_pos} was asked to store from {start}")
    rep = torch.tensor(counts, dtype=torch.int64)
    same = all(c == 1 for c in counts)  # decode rows only: one row per stream, nothing to repeat

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t if same else t.repeat_interleave(rep, 0)

    ends = [start + n for (start, _), n in zip(segments, counts)]
    num_layers = sum(len(g) for g in groups)
    slots, tables, kpos = [None] * num_layers, [None] * num_layers, []
    for layers in groups:
        for layer in layers:
            slot = []
            for st, (start, _), end in zip(streams, segments, ends):
                table = st.tables[layer]
                for j in range(start // bs, (end - 1) // bs + 1):
                    if j not in table:
                        table[j] = pool.alloc()
                slot.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables[layer] = per_row(_padded([st.tables[layer].phys() for st in streams], 0))
            slots[layer] = slot
        kp = _padded([st.tables[layers[0]].positions(bs) for st in streams], -1)  # [B, NB * bs]
        kpos.append(per_row(torch.where(kp < torch.tensor(ends)[:, None], kp, -1)))
    slots = list(torch.tensor(slots, dtype=torch.int64).unbind(0))  # one conversion for every layer
    tokens = torch.tensor([t for _, toks in segments for t in toks], dtype=torch.int64)
    pos = torch.tensor([p for (start, _), n in zip(segments, counts) for p in range(start, start + n)],
                       dtype=torch.int64)
    return RowBatch(tokens, pos, slots, tables, kpos, ends)


def _padded(rows: list, fill: int) -> torch.Tensor:
    """1-D int64 tensors -> ``[len(rows), longest]``, the shorter ones padded with ``fill``."""
    if len(rows) == 1:
        return rows[0][None]
    n = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), n), fill, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out


def finish_rows(pool: BlockPool, streams: list, batch: RowBatch) -> None:
    """After a step over ``batch`` ran: advance each stream and free what its windows left."""
    for st, end in zip(streams, batch.ends):
        st.next_pos = end
        for layer in range(len(st.tables)):
            st.free_out_of_window(layer, end, pool)
