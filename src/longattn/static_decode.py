"""A fixed-shape decode step that ``torch.compile`` traces once.

The eager decode path (``Session.step``) grows caches, picks attention kernels by looking at
position values, and runs ~25 small PyTorch calls per layer, each paying Python and dispatch
overhead. Here every layer's K/V lives in a buffer allocated up front:

* full-attention layers: ``max_len`` slots, slot = absolute position;
* windowed layers: ``sinks + window`` slots, slot = ``ring_slot(pos)`` (cache/ring.py);

plus one "bin" slot per layer where padding tokens are written and which is never read
(its position stays -1). The compiled step reads the buffers and never writes them: each
layer attends over its whole buffer under ``allowed_mask`` (built from the slot positions)
plus the step's own new key, in one softmax, and returns the new keys; they are written by
index (``scatter_``) after the step. (Written inside the graph, inductor copied every buffer
whole on every step.) Shapes never change and nothing branches on tensor values: one graph
for the whole decode, no recompilation (tests/test_static_decode.py counts them).

Prefill runs through an ordinary eager Session (chunked, banded where it pays) and its cache
is then copied into the buffers. Attention over the buffer reads masked slots too, so a
full-attention layer costs O(max_len) per step: size ``max_len`` to the job.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from .cache.ring import ring_slot
from .errors import LongattnError
from .ops.masks import allowed_mask
from .policy import AttentionPolicy
from .session import Session


RECOMPILE_LIMIT = 256


class StaticKV:
    """Preallocated per-layer K/V buffers, written by index.

    Args:
        cfg: ModelConfig. policy: AttentionPolicy (only "window" kinds).
        batch: streams. max_len: most positions a stream may reach (full-attention layers).
        dtype: storage dtype.
    Buffers: ``k[l], v[l]`` are ``[B, Hkv, S_l + 1, D]``, ``pos[l]`` is ``[B, S_l + 1]``
    (-1 = empty); the last slot is the padding bin.
    """

    def __init__(self, cfg, policy: AttentionPolicy, batch: int, max_len: int, dtype=torch.float32):
        self.batch, self.max_len = batch, max_len
        self.rings: list = []  # per layer: (sinks, window) or None for slot = position
        self.k, self.v, self.pos = [], [], []
        self.pending: dict = {}  # layer -> (k, v) of the step being traced/run
        for lp in policy.layers:
            ring = lp.window is not None and lp.sinks + lp.window < max_len
            cap = lp.sinks + lp.window if ring else max_len
            self.rings.append((lp.sinks, lp.window) if ring else None)
            self.k.append(torch.zeros(batch, cfg.num_kv_heads, cap + 1, cfg.head_dim, dtype=dtype))
            self.v.append(torch.zeros_like(self.k[-1]))
            self.pos.append(torch.full((batch, cap + 1), -1, dtype=torch.int64))

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k, self.v))

    def _slots(self, layer: int, pos: torch.Tensor) -> torch.Tensor:
        """``pos [B, T]`` -> slot indices ``[B, T]`` (padding -> the bin slot)."""
        bin_slot = self.pos[layer].shape[1] - 1
        ring = self.rings[layer]
        slot = pos.clamp(min=0) if ring is None else ring_slot(pos.clamp(min=0), *ring)
        return torch.where(pos < 0, torch.full_like(slot, bin_slot), slot)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Hold the step's ``k, v [B, Hkv, 1, D]`` aside (``pending``) and return the buffers
        as they were: the step attends over them plus its own key (see _StaticOp), and
        ``write`` stores the new keys after the step. Writing inside a compiled graph would
        make inductor copy every whole buffer on every step (functionalized scatter)."""
        self.pending[layer] = (k, v)
        return self.k[layer], self.v[layer], self.pos[layer]

    def write(self, pending: list, pos: torch.Tensor) -> None:
        """Store each layer's ``(k, v)`` of one step at ``pos [B, 1]`` (padding -> bin slot)."""
        for layer, (k, v) in enumerate(pending):
            slot = self._slots(layer, pos)  # [B, 1]
            B, H, T, D = k.shape
            idx = slot[:, None, :, None].expand(B, H, T, D)
            self.k[layer].scatter_(2, idx, k.to(self.k[layer].dtype))
            self.v[layer].scatter_(2, idx, v.to(self.v[layer].dtype))
            self.pos[layer].scatter_(1, slot, pos)

    def advance(self, pos: torch.Tensor) -> None:
        """The decoder tracks positions on the host; nothing to record here."""

    def load(self, cache) -> None:
        """Copy an eager KVCache (after prefill) into the buffers.

        Ring layers keep, per stream, the sinks and the last ``window`` positions (what a ring
        would hold); everything else is dropped before writing so no two tokens share a slot.
        """
        for layer, lc in enumerate(cache.layers):
            k, v, pos = lc.view()  # [B, Hkv, N, D], [B, N]
            self.k[layer].zero_()
            self.v[layer].zero_()
            self.pos[layer].fill_(-1)
            ring = self.rings[layer]
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
                slots = self._slots(layer, p[idx][None])[0]
                self.k[layer][b, :, slots] = k[b, :, idx].to(self.k[layer].dtype)
                self.v[layer][b, :, slots] = v[b, :, idx].to(self.v[layer].dtype)
                self.pos[layer][b, slots] = p[idx]


