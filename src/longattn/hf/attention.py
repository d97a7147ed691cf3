"""longattn's attention inside a transformers model, through its AttentionInterface registry.

``apply(model, ...)`` registers ``longattn_attention`` under the name "longattn", sets the
model's attention implementation to it, and adds one forward pre-hook on the base model that
hands the call's ``past_key_values`` to the attention function (transformers passes a
model's extra keyword arguments down to every attention call). It returns a fresh cache for
``generate``. transformers builds no mask for an implementation it does not know, so the
attention masks by absolute positions itself: the positions the longattn cache layer
recorded for this call's queries and for every key slot it returned (a ring returns keys out
of position order), through the policy's own op (``ops.attention.WindowOp``: masked SDPA, banded
prefill, the fused decode kernel).

``detach(model)`` undoes ``apply``; ``attached(model, ...)`` does both around a ``with`` block.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

from ..errors import LongattnError
from ..policy import AttentionPolicy
from .cache import LongattnCache, ShiftingSinkCache, SinkCache
from .policy import check_transformers_version, model_config

NAME = "longattn"
_STATE = "_longattn_hf"  # attribute on an applied model: (hook handle, previous implementation)


def longattn_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                       longattn_cache=None, position_ids: Optional[torch.Tensor] = None, **kwargs):
    """transformers attention-function signature over a longattn cache.

    Args:
        module: the attention module (``layer_idx``).
        query: ``[B, H, T, D]``; key, value: ``[B, Hkv, N, D]`` as the cache layer returned them.
        attention_mask: ignored (None: transformers builds none for this implementation).
        scaling: the score scale the model uses.
        longattn_cache: the call's ``past_key_values`` (passed by apply's hook).
        position_ids: ``[1|B, T]`` the positions transformers rotated the queries at; they
            must be the cache's own count (no padding, no packing).
    Returns:
        ``(out [B, T, H, D], None)``.
    """
    if dropout:
        raise LongattnError("longattn.hf serves inference: put the model in eval() mode")
    cache = longattn_cache
    if not isinstance(cache, LongattnCache):
        raise LongattnError("a model under longattn.hf attention needs past_key_values=<a longattn.hf "
                            "cache> (the one apply() returns) and use_cache on; got "
                            f"{type(cache).__name__}")
    i = module.layer_idx
    layer = cache.layers[i]
    if layer.k_pos is None or layer.k_pos.shape[1] != key.shape[2]:
        raise LongattnError(f"layer {i}: the keys do not come from this longattn cache")
    q_pos = layer.q_pos
    if position_ids is not None and not torch.equal(position_ids.expand_as(q_pos).cpu(), q_pos):
        raise LongattnError("position_ids differ from the cache's own token count: padded, packed or "
                            "re-positioned inputs are not supported (feed each stream from position 0)")
    softcap = kwargs.get("softcap")  # what the model's own attention would apply (Gemma 2 style)
    op = cache.policy.op(i)
    extra = {}
    if kwargs.get("s_aux") is not None:  # gpt-oss: learned per-head sink logits [H]
        if not getattr(op, "learned_sinks", False):
            raise LongattnError(f"attention op {type(op).__name__} has no term for this model's learned sink "
                                "logits (gpt-oss); use a window, sink or dense policy")
        extra["sink_logits"] = kwargs["s_aux"].detach()
    rot = cache.kv.key_rotation
    if rot is not None:  # the keys are stored rotated (LongattnLayer.update): every score is unchanged
        query = query @ rot.to(query.dtype)
    view = layer.view._replace(k=key, v=value)  # the tensors transformers handed back (the same)
    out = op(query, q_pos, view, scale=scaling, softcap=softcap, **extra)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, longattn_attention)


def _pass_cache_hook(module, args, kwargs):
    """Forward pre-hook on the base model: hand ``past_key_values`` to the attention calls,
    and refuse padding (the attention masks by the cache's positions, not a 2-D mask)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise LongattnError("padded batches are not supported under longattn.hf attention: "
                            "run streams of equal length, or one at a time")
    kwargs["longattn_cache"] = kwargs.get("past_key_values")
    return args, kwargs


