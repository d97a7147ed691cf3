"""A decoder-only transformer for the llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3 and gpt_oss families.

The model never knows which cache or attention policy it runs with: each attention layer
calls ``cache.update`` (when a cache is given) and hands the ``KVView`` it returns to the
per-layer op the policy hands it.
Shapes: hidden states ``[B, T, hidden]``; q/k/v ``[B, heads, T, head_dim]``; positions
``[B, T]`` int64 absolute indices (negative = padding).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache.base import KVView
from ..config import ModelConfig
from ..errors import LongattnError
from ..ops.attention import MaskMemo, WindowOp
from ..ops.linear import (INT4_GROUP, dequantize_int4, dequantize_int5, dequantize_int8, float_linear,
                          int4_matmul, int5_matmul, int8_matmul, quantized_kernel)
from .rope import SEQ_DEPENDENT, apply_rope, inv_freq, longrope_switch, rope_cos_sin, rope_frequencies
from .weights import (QUANTIZED, int4_applies, int4_as_int5, kind_format, parse_weights, quantize_int4, quantize_int5,
                      quantize_int8, recipe_name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in at least float32 (float64 stays float64 for reference runs)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(xf.dtype)
        return (xf * ((1.0 + w) if self.plus_one else w)).to(x.dtype)


class Linear(nn.Module):
    """``y = x W^T + b`` with W in float32, bf16, int8 (``to_int8``: per-row scales), int4 or
    int5 (``to_int4``, ``to_int5``: groups of 32 with a step and an offset each; see
    models.weights)."""

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_out), requires_grad=False) if bias else None
        self.register_buffer("qweight", None)  # int8 [N, K] once to_int8() ran (weight is None)
        self.register_buffer("codes", None)  # uint8 [N, K/2] once to_int4/5() ran (weight is None)
        self.register_buffer("hbits", None)  # uint8 [N, K/8] once to_int5() ran
        # ("int4" or "int5", parts): the groups the checkpoint stores for ``weight`` (build_model's
        # ``stored``), taken by to_int4/to_int5 instead of quantizing the float32 copy again
        self.stored = None
        self.kernel = "torch"  # build_model and to_int* choose (see to_int8)

    def to_int4(self, structure_only: bool = False) -> None:
        """4-bit groups where the row length allows it (a multiple of 32), int8 otherwise.
        ``structure_only``: empty buffers of the right shapes (models.prepared fills them)."""
        self._to_groups(4, structure_only)

    def to_int5(self, structure_only: bool = False) -> None:
        """5-bit groups where the row length allows it, int8 otherwise (as to_int4)."""
        self._to_groups(5, structure_only)

    def _to_groups(self, bits: int, structure_only: bool) -> None:
        if not int4_applies(self.weight):
            return self.to_int8(structure_only)
        N, K = self.weight.shape
        if structure_only:
            half = torch.float16
            fifth = (torch.empty(N, K // 8, dtype=torch.uint8),) if bits == 5 else ()
            parts = (torch.empty(N, K // 2, dtype=torch.uint8), *fifth,
                     torch.empty(N, K // INT4_GROUP, dtype=half), torch.empty(N, K // INT4_GROUP, dtype=half))
        elif self.stored is not None and (self.stored[0], bits) in (("int4", 4), ("int5", 5)):
            parts = self.stored[1]
        elif self.stored is not None and (self.stored[0], bits) == ("int4", 5):
            parts = int4_as_int5(*self.stored[1])
        else:
            parts = (quantize_int4 if bits == 4 else quantize_int5)(self.weight.data)
        codes, *fifth, steps, offsets = parts
        self.weight = self.stored = None
        self.codes = codes
        if fifth:
            self.hbits = fifth[0]
        self.register_buffer("steps", steps)  # float16 [N, K/32]
        self.register_buffer("offsets", offsets)  # float16 [N, K/32]
        self.kernel = quantized_kernel()  # see to_int8

    def to_int8(self, structure_only: bool = False) -> None:
        """Per-row int8; ``structure_only`` as in to_int4."""
        N, K = self.weight.shape
        if structure_only:
            q, scales = torch.empty(N, K, dtype=torch.int8), torch.empty(N)
        else:
            q, scales = quantize_int8(self.weight.data)
        self.weight = self.stored = None
        self.qweight = q
        self.register_buffer("scales", scales)
        # Chosen (and the kernel built) here, not in forward: a plain string is a constant
        # to torch.compile, and a first-call build must not happen inside a trace.
        self.kernel = quantized_kernel()

    def group_parts(self, rows=slice(None)) -> tuple:
        """The int4 (codes, steps, offsets) or int5 (codes, hbits, steps, offsets) rows ``rows``."""
        fifth = () if self.hbits is None else (self.hbits[rows],)
        return self.codes[rows], *fifth, self.steps[rows], self.offsets[rows]

    def effective_weight(self, dtype=torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """``[N, K]`` (or the ``rows`` of it): the matrix this layer multiplies by, in ``dtype``."""
        if self.qweight is not None:
            return dequantize_int8(self.qweight[rows], self.scales[rows], dtype)
        if self.codes is not None:
            return (dequantize_int4 if self.hbits is None else dequantize_int5)(*self.group_parts(rows), dtype)
        return self.weight[rows].to(dtype)

    def forward(self, x):
        if self.qweight is None and self.codes is None:
            return float_linear(x, self.weight, self.bias, self.kernel)
        # every row count runs the same kernel: a row's result never depends on the rows beside it
        if self.hbits is not None:
            y = int5_matmul(x, self.codes, self.hbits, self.steps, self.offsets, self.kernel)
        elif self.codes is not None:
            y = int4_matmul(x, self.codes, self.steps, self.offsets, self.kernel)
        else:
            y = int8_matmul(x, self.qweight, self.scales, self.kernel)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class QuantEmbedding(nn.Module):
    """Embedding lookup from an int8, int4 or int5 Linear's rows (tied head and table share one copy)."""

    def __init__(self, table: Linear):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` -> ``[B, T, hidden]`` float32."""
        t = self.table
        if t.codes is not None:
            rows = t.effective_weight(torch.float32, ids.reshape(-1))
            return rows.reshape(*ids.shape, rows.shape[-1])
        return t.qweight[ids].float() * t.scales[ids][..., None]


def _fused(parts: list, structure_only: bool) -> "Linear":
    """One Linear whose rows are ``parts``' rows in order (their weights concatenated, biases
    too); with ``structure_only`` an empty one of that shape."""
    n_in, bias = parts[0].weight.shape[1], parts[0].bias is not None
    out = Linear(n_in, sum(p.weight.shape[0] for p in parts), bias)
    if not structure_only:
        out.weight.data = torch.cat([p.weight.data for p in parts])
        if bias:
            out.bias.data = torch.cat([p.bias.data for p in parts])
        if all(p.stored is not None for p in parts):  # groups run along rows: rows concatenate
            fmt = "int4" if all(p.stored[0] == "int4" for p in parts) else "int5"
            stored = [p.stored[1] if p.stored[0] == fmt else int4_as_int5(*p.stored[1]) for p in parts]
            out.stored = (fmt, tuple(torch.cat(x) for x in zip(*stored)))
    return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = cfg.mlp_bias
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, b)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, b)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, b)
        self.act = (lambda t: F.gelu(t, approximate="tanh")) if cfg.activation == "gelu_tanh" else F.silu

    def fuse(self, structure_only: bool = False) -> None:
        """Replace gate/up by one [2*I, hidden] projection (one weight read, one call).
        ``structure_only``: an empty projection of the fused shape (models.prepared fills it)."""
        self.gate_up = _fused([self.gate_proj, self.up_proj], structure_only)
        self.gate_proj = self.up_proj = None

    def forward(self, x):
        if self.gate_proj is None:
            g, u = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act(g) * u)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """gpt-oss expert weights as the checkpoint stores them: ``gate_up_proj [E, hidden, 2I]``
    (gate and up interleaved along the last axis), ``down_proj [E, I, hidden]``, and biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, Hd, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, Hd, 2 * I), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, I, Hd), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(E, Hd), requires_grad=False)


class MoEMLP(nn.Module):
    """gpt-oss's routed MLP: a biased router picks the top-k experts per token, their outputs
    are mixed by the softmax of the k router logits. Each expert is a clamped SwiGLU:
    ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Linear(cfg.hidden_size, cfg.num_experts, True)
        self.experts = Experts(cfg)
        self.top_k, self.alpha, self.limit = cfg.experts_per_token, cfg.swiglu_alpha, cfg.swiglu_limit

    def fuse(self, structure_only: bool = False) -> None:
        """Nothing to fuse: each expert is one matmul pair already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, hidden]`` -> ``[B, T, hidden]``."""
        B, T, Hd = x.shape
        h = x.reshape(-1, Hd)  # [N, hidden]
        top, idx = torch.topk(self.router(h), self.top_k, dim=-1)  # [N, k]
        w = torch.softmax(top, dim=-1)
        ex = self.experts
        if torch.compiler.is_compiling():
            return self._gathered(h, idx, w).reshape(B, T, Hd)
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)  # the tokens routed to expert e, and in which slot
            gu = h[tok] @ ex.gate_up_proj[e].to(h.dtype) + ex.gate_up_proj_bias[e].to(h.dtype)
            y = self._activation(gu) @ ex.down_proj[e].to(h.dtype)
            y = y + ex.down_proj_bias[e].to(h.dtype)
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out.reshape(B, T, Hd)

    def _activation(self, gu: torch.Tensor) -> torch.Tensor:
        gate = gu[..., ::2].clamp(max=self.limit)
        up = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def _gathered(self, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The same mixture with each token's k experts' weights gathered (``h [N, hidden]``,
        ``idx``/``w [N, k]`` -> ``[N, hidden]``): no loop over which experts were chosen, so a
        traced step (the compiled decode step, a few tokens) has no data-dependent control flow.
        It reads each chosen expert once per token, as the loop does for a decode step."""
        ex, dt = self.experts, h.dtype
        gu = torch.einsum("nd,nkdf->nkf", h, ex.gate_up_proj[idx].to(dt)) + ex.gate_up_proj_bias[idx].to(dt)
        y = torch.einsum("nkf,nkfd->nkd", self._activation(gu), ex.down_proj[idx].to(dt))
        y = y + ex.down_proj_bias[idx].to(dt)
        return (y * w.unsqueeze(-1)).sum(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.H * self.D, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.Hkv * self.D, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.Hkv * self.D, cfg.qkv_bias)
        self.o_proj = Linear(self.H * self.D, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps, cfg.norm_plus_one)
        else:
            self.q_norm = self.k_norm = None
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_softcap
        # gpt-oss: one learned logit per query head in every softmax denominator
        self.sinks = nn.Parameter(torch.zeros(self.H), requires_grad=False) if cfg.learned_sinks else None
        self.rope_theta, self.rope_scaling = cfg.layer_rope_theta[layer], cfg.layer_rope_scaling[layer]
        self.max_context = cfg.max_context
        # dynamic / longrope frequencies follow the sequence length of each call
        self.rope_varies = bool(self.rope_scaling) and self.rope_scaling["rope_type"] in SEQ_DEPENDENT
        # past this many tokens a longrope layer's keys need the long factors, all of them
        # (ModelConfig.longrope_recompute: the cached short-factor keys cannot stay)
        self.rope_switch = longrope_switch(self.rope_scaling) if cfg.longrope_recompute else None
        # layers with equal rope settings share one cos/sin table per forward
        self.rope_key = (self.rope_theta, repr(self.rope_scaling))
        f, self.rope_factor = rope_frequencies(self.D, self.rope_theta, self.rope_scaling, self.max_context)
        self.register_buffer("inv_freq", f, persistent=False)  # [D/2] at load (rerotation uses it)

    def rope(self, pos: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[B, 1, T, D]`` for positions ``pos [B, T]`` (scaling applied).
        ``seq_len``: the sequence length whose frequencies a length-dependent rope takes
        (default: the call's highest position plus one)."""
        if self.rope_varies:
            f, factor = rope_frequencies(self.D, self.rope_theta, self.rope_scaling, self.max_context,
                                         seq_len=seq_len or int(pos.max()) + 1)
            return rope_cos_sin(pos, f, factor)
        return rope_cos_sin(pos, self.inv_freq, self.rope_factor)

    def _check_rope_switch(self, view: KVView, seq_len: int) -> None:
        """Refuse keys of both longrope factor sets in one cache: transformers' Phi-3 recomputes
        the whole sequence with the long factors when it passes the original context (the
        eager Session does; engine.session), so a cache whose keys were rotated with the short
        factors cannot take a call that uses the long ones."""
        long = seq_len > self.rope_switch
        kept = view.state.get("longrope_long")
        if kept is not None and kept != long:
            raise LongattnError(
                f"this sequence passes the original context of {self.rope_switch} tokens "
                "(longrope), where the cached keys need the long rope factors: transformers "
                "recomputes them, and so does longattn's eager session (generate --compile none); "
                f"or keep prompt and generation within {self.rope_switch} tokens")
        view.state["longrope_long"] = long

    def fuse(self, structure_only: bool = False) -> None:
        """Replace q/k/v by one projection (one weight read and one call per step);
        ``structure_only`` as in MLP.fuse."""
        self.qkv = _fused([self.q_proj, self.k_proj, self.v_proj], structure_only)
        self.q_proj = self.k_proj = self.v_proj = None

    def project_qkv(self, x):
        """``x [B, T, hidden]`` -> q ``[B, T, H, D]``, k and v ``[B, T, Hkv, D]`` (before norms/RoPE)."""
        B, T, _ = x.shape
        if self.q_proj is None:
            q, k, v = self.qkv(x).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.reshape(B, T, self.H, self.D), k.reshape(B, T, self.Hkv, self.D),
                v.reshape(B, T, self.Hkv, self.D))

    def forward(self, x, pos, cache, op, shared=None):
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, h, T, D]
        seq_len = shared.get("rope_len") if shared is not None else None
        if shared is not None and self.rope_key in shared:
            cos, sin = shared[self.rope_key]
        else:
            cos, sin = self.rope(pos, seq_len)
            if shared is not None:
                shared[self.rope_key] = (cos, sin)
        q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        rot = getattr(cache, "key_rotation", None)
        if rot is not None:  # a pool storing rotated keys (int8): queries turn with them, scores stay
            q, k = q @ rot.to(q.dtype), k @ rot.to(k.dtype)
        if cache is not None:
            view = cache.update(self.layer, k, v, pos)
            if self.rope_switch is not None and view.state is not None:
                self._check_rope_switch(view, seq_len or int(pos.max()) + 1)
        else:
            view = KVView.uncached(k, v, pos, None if shared is None else shared.get("masks"))
        if self.sinks is None:
            o = op(q, pos, view, scale=self.scale, softcap=self.softcap)  # [B, H, T, D]
        else:
            if not getattr(op, "learned_sinks", False):
                raise LongattnError(f"attention op {type(op).__name__} has no term for this model's learned "
                                    "sink logits (gpt-oss); run it with a window, checkpoint or dense policy "
                                    "in the eager engine")
            o = op(q, pos, view, scale=self.scale, softcap=self.softcap, sink_logits=self.sinks)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.H * self.D))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps, p1 = cfg.rms_norm_eps, cfg.norm_plus_one
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoEMLP(cfg) if cfg.num_experts else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, p1)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, p1)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, p1)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, p1)

    def forward(self, x, pos, cache, op, shared=None):
        if self.sandwich:  # Gemma: norm before and after each sub-layer
            a = self.self_attn(self.input_layernorm(x), pos, cache, op, shared)
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), pos, cache, op, shared)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # given its (empty) table, Embedding skips its random init: weights are always loaded,
        # and that init's first call imports torch._dynamo (~0.7 s of every start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)


class Transformer(nn.Module):
    """Decoder LLM. ``forward(ids, pos, cache=None, policy=None)`` -> logits ``[B, T', vocab]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Inner(cfg)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False)
        self.weights = "f32"  # the weight format (models.weights); set by build_model
        self.head_kernel = "torch"  # the tied float head's matmul kernel (ops/linear.py); set by build_model
        self._tied_head = None  # int8/int4 + tied embeddings: the shared quantized table as a Linear

    @property
    def activation_dtype(self) -> torch.dtype:
        """float32, or float64 for reference models built in float64."""
        emb = self.model.embed_tokens
        return torch.float64 if getattr(emb, "weight", None) is not None and \
            emb.weight.dtype == torch.float64 else torch.float32

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Output projection ``x [..., hidden]`` -> logits ``[..., vocab]`` (before softcap)."""
        if self.lm_head is not None:
            return self.lm_head(x)
        if self._tied_head is not None:
            return self._tied_head(x)
        return float_linear(x, self.model.embed_tokens.weight, kernel=self.head_kernel)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None, cache=None, policy=None,
                logits: str = "all", rope_len: int | None = None) -> torch.Tensor:
        """Run the model.

        Args:
            ids: ``[B, T]`` token ids (any value where ``pos < 0``: padding).
            pos: ``[B, T]`` absolute positions; default ``0..T-1`` (or continuing the cache).
            cache: a KVCache (``longattn.cache``) or None for a plain full forward.
            policy: an AttentionPolicy (``longattn.policy``); default = the checkpoint's windows.
            logits: "all" -> ``[B, T, V]``; "last" -> ``[B, 1, V]`` (the last non-padding
                position of each row); "none" -> hidden states ``[B, T, hidden]``.
            rope_len: the sequence length whose frequencies length-dependent ropes (dynamic,
                longrope) take; default the call's highest position plus one. A prefill split
                into calls passes its whole length, so each call rotates as one call would.
        """
        cfg = self.config
        B, T = ids.shape
        if pos is None:
            start = cache.next_position() if cache is not None else torch.zeros(B, 1, dtype=torch.int64)
            pos = start + torch.arange(T, dtype=torch.int64)  # [B, T]
        # no policy: each layer's trained window (the checkpoint's own attention)
        ops = [policy.op(i) for i in range(cfg.num_layers)] if policy is not None else \
            [WindowOp(w) for w in cfg.layer_windows]
        # activations stay float32 (or float64 in reference runs) whatever the weight dtype
        x = self.model.embed_tokens(ids.clamp(min=0)).to(self.activation_dtype)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        # values every layer of this forward reuses: rope tables (by rope_key) and, without a
        # cache to hold one, the mask memo
        shared: dict = {} if cache is not None else {"masks": MaskMemo()}
        if rope_len is not None:
            shared["rope_len"] = int(rope_len)
        for i, block in enumerate(self.model.layers):
            x = block(x, pos, cache, ops[i], shared)
        if cache is not None:
            cache.advance(pos)
        if logits == "none":
            return x
        if logits == "last":
            last = (pos >= 0).sum(dim=1) - 1  # [B]: rows are right-padded
            x = x[torch.arange(B), last.clamp(min=0)][:, None]
        x = self.model.norm(x)
        out = self.head(x)
        if cfg.final_softcap:
            out = cfg.final_softcap * torch.tanh(out / cfg.final_softcap)
        return out


def build_model(cfg: ModelConfig, state_dict: Mapping, dtype: torch.dtype = torch.float32,
                fuse: bool = True, weights: str | None = None, kinds: tuple = (),
                stored: dict | None = None) -> Transformer:
    """Instantiate and load weights (strict: a missing or extra tensor is an error).

    ``dtype`` applies to the big matrices (projections, embeddings); norms stay float32.
    ``weights`` ("f32", "bf16", "int8", "int4", "int5"; see models.weights) overrides ``dtype``
    when given; int8 quantizes every matrix per output row, the embedding table included, int4
    and int5 in groups of 32 (their decode also rounds activations to int8 per block of 32).
    ``kinds`` (quantized formats only): (module-name fragment, format) pairs for matrices that
    take another quantized format, e.g. ``(("qkv", "int8"),)`` for the attention projections
    (``"embed"`` names the embedding table and tied head); a plain fragment stands for int8.
    ``stored``: tensor name -> ("int4" or "int5", parts) the checkpoint stores for it
    (checkpoint.gguf_file.read_stored_groups), used as they are instead of quantizing again.
    ``fuse`` concatenates q/k/v and gate/up projections after loading (fewer, larger
    matmuls: the decode step is dominated by per-call overhead and weight reads).
    """
    if weights is None:
        fmt = "bf16" if dtype == torch.bfloat16 else "f32"  # float64: an f32-format reference
    else:
        fmt = parse_weights(weights)
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    kinds = tuple(kinds) if fmt in QUANTIZED else ()
    with torch.device("meta"):
        m = Transformer(cfg)
    _check_names(cfg, m, set(state_dict))
    m = m.to_empty(device="cpu")
    set_rope_tables(m, cfg)
    expected = set(k for k, _ in m.named_parameters())

    # Block by block: each block is loaded, fused and quantized before the next is read, so a
    # state_dict that reads on lookup (checkpoint.lazy_weights) holds one block's
    # float32 weights at a time, not the model's.
    loaded: set = set()
    for i, block in enumerate(m.model.layers):
        loaded |= _load_module(block, f"model.layers.{i}", state_dict, dtype, stored)
        if fuse:
            block.self_attn.fuse()
            block.mlp.fuse()
        if fmt in QUANTIZED:
            _quantize_linears(block, f"model.layers.{i}", fmt, kinds)
    loaded |= _load_module(m.model.norm, "model.norm", state_dict, dtype, stored)
    if m.lm_head is not None:
        loaded |= _load_module(m.lm_head, "lm_head", state_dict, dtype, stored)
        if fmt in QUANTIZED:
            _quantize_linears(m.lm_head, "lm_head", fmt, kinds)
    loaded |= _load_module(m.model.embed_tokens, "model.embed_tokens", state_dict, dtype, stored)
    if loaded != expected:  # a parameter outside the parts above would be left unset
        raise LongattnError(f"build_model left {sorted(expected - loaded)[:3]} unset")
    if fmt in QUANTIZED:
        _quantize_embedding(m, cfg, fmt, kinds, stored_embed=(stored or {}).get("model.embed_tokens.weight"))
    elif dtype != torch.float64:  # float64 is the reference: PyTorch's own matmul
        choose_float_kernels(m)
    m.weights = recipe_name(fmt, kinds)
    m.eval()
    return m


def choose_float_kernels(m: Transformer) -> None:
    """Give ``m``'s float32 and bf16 matrices (and a tied float head) the kernel
    ``quantized_kernel`` chooses: every row count then runs one arithmetic, as for the quantized
    formats (ops/linear.py)."""
    m.head_kernel = quantized_kernel()
    for mod in m.modules():
        if isinstance(mod, Linear) and mod.weight is not None:
            mod.kernel = m.head_kernel


def _check_names(cfg: ModelConfig, m: Transformer, names: set) -> None:
    names = names - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    expected = set(k for k, _ in m.named_parameters())
    missing, extra = expected - names, names - expected
    if missing or extra:
        raise LongattnError(f"weights do not match the {cfg.family} architecture: "
                            f"missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")


def check_weight_names(cfg: ModelConfig, shapes: dict) -> None:
    """Refuse (LongattnError, one line) weights ``shapes`` (name -> shape) that build_model
    would refuse for their names or shapes, without reading any value."""
    with torch.device("meta"):
        m = Transformer(cfg)
    _check_names(cfg, m, set(shapes))
    for k, p in m.named_parameters():
        if tuple(shapes[k]) != tuple(p.shape):
            raise LongattnError(f"tensor {k} has shape {tuple(shapes[k])}, config expects {tuple(p.shape)}")


def _load_module(module: nn.Module, prefix: str, state_dict, dtype: torch.dtype, stored: dict | None) -> set:
    """Set ``module``'s parameters from ``state_dict[prefix.<name>]`` (shapes checked):
    matrices in ``dtype``, vectors in float32; each Linear takes the checkpoint's own groups
    where ``stored`` has them (used if it becomes int4 or int5). Returns the names set."""
    names = set()
    for k, p in module.named_parameters(prefix=prefix):
        names.add(k)
        t = state_dict[k]
        if tuple(t.shape) != tuple(p.shape):
            raise LongattnError(f"tensor {k} has shape {tuple(t.shape)}, config expects {tuple(p.shape)}")
        big = t.dim() == 2 or dtype == torch.float64
        p.data = t.to(dtype if big else torch.float32).contiguous()
    if stored:
        for name, mod in module.named_modules(prefix=prefix):
            if isinstance(mod, Linear):
                mod.stored = stored.get(f"{name}.weight")
    return names


def set_rope_tables(m: Transformer, cfg: ModelConfig) -> None:
    """Compute each layer's ``inv_freq`` on the CPU (a model built on the meta device has none)."""
    for layer, block in enumerate(m.model.layers):
        block.self_attn.inv_freq = inv_freq(cfg.head_dim, cfg.layer_rope_theta[layer],
                                            cfg.layer_rope_scaling[layer], cfg.max_context)


def _quantize(m: Transformer, cfg: ModelConfig, fmt: str, kinds: tuple = (),
              structure_only: bool = False, stored_embed: tuple | None = None) -> None:
    """Every Linear and the embedding table to the quantized format ``fmt`` (in place, after
    fusing), modules whose name contains a ``kinds`` fragment to that pair's format.
    ``structure_only``: empty buffers of the quantized shapes, nothing computed
    (models.prepared). ``stored_embed``: the checkpoint's own groups of the embedding table
    (build_model's ``stored``)."""
    _quantize_linears(m, "", fmt, kinds, structure_only)
    _quantize_embedding(m, cfg, fmt, kinds, structure_only, stored_embed)


def _quantize_one(mod: Linear, name: str, fmt: str, kinds: tuple, structure_only: bool) -> None:
    {"int8": mod.to_int8, "int4": mod.to_int4, "int5": mod.to_int5}[kind_format(name, fmt, kinds)](structure_only)


def _quantize_linears(module: nn.Module, prefix: str, fmt: str, kinds: tuple,
                      structure_only: bool = False) -> None:
    """Every Linear in ``module`` (named ``prefix.<name>`` in the model) as in _quantize."""
    for name, mod in list(module.named_modules(prefix=prefix)):
        if isinstance(mod, Linear):
            _quantize_one(mod, name, fmt, kinds, structure_only)


def _quantize_embedding(m: Transformer, cfg: ModelConfig, fmt: str, kinds: tuple,
                        structure_only: bool = False, stored_embed: tuple | None = None) -> None:
    """The embedding table (and a tied head, which shares it) as in _quantize."""
    table = Linear(cfg.hidden_size, cfg.vocab_size, False)
    table.weight.data = m.model.embed_tokens.weight.data
    table.stored = stored_embed
    _quantize_one(table, "model.embed_tokens", fmt, kinds, structure_only)
    m.model.embed_tokens = QuantEmbedding(table)
    if m.lm_head is None:
        m._tied_head = table