class _StaticOp:
    """Decode attention over a whole static buffer: mask from slot positions, no branching."""

    def __init__(self, window: Optional[int], sinks: int):
        self.window, self.sinks = window, sinks

    def __call__(self, q, q_pos, k, v, k_pos, scale, softcap=None, layer=0, cache=None):
        mask = allowed_mask(q_pos, k_pos, self.window, self.sinks)  # [B, 1, 1, S]
        k_new, v_new = cache.pending[layer]
        return attend_buffer_and_self(q, k, v, mask, k_new, v_new, q_pos >= 0, scale, softcap)


def attend_buffer_and_self(q, k, v, mask, k_new, v_new, self_ok, scale, softcap=None):
    """One decode query over a read-only buffer plus its own new key, in one softmax.

    Args:
        q: ``[B, H, 1, D]``; k, v: ``[B, Hkv, S, D]`` buffers; mask: ``[B, 1, 1, S]`` bool.
        k_new, v_new: ``[B, Hkv, 1, D]`` the step's own key and value.
        self_ok: ``[B, 1]`` bool, False for padding queries (which then output zeros).
    Returns:
        ``[B, H, 1, D]``, equal to attention over the buffer with the new key written into it.
    """
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv, D)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale           # [B, Hkv, rep, S]
    sn = (qg * k_new.to(qg.dtype)).sum(-1, keepdim=True) * scale  # [B, Hkv, rep, 1]
    if softcap is not None:
        s, sn = softcap * torch.tanh(s / softcap), softcap * torch.tanh(sn / softcap)
    s = s.masked_fill(~mask.view(B, 1, 1, S), float("-inf"))
    sn = sn.masked_fill(~self_ok.view(B, 1, 1, 1), float("-inf"))
    m = torch.maximum(s.amax(-1, keepdim=True), sn)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with nothing to read
    p, pn = torch.exp(s - m), torch.exp(sn - m)
    den = p.sum(-1, keepdim=True) + pn
    num = torch.matmul(p, v) + pn * v_new.to(p.dtype)             # [B, Hkv, rep, D]
    out = torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), torch.zeros_like(num))
    return out.reshape(B, H, 1, D)


class _StaticPolicy:
    def __init__(self, policy: AttentionPolicy):
        self.ops = [_StaticOp(lp.window, lp.sinks) for lp in policy.layers]

    def op(self, i: int):
        return self.ops[i]


