"""A fixed-shape decode step that ``torch.compile`` traces once.

The eager decode path (``Session.step``) grows caches, picks attention kernels by looking at
position values, and runs ~25 small PyTorch calls per layer, each paying Python and dispatch
overhead. Here every layer's K/V lives in a buffer allocated up front:

* full-attention layers: ``max_len`` slots, slot = absolute position;
* windowed layers: ``sinks + window`` slots, slot = ``ring_slot(pos)`` (cache/ring.py);

plus one "bin" slot per layer where padding tokens are written and which is never read
(its position stays -1). Layers with the same slot rule are stacked in one buffer per group
(see StaticKV). The compiled step reads the buffers and never writes them: each layer attends
over the slots of its buffer that ``allowed_mask``'s rule admits (decided from the slot
positions; by default inside longattn's fused C++ kernel, ops/csrc/decode_attention.cpp) plus
the step's own new key, in one softmax, and returns the new keys; they are written by index
(``scatter_``, one per group) after the step. (Written inside the graph, inductor would copy every
buffer whole on every step.) Shapes never change and nothing branches on tensor values: one graph
for the whole decode, no recompilation (tests/engine/test_static_decode.py counts them).

Sparse (SCSA) layers keep full-attention buffers and call one opaque custom op
(sparse/static_op.py): the index, calibration and selection run behind it at run time, so the
step stays one graph.

Prefill runs through an ordinary eager Session (chunked, banded where it pays) and its cache
is then copied into the buffers. Attention over the buffer reads masked slots too, so a
full-attention layer costs O(max_len) per step: size ``max_len`` to the job.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from ..cache.base import KVView
from ..cache.ring import ring_slot
from ..errors import LongattnError
from ..ops import native
from ..ops.attention import attend_buffer_and_new, static_kernel
from ..policy import AttentionPolicy
from ..sparse.policy import policy_taus
from ..sparse.static_op import SparseState, StaticSparseOp
from .session import Session


RECOMPILE_LIMIT = 256
# Inductor's C++ wrapper calls the step's kernels and extern ops from C++ instead of one Python
# line each, which takes the per-kernel Python overhead out of every step. The price is a
# longer cold compile (inductor's on-disk cache makes later runs fast).
DEFAULT_INDUCTOR_OPTIONS = {"cpp_wrapper": True}


class StaticKV:
    """Preallocated K/V buffers, written by index, stacked per group of layers that share a shape.

    Args:
        cfg: ModelConfig. policy: AttentionPolicy (only "window" kinds).
        batch: streams. max_len: most positions a stream may reach (full-attention layers).
        dtype: storage dtype.
    Layers with the same slot rule (full attention, or the same ring of ``sinks + window``)
    form a group. Group ``g`` holds ``kg[g], vg[g]`` of ``[L_g, B, Hkv, S_g + 1, D]`` and one
    ``posg[g]`` of ``[B, S_g + 1]`` (-1 = empty): slot positions are the same for every layer
    of a group, so one tensor serves them all. The last slot is the padding bin. Layer ``l``
    is ``kg[g][i]`` with ``(g, i) = group_of[l]``. Stacking makes the write after a step one
    scatter per group instead of three per layer (90 small calls on a 30-layer model).
    """

    def __init__(self, cfg, policy: AttentionPolicy, batch: int, max_len: int, dtype=torch.float32):
        self.batch, self.max_len = batch, max_len
        self.group_of: list = []  # per layer: (group, index within the group)
        self.group_rings: list = []  # per group: (sinks, window), or None for slot = position
        members: list = []  # per group: its layers
        for layer, lp in enumerate(policy.layers):
            ring = (lp.sinks, lp.window) if lp.window is not None and lp.sinks + lp.window < max_len else None
            if ring not in self.group_rings:
                self.group_rings.append(ring)
                members.append([])
            g = self.group_rings.index(ring)
            self.group_of.append((g, len(members[g])))
            members[g].append(layer)
        self.members = members
        self.kg, self.vg, self.posg = [], [], []
        for ring, layers in zip(self.group_rings, members):
            cap = sum(ring) if ring is not None else max_len
            self.kg.append(torch.zeros(len(layers), batch, cfg.num_kv_heads, cap + 1, cfg.head_dim, dtype=dtype))
            self.vg.append(torch.zeros_like(self.kg[-1]))
            self.posg.append(torch.full((batch, cap + 1), -1, dtype=torch.int64))
        self.pending: dict = {}  # layer -> (k, v) of the step being traced/run
        # per layer: what its op keeps (KVView.state); the sparse layers' SCSA state is the
        # decoder's SparseState, which the compiled step reaches by key (sparse/static_op.py)
        self.op_state = [{} for _ in policy.layers]

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.kg, self.vg))

    def _slots(self, ring, cap: int, pos: torch.Tensor) -> torch.Tensor:
        """``pos [B, T]`` -> slot indices ``[B, T]`` of a group (padding -> the bin slot ``cap``)."""
        slot = pos.clamp(min=0) if ring is None else ring_slot(pos.clamp(min=0), *ring)
        return torch.where(pos < 0, torch.full_like(slot, cap), slot)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> KVView:
        """Hold the step's ``k, v [B, Hkv, 1, D]`` aside (``pending``) and return the buffers
        as they were, with the new keys beside them in the view: the step attends over both
        (see _StaticOp), and ``write`` stores the new keys after the step. Writing inside a
        compiled graph would make inductor copy every whole buffer on every step
        (functionalized scatter)."""
        self.pending[layer] = (k, v)
        g, i = self.group_of[layer]
        return KVView(self.kg[g][i], self.vg[g][i], self.posg[g], k, v, self.op_state[layer])

    def stacked_pending(self) -> list:
        """Per group, the step's new keys and values stacked: ``([L_g, B, Hkv, 1, D], same)``."""
        return [(torch.stack([self.pending[l][0] for l in layers]),
                 torch.stack([self.pending[l][1] for l in layers])) for layers in self.members]

    def write(self, pending: list, pos: torch.Tensor) -> None:
        """Store one step's keys ``pending`` (from ``stacked_pending``) at ``pos [B, 1]``
        (padding -> bin slot)."""
        for g, (k, v) in enumerate(pending):
            cap = self.posg[g].shape[1] - 1
            slot = self._slots(self.group_rings[g], cap, pos)  # [B, 1]
            L, B, H, T, D = k.shape
            idx = slot.view(1, B, 1, T, 1).expand(L, B, H, T, D)
            self.kg[g].scatter_(3, idx, k.to(self.kg[g].dtype))
            self.vg[g].scatter_(3, idx, v.to(self.vg[g].dtype))
            self.posg[g].scatter_(1, slot, pos)

    def advance(self, pos: torch.Tensor) -> None:
        """The decoder tracks positions on the host; nothing to record here."""

    def load(self, cache) -> None:
        """Copy an eager KVCache (after prefill) into the buffers.

        Ring layers keep, per stream, the sinks and the last ``window`` positions (what a ring
        would hold); everything else is dropped before writing so no two tokens share a slot.
        Every layer of a group must hold the same positions (they do after any prefill).
        """
        for t in (*self.kg, *self.vg):
            t.zero_()
        for t in self.posg:
            t.fill_(-1)
        for layer, lc in enumerate(cache.layers):
            k, v, pos = lc.view()  # [B, Hkv, N, D], [B, N]
            g, i = self.group_of[layer]
            ring, cap = self.group_rings[g], self.posg[g].shape[1] - 1
            for b in range(self.batch):
                p = pos[b]
                keep = p >= 0
                if ring is not None:
                    sinks, window = ring
                    last = int(p.max()) if bool(keep.any()) else -1
                    keep &= (p < sinks) | (p > last - window)
                elif bool(keep.any()) and int(p[keep].max()) >= self.max_len:
                    raise LongattnError(f"prompt reaches position {int(p[keep].max())}; "
                                        f"the static decoder holds {self.max_len} (raise max_len)")
                idx = keep.nonzero().squeeze(1)
                slots = self._slots(ring, cap, p[idx][None])[0]
                if i == 0:
                    self.posg[g][b, slots] = p[idx]
                elif not torch.equal(self.posg[g][b, slots], p[idx]):
                    raise LongattnError("layers of one group hold different positions; "
                                        "the static decoder needs one position set per group")
                self.kg[g][i, b, :, slots] = k[b, :, idx].to(self.kg[g].dtype)
                self.vg[g][i, b, :, slots] = v[b, :, idx].to(self.vg[g].dtype)


