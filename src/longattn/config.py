"""ModelConfig: everything the model needs to know about a checkpoint, validated.

Family differences (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, gpt-oss) are data here, never branches in the
model's loop. ``layer_windows[i]`` is the sliding window of layer i as trained (``None`` =
full attention); ``layer_rope_theta[i]`` is that layer's RoPE base.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from .errors import LongattnError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt_oss")


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_context: int = 8192
    rope_theta: float = 10000.0
    # Per-layer data (filled by __post_init__ when left empty).
    layer_windows: list = field(default_factory=list)      # [L] int | None
    layer_rope_theta: list = field(default_factory=list)   # [L] float
    # [L] dict | None: that layer's rope scaling (models.rope form); default rope_scaling on every layer
    layer_rope_scaling: list = field(default_factory=list)
    # Family switches.
    qkv_bias: bool = False
    o_bias: bool = False               # bias on the attention output projection (attention_bias)
    mlp_bias: bool = False             # biases on gate, up and down projections
    qk_norm: bool = False              # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
    norm_plus_one: bool = False        # Gemma: weight applied as (1 + w)
    sandwich_norms: bool = False       # Gemma 3: post-attention and post-ffn norms too
    embed_scale: float = 1.0           # Gemma: sqrt(hidden_size)
    activation: str = "silu"           # "silu" | "gelu_tanh"
    query_pre_attn_scalar: Optional[float] = None  # scale = this ** -0.5 when set
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    tie_embeddings: bool = False
    learned_sinks: bool = False        # gpt-oss: a learned logit per head joins each softmax denominator
    num_experts: int = 0               # > 0: gpt-oss routed MLP of this many experts
    experts_per_token: int = 0         # experts each token is routed to (top-k)
    swiglu_alpha: float = 1.702        # gpt-oss expert activation: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0          # gpt-oss expert activation clamp
    rope_scaling: Optional[dict] = None  # models.rope form, e.g. {"rope_type": "linear", "factor": 8.0}
    # Phi-3: a stream that passes a longrope's original context has its whole cache recomputed
    # with the long factors (transformers' Phi-3 generation; engine.session)
    longrope_recompute: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: list = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        if not self.layer_rope_theta:
            self.layer_rope_theta = [self.rope_theta] * self.num_layers
        if not self.layer_rope_scaling:
            self.layer_rope_scaling = [self.rope_scaling] * self.num_layers
        self.validate()

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K plus V bytes one token costs in one layer at float32."""
        return 2 * self.num_kv_heads * self.head_dim * 4

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise LongattnError(f"invalid model config{(' for ' + self.name) if self.name else ''}: {msg}")
        if self.family not in FAMILIES:
            bad(f"unsupported architecture '{self.family}'; supported: {', '.join(FAMILIES)}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                bad(f"{f} must be a positive integer, got {v!r}")
        ctx = self.max_context
        if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx <= 0:
            bad(f"max_context (the trained context length) must be a positive integer, got {ctx!r}")
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(f"{f} must be a positive finite number, got {v!r}")
        if self.num_heads % self.num_kv_heads != 0:
            bad(f"num_heads ({self.num_heads}) is not divisible by num_kv_heads "
                f"({self.num_kv_heads}); grouped-query attention needs whole groups")
        if self.head_dim % 2 != 0:
            bad(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if len(self.layer_windows) != self.num_layers:
            bad(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if len(self.layer_rope_theta) != self.num_layers:
            bad(f"layer_rope_theta has {len(self.layer_rope_theta)} entries for {self.num_layers} layers")
        if len(self.layer_rope_scaling) != self.num_layers:
            bad(f"layer_rope_scaling has {len(self.layer_rope_scaling)} entries for {self.num_layers} layers")
        from .models.rope import check_rope_scaling  # here: models imports this module
        try:
            self.rope_scaling = check_rope_scaling(self.rope_scaling, self.head_dim)
            self.layer_rope_scaling = [check_rope_scaling(s, self.head_dim) for s in self.layer_rope_scaling]
        except LongattnError as e:
            bad(str(e))
        for w in self.layer_windows:
            if w is not None and (not isinstance(w, int) or w <= 0):
                bad(f"layer window {w!r} must be a positive integer or None")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            bad(f"experts_per_token ({self.experts_per_token}) must be between 1 and num_experts "
                f"({self.num_experts})")
        if self.activation not in ("silu", "gelu_tanh"):
            bad(f"unknown activation '{self.activation}'")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def windowed_layers(self) -> list:
        return [i for i, w in enumerate(self.layer_windows) if w is not None]
