"""The serving engine's step, built ahead of time: every token a row over the paged pool.

One call runs any mix of rows: each decoding stream's next token, a prefill chunk's tokens, or
both. Each row carries its own stream's block table and key positions (``cache.paged.RowBatch``),
stores its key and value in the pool (``longattn_cpu::paged_store``, declared as mutating the
pool, so the write is one call on the pool's memory) and then reads its stream's slots with the
fused decode kernel, whose ``pos_k <= pos_q`` test is the causal mask inside a chunk. Every
weight product runs longattn's row-invariant kernels and every other operation of the graph works
row by row, so a row's logits are the same bits however many rows share the call, which streams
they come from, and how a prompt was cut into chunks: the server's invariance contract holds on
the compiled step as on the eager one (tests/serve/test_paged_step.py).

A sparse policy's layers call SCSA inside the graph (``sparse/paged_op.py``): each row also names
its stream (an input), whose own index the op reads; rows of other policies, and prefill chunks,
run the fused decode kernel there as in a dense build.

Each layer's window and sinks are inputs of the step (``window_table``), so one build serves
every policy whose layers fall into the same groups (``layer_groups``: layers sharing a window and
sinks share one key-position tensor): a dense and a windowed policy, any window, any sinks, and
a request's own window beside the server's. The package is exported once per model structure,
weight format, grouping, block size and pool format (``paged_key``), with the row count, the
pool's size and the table widths as symbols, and cached beside the static decode step's
(engine/aot_step.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from ..cache.base import KVView
from ..cache.kv_format import key_rotation, row_width
from ..cache.paged import BlockPool, RowBatch
from ..errors import LongattnError
from ..ops import native
from ..ops.attention import PagedRows, paged_rows_attention
from ..policy import AttentionPolicy
from ..sparse.paged_op import PagedSparseOp, StepStreams
from ..sparse.policy import sparse_layers
from .aot_step import _build, load_package

PAGED_VERSION = "2"  # bump when the exported step's inputs, outputs or structure change


def _window_sinks(lp) -> tuple:
    """A window layer's (window, sinks) as the kernels take them (0: no window)."""
    return (lp.window or 0, lp.sinks if lp.window else 0)


def layer_groups(policy: AttentionPolicy) -> list:
    """Layers grouped by (window, sinks) in first-seen order: a group's layers hold the same
    logical blocks of a stream, so they share one key-position tensor."""
    keys, groups = [], []
    for layer, lp in enumerate(policy.layers):
        key = _window_sinks(lp)
        if key not in keys:
            keys.append(key)
            groups.append([])
        groups[keys.index(key)].append(layer)
    return groups


def window_table(policy: AttentionPolicy) -> torch.Tensor:
    """int64 ``[L, 2]``: each layer's window (0: none) and sinks, the step's runtime data."""
    return torch.tensor([_window_sinks(lp) for lp in policy.layers], dtype=torch.int64)


def unsupported(model, policy: AttentionPolicy):
    """Why the compiled paged step cannot run ``model`` under ``policy`` (None: it can)."""
    if not native.available():
        return "the native kernels are not built here"
    kinds = {lp.kind for lp in policy.layers}
    if not kinds <= {"window", "sparse"}:
        return f"it runs window, dense and sparse layers only, not {sorted(kinds - {'window', 'sparse'})}"
    if model.activation_dtype != torch.float32:
        return "it runs float32 activations only"
    if any(layer.self_attn.rope_varies for layer in model.model.layers):
        return "this model's rope frequencies follow the sequence length (dynamic or long rope)"
    return None