class _StaticOp:
    """Decode attention over a whole static buffer plus the step's pending key (no branching
    on values: the kernel is resolved once, by ``ops.attention.static_kernel``)."""

    learned_sinks = True  # every static kernel has the sink term (ops.attention.attend_buffer_and_new)

    def __init__(self, window: Optional[int], sinks: int, kernel: str = "fused"):
        self.window, self.sinks, self.kernel = window, sinks, static_kernel(kernel)

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        return attend_buffer_and_new(q, q_pos, view.k, view.v, view.positions, view.new_k, view.new_v,
                                     self.window, self.sinks, scale, softcap, self.kernel, sink_logits)


class _StaticPolicy:
    def __init__(self, policy: AttentionPolicy, kernel: str = "fused", sparse: Optional[SparseState] = None):
        self.ops = [StaticSparseOp(sparse, i) if lp.kind == "sparse" else _StaticOp(lp.window, lp.sinks, kernel)
                    for i, lp in enumerate(policy.layers)]

    def op(self, i: int):
        return self.ops[i]


class StaticDecoder:
    """Prefill eagerly, then decode with a fixed-shape (optionally compiled) step.

    Args:
        model: a Transformer (any weight format).
        policy: AttentionPolicy of "window" layers (dense, windows, sinks; default the
            checkpoint's windows) and "sparse" layers (SCSA, one SCSALayer per layer and
            stream in ``self.sparse``; see sparse/static_op.py). Re-indexing needs the eager
            Session.
        batch: streams. max_len: positions a stream may reach (prompt + new tokens).
        compile: ``True``: ``torch.compile`` the step (inductor, static shapes, one graph,
            traced in every process); ``"aot"``: load the step built ahead of time for this
            model's structure from the cache, building it there first if needed (any
            ``max_len``; engine/aot_step.py; window and dense layers, native kernels);
            ``False``: run it eagerly.
        dynamic: compile the full-attention buffers' length as a symbol, so ``reset`` to
            another ``max_len`` reuses the graph instead of compiling a new one (``True`` only).
        inductor_options: ``torch.compile`` options (inductor config keys); default
            ``DEFAULT_INDUCTOR_OPTIONS`` (the C++ wrapper), ``{}`` for inductor's defaults.
        attention: how the step reads its buffers: "fused" (the default: longattn's C++
            kernel, ops/csrc/decode_attention.cpp, one pass over the allowed slots with the
            mask decided from positions inline; float32 buffers without a softcap, else it
            reads by "matmul"), "matmul" (two batched matmuls and a softmax, fused by
            inductor) or "flash" (ATen's blocked CPU flash kernel, then the step's own key
            merged in closed form; softcap layers read by matmul).
    """

    def __init__(self, model, policy: Optional[AttentionPolicy] = None, batch: int = 1,
                 max_len: int = 4096, compile: bool = True, dynamic: bool = False,
                 inductor_options: Optional[dict] = None, attention: str = "fused"):
        self.model = model
        self.policy = policy or AttentionPolicy.from_config(model.config)
        kinds = {lp.kind for lp in self.policy.layers}
        bad = sorted(kinds - {"window", "sparse"})
        if bad:
            raise LongattnError(f"the static decoder runs window/dense/sparse layers only, not {bad}; "
                                "use the eager Session for these")
        cfg = model.config
        if "sparse" in kinds and cfg.attn_softcap is not None:
            raise LongattnError("sparse layers with score soft-capping run in the eager Session only")
        from ..sparse import SCSAConfig
        self.sparse = SparseState(self.policy.sparse_config or SCSAConfig(), cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, policy_taus(self.policy)) if "sparse" in kinds else None
        static_kernel(attention)  # refuses an unknown name before any buffer is made
        if compile not in (True, False, "aot"):
            raise LongattnError(f"compile is True, False or 'aot', got {compile!r}")
        if compile == "aot" and "sparse" in kinds:
            raise LongattnError("the ahead-of-time step runs window and dense layers only; "
                                "use compile=True for sparse layers")
        if compile == "aot" and dynamic:
            raise LongattnError("dynamic is for compile=True: the ahead-of-time step serves every length already")
        self.batch, self.dynamic, self.attention = batch, dynamic, attention
        self._policy = _StaticPolicy(self.policy, attention, self.sparse)
        self.compiled = compile
        self.inductor_options = dict(DEFAULT_INDUCTOR_OPTIONS if inductor_options is None else inductor_options)
        self._compiled = self._compile() if compile is True else None
        self._aot = None  # the AOTStep for the current buffers (reset loads it)
        self._cache_tag = "|".join(t for t in (torch.compiler.config.cache_key_tag, native.build_tag()) if t)
        self.reset(max_len)

    def _compile(self):
        """torch.compile of this decoder's own copy of ``_step_eager``.

        Dynamo keeps its compiled graphs on the code object, so with one shared code object
        every decoder's step would check guards on every parameter of every model to find its
        graph. A private code object holds only this decoder's graphs, so the guards on the
        model's parameters and buffers can be skipped. The price: the model must not be changed
        (weights replaced, re-quantized) once the decoder has compiled; build a new decoder instead.
        """
        fn = StaticDecoder._step_eager
        private = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                   **self.inductor_options}
        return torch.compile(types.MethodType(private, self), dynamic=False, fullgraph=True, options=options)

    def reset(self, max_len: Optional[int] = None) -> None:
        """Forget every stream (new buffers of ``max_len`` positions, default the current)."""
        max_len = self.max_len if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise LongattnError(f"max_len must be a positive integer, got {max_len!r}")
        self.max_len = max_len
        self.session = Session(self.model, self.policy, batch=self.batch)
        if self.sparse is not None:
            self.sparse.reset()
        self.kv = StaticKV(self.model.config, self.policy, self.batch, max_len,
                           dtype=self.model.activation_dtype)
        if self.dynamic:
            for g, ring in enumerate(self.kv.group_rings):
                if ring is None:
                    for t, dim in ((self.kv.kg[g], 3), (self.kv.vg[g], 3), (self.kv.posg[g], 1)):
                        torch._dynamo.mark_dynamic(t, dim)
        self.next_pos = torch.zeros(self.batch, dtype=torch.int64)
        if self.compiled == "aot":
            from .aot_step import AOTStep, step_key
            # one package serves every length; another only where the buffers' layout changed
            # (a window that no longer fits max_len makes its ring a full buffer)
            key = step_key(self)
            if self._aot is None or self._aot.key != key:
                self._aot = AOTStep(self, key)

    def _step(self, tokens: torch.Tensor, pos: torch.Tensor):
        """-> (logits ``[B, V]``, per group the stacked ``(k, v)`` of this step, not yet written)."""
        try:
            return self._run(tokens, pos)
        finally:
            self.kv.pending.clear()  # every call starts from the same (traced) state

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor):
        if self._aot is not None:
            return self._aot(tokens, pos)
        if self._compiled is None:
            return self._step_eager(tokens, pos)
        # dynamo counts compiled variants per code object (here: per decoder, see _compile);
        # a generous limit keeps a decoder reset to many lengths from failing under fullgraph.
        # The graph calls longattn's C++ kernels: its on-disk cache entries are keyed by their
        # build too (native.build_tag), so a graph made for another build is never loaded.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch.compiler.config.patch(cache_key_tag=self._cache_tag):
            return self._compiled(tokens, pos)

    def _step_eager(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # Transformer.forward without its inference_mode wrapper: dynamo cannot trace
        # inference tensors, so the static path runs under no_grad with ordinary tensors.
        forward = type(self.model).forward.__wrapped__
        logits = forward(self.model, tokens[:, None], pos, cache=self.kv, policy=self._policy,
                         logits="all")[:, 0]
        return logits, self.kv.stacked_pending()

    def prefill(self, prompts, chunk: int = 512, logits: str = "last") -> torch.Tensor:
        """Eager chunked prefill (see Session.prefill), then fill the static buffers."""
        out = self.session.prefill(prompts, chunk=chunk, logits=logits)
        self.load_cache(self.session.cache)
        return out

    def load_cache(self, cache) -> None:
        """Continue from an eager KVCache (e.g. one prefilled elsewhere)."""
        with torch.no_grad():
            self.kv.load(cache)
        self.next_pos = torch.tensor(cache.next_pos.tolist(), dtype=torch.int64)

    @torch.no_grad()
    def warmup(self) -> float:
        """Compile (or just run) the step once on padding-only input; returns its seconds.

        Every stream is inactive and the step's keys are discarded: no state changes.
        """
        import time
        t0 = time.perf_counter()
        self._step(torch.zeros(self.batch, dtype=torch.int64),
                   torch.full((self.batch, 1), -1, dtype=torch.int64))  # nothing written
        return time.perf_counter() - t0

    @property
    def cache(self) -> StaticKV:
        return self.kv

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode one token per stream: ``tokens [B]`` int64 -> logits ``[B, V]``.

        ``active [B]`` bool: inactive streams write the bin slot, keep their position, and
        their logits are junk (as in Session.step).
        """
        live = torch.ones(self.batch, dtype=torch.bool) if active is None else \
            torch.tensor(active.tolist(), dtype=torch.bool)
        if int(self.next_pos[live].max()) >= self.max_len and None in self.kv.group_rings:
            raise LongattnError(f"the static decoder is full at {self.max_len} positions (raise max_len)")
        tokens = torch.tensor(tokens.tolist(), dtype=torch.int64)  # an ordinary (non-inference) tensor
        pos = torch.where(live, self.next_pos, torch.full_like(self.next_pos, -1))[:, None]
        out, pending = self._step(tokens, pos)
        self.kv.write(pending, pos)
        self.next_pos = self.next_pos + live.long()
        return out
