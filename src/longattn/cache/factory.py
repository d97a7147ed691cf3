"""Build a model's KVCache from its policy: rings where the policy windows, growing elsewhere."""

from __future__ import annotations

import torch

from ..errors import LongattnError
from .base import LAYER_CACHES, KVCache
from .evict import layer_inv_freqs, refuse_length_dependent_rope
from .hybrid import plan_layers
from . import ring as _ring  # noqa: F401  (registers "ring" in LAYER_CACHES)


def make_cache(cfg, policy=None, batch: int = 1, kind: str = "auto", slack: int = 0,
               dtype=torch.float32, model=None, reindex: bool = False,
               exact_capacity: bool = False) -> KVCache:
    """A KVCache with one layer cache per layer, chosen by ``hybrid.plan_layers``.

    Args:
        cfg: ModelConfig (layers, KV heads, head_dim).
        policy: AttentionPolicy (default: the checkpoint's windows). A windowed layer gets a
            RingLayerCache of ``window + slack`` rotating slots and the policy's sinks; other
            layers get a GrowingLayerCache.
        batch: streams.
        kind: "auto" (hybrid) | "growing" | "bounded" (every layer must be windowed).
        slack: extra rotating slots per ring (>= 0); the mask still reads only the window.
        dtype: K/V storage format (cache/kv_format.py: float32, bfloat16 or int8 q8 rows;
            float64 for reference runs).
        model: the Transformer, or a list of per-layer ``inv_freq`` tensors; each layer's
            RoPE frequencies are handed to the rings (needed for ``reindex``, and kept so
            eviction can find them).
        reindex: StreamingLLM position re-indexing on ring layers (see cache/ring.py).
        exact_capacity: growing layers allocate exactly what they hold (byte reports).
    """
    from ..policy import AttentionPolicy
    if policy is None:
        policy = AttentionPolicy.from_config(cfg)
    if len(policy.layers) != cfg.num_layers:
        raise LongattnError(f"policy has {len(policy.layers)} layers; the model has {cfg.num_layers}")
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise LongattnError(f"cache slack must be a non-negative integer, got {slack!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise LongattnError(f"cache batch must be a positive integer, got {batch!r}")
    plan = plan_layers(policy, kind)
    if reindex and "ring" not in plan:
        raise LongattnError("reindex needs ring layers: give the policy a window (and a cache kind "
                            "other than 'growing')")
    if reindex and model is None:
        raise LongattnError("reindex needs the model's RoPE frequencies: make_cache(..., model=model)")
    if reindex and hasattr(model, "model"):  # a Transformer (not a list of frequencies)
        refuse_length_dependent_rope(model.model.layers, "reindex")
    freqs = layer_inv_freqs(model, cfg.num_layers) if model is not None else [None] * cfg.num_layers
    layers = []
    for i, (lp, name) in enumerate(zip(policy.layers, plan)):
        inv_f = freqs[i]
        if name == "ring":
            layers.append(LAYER_CACHES["ring"](batch, cfg.num_kv_heads, cfg.head_dim, lp.window + slack,
                                               lp.sinks, dtype, inv_freq=inv_f, reindex=reindex))
        else:
            layers.append(LAYER_CACHES["growing"](batch, cfg.num_kv_heads, cfg.head_dim, dtype,
                                                  exact_capacity=exact_capacity,
                                                  **({"initial": 0} if exact_capacity else {})))
    return KVCache(cfg, batch, layers=layers, dtype=dtype)