def _check_model(model) -> None:
    check_transformers_version()
    model_config(model.config)  # refuses an unserved family
    if not hasattr(model, "base_model") or not hasattr(model, "set_attn_implementation"):
        raise LongattnError(f"{type(model).__name__} is not a transformers PreTrainedModel")
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise LongattnError(f"longattn.hf runs on CPU; the model is on {p.device}")
    if p.dtype not in (torch.float32, torch.float64):
        raise LongattnError(f"longattn.hf serves float32 and float64 models; this one is {p.dtype} "
                            "(model.float() converts it)")


def apply(model, policy: Union[str, AttentionPolicy] = "sink", *, window: Optional[int] = None,
          sinks: int = 4, layers: str = "auto", shift: bool = False, kv: str = "f32") -> LongattnCache:
    """Route ``model``'s attention through longattn and return a cache for ``generate``.

    Args:
        model: a transformers causal LM of a served family (hf.policy.SERVED_MODEL_TYPES),
            on CPU.
        policy: "sink" (window + sinks: ``SinkCache`` / ``ShiftingSinkCache``), "sparse"
            (SCSA decode on the checkpoint's global layers, default SCSAConfig; ``window`` and
            ``sinks`` then apply to the other layers), or an AttentionPolicy built on
            ``longattn.hf.model_config(model.config)`` (a fresh one per cache).
        window, sinks, layers: the "sink" policy (see SinkCache).
        shift: StreamingLLM's position shift (ShiftingSinkCache).
        kv: how the cache stores keys and values: "f32" (as computed), "bf16" or "int8"
            (LongattnCache).
    Returns:
        a new cache; pass it as ``past_key_values=``. ``cache.reset()`` empties it for reuse.

    Calling it again on an applied model just returns a new cache.
    """
    _check_model(model)
    if isinstance(policy, str):
        if policy == "sparse":
            from ..sparse.policy import build_sparse_policy
            sparse = build_sparse_policy(model_config(model.config), window=window, sinks=sinks if window else 0)
            cache = LongattnCache(model.config, sparse, shift=shift, kv=kv)
        elif policy == "sink":
            cache = (ShiftingSinkCache if shift else SinkCache)(model.config, window=window, sinks=sinks,
                                                                layers=layers, kv=kv)
        else:
            raise LongattnError(f"unknown policy '{policy}': use 'sink', 'sparse' or an AttentionPolicy")
    elif isinstance(policy, AttentionPolicy):
        cache = LongattnCache(model.config, policy, shift=shift, kv=kv)
    else:
        raise LongattnError(f"policy must be 'sink' or an AttentionPolicy, got {type(policy).__name__}")
    if getattr(model, _STATE, None) is None:
        _register()
        previous = model.config._attn_implementation
        model.set_attn_implementation(NAME)
        handle = model.base_model.register_forward_pre_hook(_pass_cache_hook, with_kwargs=True)
        setattr(model, _STATE, (handle, previous))
    return cache


def detach(model) -> None:
    """Undo ``apply``: remove the hook and restore the previous attention implementation."""
    state = getattr(model, _STATE, None)
    if state is None:
        return
    handle, previous = state
    handle.remove()
    model.set_attn_implementation(previous)
    setattr(model, _STATE, None)


@contextlib.contextmanager
def attached(model, policy: Union[str, AttentionPolicy] = "sink", **kw):
    """``with attached(model, window=W, sinks=S) as cache:`` apply, then detach on exit
    (a model that was already applied stays applied)."""
    was = getattr(model, _STATE, None) is not None
    cache = apply(model, policy, **kw)
    try:
        yield cache
    finally:
        if not was:
            detach(model)