def paged_key(model, policy: AttentionPolicy, block_size: int, pool_dtype) -> str:
    """Cache key of the compiled paged step: what its generated code depends on (the policy's
    grouping of layers, not its windows and sinks, which are inputs)."""
    parts = {"paged": PAGED_VERSION, "config": dataclasses.asdict(model.config), "weights": model.weights,
             "groups": layer_groups(policy), "block_size": block_size,
             "pool": str(pool_dtype), "torch": torch.__version__, "kernels": native.build_tag(),
             "cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    if sparse_layers(policy):  # their op and the rows' stream input are in the graph
        parts["sparse"] = sparse_layers(policy)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _RowsKV:
    """The cache the traced step talks to: layer ``l`` stores its rows at ``slots[l]`` and reads
    the pool through ``tables[l]`` and its group's ``kpos``."""

    def __init__(self, pool_k, pool_v, slots, tables, kpos, group_of, block_size, key_rotation=None):
        self.pool_k, self.pool_v, self.key_rotation = pool_k, pool_v, key_rotation
        self.slots, self.tables, self.kpos, self.group_of, self.bs = slots, tables, kpos, group_of, block_size

    def update(self, layer: int, k, v, pos) -> KVView:
        """Store ``k, v [R, Hkv, 1, D]``; return the pool read in place."""
        torch.ops.longattn_cpu.paged_store(self.pool_k, self.pool_v, self.slots[layer], k[:, :, 0], v[:, :, 0])
        kpos = self.kpos[self.group_of[layer]]
        n = kpos.shape[1]
        kr = PagedRows(self.pool_k.unsqueeze(0), self.tables[layer], self.bs, n)
        vr = PagedRows(self.pool_v.unsqueeze(0), self.tables[layer], self.bs, n)
        return KVView(kr, vr, kpos, k, v, None, None)

    def advance(self, pos) -> None:
        """The engine advances its streams on the host (``cache.paged.finish_rows``)."""


class _RowsOp:
    """One layer's attention: each row over its stream's slots, the window and sinks read from
    ``ws`` (int64 [2], an input of the step)."""

    learned_sinks = True

    def __init__(self, ws):
        self.ws = ws

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        return paged_rows_attention(q, q_pos, view.k, view.v, view.positions, None, 0, scale, sink_logits,
                                    softcap, self.ws)


class _RowsPolicy:
    def __init__(self, ws: torch.Tensor, sparse: list = (), streams=None, block_size: int = 0):
        self.ops = [PagedSparseOp(ws[i], streams, i, block_size) if i in sparse else _RowsOp(ws[i])
                    for i in range(ws.shape[0])]

    def op(self, i: int):
        return self.ops[i]


class _ExportedRows(torch.nn.Module):
    """``forward(tokens [R], pos [R], sel [S], ws [L, 2], pool_k, pool_v, *slots, *tables, *kpos
    [, rotation] [, streams [R]]) -> logits [S, V]`` (``sel``: the rows whose logits are wanted;
    ``ws``: ``window_table``; ``streams``: with sparse layers, each row's sparse stream or -1)."""

    def __init__(self, model, policy: AttentionPolicy, block_size: int):
        super().__init__()
        self.model = model  # its parameters and buffers are the package's constants
        self.groups = layer_groups(policy)
        self.group_of = [0] * len(policy.layers)
        for g, layers in enumerate(self.groups):
            for layer in layers:
                self.group_of[layer] = g
        self.block_size = block_size
        self.sparse = sparse_layers(policy)

    def forward(self, tokens, pos, sel, ws, pool_k, pool_v, *rest):
        L = len(self.group_of)
        G = len(self.groups)
        extra = list(rest[2 * L + G:])
        streams = extra.pop() if self.sparse else None
        # where the pool's format rotates keys (kv_format.key_rotation): the rotation, an input
        # rather than a constant, as the package's constants are the model's tensors
        rot = extra[0] if extra else None
        kv = _RowsKV(pool_k, pool_v, rest[:L], rest[L:2 * L], rest[2 * L:2 * L + G], self.group_of, self.block_size,
                     rot)
        forward = type(self.model).forward.__wrapped__  # without inference_mode: export traces it
        ops = _RowsPolicy(ws, self.sparse, streams, self.block_size)
        h = forward(self.model, tokens[:, None], pos[:, None], cache=kv, policy=ops, logits="none")
        x = self.model.model.norm(h[:, 0].index_select(0, sel))
        out = self.model.head(x)
        cap = self.model.config.final_softcap
        return cap * torch.tanh(out / cap) if cap else out


def _example(model, policy: AttentionPolicy, pool: BlockPool) -> tuple:
    """Example inputs of distinct sizes (a size of 0 or 1, or two equal sizes, would be
    specialized by export)."""
    cfg, bs = model.config, pool.block_size
    R, S, P, nb = 5, 2, 11 * bs, 3
    groups = layer_groups(policy)
    group_of = {layer: g for g, layers in enumerate(groups) for layer in layers}
    k = torch.zeros(cfg.num_kv_heads, P, row_width(pool.dtype, cfg.head_dim), dtype=pool.dtype)
    slots = [torch.arange(R, dtype=torch.int64) for _ in policy.layers]
    tables = [torch.zeros(R, nb + group_of[layer], dtype=torch.int64) for layer in range(len(policy.layers))]
    kpos = [torch.full((R, (nb + g) * bs), -1, dtype=torch.int64) for g in range(len(groups))]
    streams = [torch.full((R,), -1, dtype=torch.int64)] if sparse_layers(policy) else []
    return (torch.zeros(R, dtype=torch.int64), torch.arange(R, dtype=torch.int64),
            torch.arange(S, dtype=torch.int64), window_table(policy), k, torch.zeros_like(k), *slots, *tables, *kpos,
            *_rotation(pool, cfg), *streams)


def _rotation(pool: BlockPool, cfg) -> list:
    """The step's last input where the pool's format rotates keys: ``[R [D, D]]``, else ``[]``."""
    rot = key_rotation(pool.dtype, cfg.head_dim)
    return [] if rot is None else [rot]


def _dynamic_shapes(policy: AttentionPolicy, rotates: bool) -> tuple:
    groups = layer_groups(policy)
    rows, sel = torch.export.Dim("rows", min=1, max=1 << 20), torch.export.Dim("sel", min=1, max=1 << 20)
    slots = torch.export.Dim("pool", min=2, max=1 << 40)
    nb = [torch.export.Dim(f"nb{g}", min=1, max=1 << 30) for g in range(len(groups))]
    n = [torch.export.Dim(f"n{g}", min=1, max=1 << 34) for g in range(len(groups))]
    group_of = {layer: g for g, layers in enumerate(groups) for layer in layers}
    L = len(policy.layers)
    rest = ([{0: rows}] * L + [{0: rows, 1: nb[group_of[layer]]} for layer in range(L)]
            + [{0: rows, 1: n[g]} for g in range(len(groups))] + [None] * rotates
            + [{0: rows}] * bool(sparse_layers(policy)))
    return ({0: rows}, {0: rows}, {0: sel}, None, {1: slots}, {1: slots}, tuple(rest))


class PagedStep:
    """The compiled paged step of ``model`` over ``pool`` for the policies grouped as ``policy``:
    ``self(batch: RowBatch, sel [S], policy) -> logits [S, V]`` (stores the batch's keys in the
    pool; ``policy``: any policy ``serves`` accepts).

    Raises:
        LongattnError: the model or policy is one it cannot run (``unsupported``).
        AOTBuildError: the package could not be built here.
    """

    def __init__(self, model, policy: AttentionPolicy, pool: BlockPool, progress: bool = True):
        why = unsupported(model, policy)
        if why is not None:
            raise LongattnError(f"the compiled paged step cannot run here: {why}")
        self.model, self.policy, self.pool = model, policy, pool
        self.groups = layer_groups(policy)
        self.key = paged_key(model, policy, pool.block_size, pool.dtype)
        self.sparse = sparse_layers(policy)  # layers whose op reads each row's stream state
        self._tables: dict = {}  # (window, sinks) per layer -> its window_table
        self.rotation = _rotation(pool, model.config)

        def build(entry, progress):
            module = _ExportedRows(model, policy, pool.block_size)
            _build(module, _example(model, policy, pool), _dynamic_shapes(policy, bool(self.rotation)), entry,
                   progress, what="serving step", per="model, format, KV format and machine")

        self.loader = load_package(model, self.key, build, progress)

    def serves(self, policy: AttentionPolicy) -> bool:
        """Whether ``policy`` runs on this build: window layers grouped as the build's, sparse
        layers only where the build has them."""
        return all(lp.kind == "window" or (lp.kind == "sparse" and i in self.sparse)
                   for i, lp in enumerate(policy.layers)) and layer_groups(policy) == self.groups

    def __call__(self, batch: RowBatch, sel: torch.Tensor, policy: AttentionPolicy,
                 sparse: tuple = (None, [])) -> torch.Tensor:
        """Run the step. ``sparse``: with sparse layers, ``(streams [R], entries)``: each row's
        index into ``entries`` (-1: a stream without sparse layers) and, per sparse stream, its
        ``(op_state, policy)`` (sparse/paged_op.py); default: no row is a sparse stream's."""
        key = tuple(_window_sinks(lp) for lp in policy.layers)
        ws = self._tables.get(key)
        if ws is None:
            if len(self._tables) >= 64:  # bounded: requests may bring their own windows
                self._tables.clear()
            ws = self._tables[key] = window_table(policy)
        inputs = [batch.tokens, batch.pos, sel, ws, self.pool.k, self.pool.v, *batch.slots, *batch.tables,
                  *batch.kpos, *self.rotation]
        if not self.sparse:
            return self.loader.boxed_run(inputs)[0]
        streams, entries = sparse
        if streams is None:
            streams = torch.full((batch.rows,), -1, dtype=torch.int64)
        with StepStreams.using(entries):
            return self.loader.boxed_run(inputs + [streams])[0]


class PagedDecoder:
    """A program's own streams on the compiled paged step: prefill eagerly into a paged pool
    (chunked, with the banded and causal kernels where they pay), then decode with the server's
    step. ``generate`` runs this way by default: its windows and sinks are
    inputs of the step, so a window it has never used builds nothing.

    The interface ``engine.session.generate`` drives: ``prefill(prompts, chunk, logits)``,
    ``step(tokens [B], active [B]) -> logits [B, V]``, ``batch``, ``cache.nbytes()``.

    Args:
        model: a Transformer. policy: window/dense layers (default: the checkpoint's windows).
        batch: streams. max_len: most positions a stream reaches (sizes the pool; its pages
            cost memory only once used). block_size: token slots per block. kv_dtype: the pool's.
        progress: a line on stderr while the step is built.
    Raises:
        LongattnError: where the step cannot run (``unsupported``).
    """

    def __init__(self, model, policy: AttentionPolicy | None = None, batch: int = 1, max_len: int = 4096,
                 block_size: int = 16, kv_dtype=torch.float32, progress: bool = True):
        from ..cache.paged import PagedStream, blocks_bound
        self.model, self.batch = model, batch
        self.policy = policy or AttentionPolicy.from_config(model.config)
        why = unsupported(model, self.policy)
        if why is not None:
            raise LongattnError(f"the compiled paged step cannot run here: {why}")
        cfg = model.config
        # a prefill chunk holds its window and itself at once: bounded by max_len; the pool's
        # pages cost memory only once used, and freed blocks are handed out again first
        per_stream = sum(blocks_bound(lp.window or None, lp.sinks if lp.window else 0, max_len, max_len,
                                      block_size) + 1 for lp in self.policy.layers)
        self.pool = BlockPool(batch * per_stream + 1, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        self.paged = PagedStep(model, self.policy, self.pool, progress)
        self.streams = [PagedStream.for_policy(self.policy) for _ in range(batch)]
        self.cache = _PoolUse(self.pool, self.streams)

    def prefill(self, prompts, chunk: int = 512, logits: str = "last") -> torch.Tensor:
        """Eager chunked prefill (``Session.prefill``) straight into the pool: each chunk's keys
        and values are stored in the pool's format, and its attention reads a widened copy of
        what the layer holds with the causal/banded kernels (``PagedLayerCache.gather_chunks``),
        so no float32 copy of the whole cache ever exists."""
        from ..cache.paged import PagedKVCache
        from .session import Session
        session = Session(self.model, self.policy, PagedKVCache(self.model.config, self.pool, self.streams,
                                                                gather_chunks=True))
        return session.prefill(prompts, chunk=chunk, logits=logits)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per active stream: ``tokens [B]`` -> logits ``[B, V]`` (inactive
        streams keep their position; their rows are zeros)."""
        from ..cache.paged import finish_rows, plan_rows
        live = [b for b in range(self.batch) if active is None or bool(active[b])]
        streams = [self.streams[b] for b in live]
        toks = tokens.tolist()
        batch = plan_rows(self.pool, streams, [(self.streams[b].next_pos, [int(toks[b])]) for b in live],
                          self.paged.groups)
        sparse = (torch.arange(len(live)), [(st.op_state, self.policy) for st in streams]) if self.paged.sparse \
            else (None, [])
        logits = self.paged(batch, torch.arange(len(live)), self.policy, sparse)
        finish_rows(self.pool, streams, batch)
        if len(live) == self.batch:
            return logits
        out = logits.new_zeros(self.batch, logits.shape[1])
        out[live] = logits
        return out


class _PoolUse:
    """``nbytes()``: the bytes of the blocks a PagedDecoder's streams hold; ``op_state``: the
    first stream's per-layer op state (what ``sparse.policy.stream_layers`` reads of a run)."""

    def __init__(self, pool: BlockPool, streams: list):
        self.pool, self.streams = pool, streams

    def nbytes(self) -> int:
        return sum(st.blocks() for st in self.streams) * self.pool.block_bytes

    @property
    def op_state(self) -> list:
        return self.streams[0].op_state