class StaticDecoder:
    """Prefill eagerly, then decode with a fixed-shape (optionally compiled) step.

    Args:
        model: a Transformer (any weight format).
        policy: AttentionPolicy of "window" layers (dense, windows, sinks; default the
            checkpoint's windows). Sparse layers and re-indexing need the eager Session.
        batch: streams. max_len: positions a stream may reach (prompt + new tokens).
        compile: ``torch.compile`` the step (inductor, static shapes, one graph).
        dynamic: compile the full-attention buffers' length as a symbol, so ``reset`` to
            another ``max_len`` reuses the graph instead of compiling a new one.
    """

    def __init__(self, model, policy: Optional[AttentionPolicy] = None, batch: int = 1,
                 max_len: int = 4096, compile: bool = True, dynamic: bool = False):
        self.model = model
        self.policy = policy or AttentionPolicy.from_config(model.config)
        bad = sorted({lp.kind for lp in self.policy.layers} - {"window"})
        if bad:
            raise LongattnError(f"the static decoder runs window/dense layers only, not {bad}; "
                                "use the eager Session for these")
        self.batch, self.dynamic = batch, dynamic
        self._policy = _StaticPolicy(self.policy)
        self.compiled = compile
        self._compiled = self._compile() if compile else None
        self.reset(max_len)

    def _compile(self):
        """torch.compile of this decoder's own copy of ``_step_eager``.

        Dynamo keeps its compiled graphs on the code object, so with one shared code object
        every decoder's step had to check guards on every parameter of every model (0.9-1.3 ms
        per SmolLM2 step) to find its graph. A private code object holds only this decoder's
        graphs, so the guards on the model's parameters and buffers can be skipped (measured
        17.0 -> 15.5 ms a step). The price: the model must not be changed (weights replaced,
        re-quantized) once the decoder has compiled; build a new decoder instead.
        """
        fn = StaticDecoder._step_eager
        private = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
        return torch.compile(types.MethodType(private, self), dynamic=False, fullgraph=True,
                             options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def reset(self, max_len: Optional[int] = None) -> None:
        """Forget every stream (new buffers of ``max_len`` positions, default the current)."""
        max_len = self.max_len if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise LongattnError(f"max_len must be a positive integer, got {max_len!r}")
        self.max_len = max_len
        self.session = Session(self.model, self.policy, batch=self.batch)
        self.kv = StaticKV(self.model.config, self.policy, self.batch, max_len,
                           dtype=self.model.activation_dtype)
        if self.dynamic:
            for layer, ring in enumerate(self.kv.rings):
                if ring is None:
                    for t, dim in ((self.kv.k[layer], 2), (self.kv.v[layer], 2), (self.kv.pos[layer], 1)):
                        torch._dynamo.mark_dynamic(t, dim)
        self.next_pos = torch.zeros(self.batch, dtype=torch.int64)

    def _step(self, tokens: torch.Tensor, pos: torch.Tensor):
        """-> (logits ``[B, V]``, per layer ``(k, v)`` of this step, not yet written)."""
        try:
            return self._run(tokens, pos)
        finally:
            self.kv.pending.clear()  # every call starts from the same (traced) state

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor):
        if self._compiled is None:
            return self._step_eager(tokens, pos)
        # dynamo counts compiled variants per code object (here: per decoder, see _compile);
        # a generous limit keeps a decoder reset to many lengths from failing under fullgraph.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return self._compiled(tokens, pos)

    def _step_eager(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # Transformer.forward without its inference_mode wrapper: dynamo cannot trace
        # inference tensors, so the static path runs under no_grad with ordinary tensors.
        forward = type(self.model).forward.__wrapped__
        logits = forward(self.model, tokens[:, None], pos, cache=self.kv, policy=self._policy,
                         logits="all")[:, 0]
        return logits, [self.kv.pending[i] for i in range(len(self.kv.k))]

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
        if int(self.next_pos[live].max()) >= self.max_len and any(r is None for r in self.kv.rings):
            raise LongattnError(f"the static decoder is full at {self.max_len} positions (raise max_len)")
        tokens = torch.tensor(tokens.tolist(), dtype=torch.int64)  # an ordinary (non-inference) tensor
        pos = torch.where(live, self.next_pos, torch.full_like(self.next_pos, -1))[:, None]
        out, pending = self._step(tokens, pos)
        self.kv.write(pending, pos)
        self.next_pos = self.next_pos + live.long()
        return out
