"""Masked attention through PyTorch's fused SDPA: the production path for every site.

Every path (full forward, chunked prefill, step decode, batched streams) goes through
``masked_attention`` with a mask built by ``allowed_mask``. Because an unset window and a
window wider than everything produce the same boolean mask, they are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# Below this many queries (decode steps, tiny chunks) explicit grouped matmuls beat the fused
# CPU kernel, whose per-call set-up dominates the little work a decode step has.
SMALL_QUERY = 16


def small_query_attention(q, k, v, mask, scale):
    """Explicit GQA attention for few queries without copying K/V per query head.

    q ``[B, H, Tq, D]`` is viewed as ``[B, Hkv, rep * Tq, D]`` so each KV head is read once.
    """
    B, H, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = H // Hkv
    qg = q.reshape(B, Hkv, rep * Tq, D)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, rep*Tq, S]
    s = s.view(B, Hkv, rep, Tq, S)
    m = mask.view(B, 1, 1, Tq, S)
    s = s.masked_fill(~m, float("-inf"))
    any_ok = m.any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~any_ok, 0.0), dim=-1) * any_ok
    o = torch.matmul(p.view(B, Hkv, rep * Tq, S), v)  # [B, Hkv, rep*Tq, D]
    return o.view(B, H, Tq, D)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention under a boolean mask.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, Hkv, Tk, D]`` (``H % Hkv == 0``).
        mask: bool ``[B, 1, Tq, Tk]`` (True = may read).
        scale: score multiplier.
        softcap: Gemma-2 style score soft-capping; falls back to the explicit path.
        sink_logits: ``[H]`` learned per-head sink logits (gpt-oss); the explicit path too.
    Returns:
        ``[B, H, Tq, D]``; rows with no readable key (padding queries) are zero.
    """
    if softcap is not None or sink_logits is not None:
        from .reference import reference_attention
        return reference_attention(q, k, v, mask, scale, softcap, sink_logits)
    H, Hkv = q.shape[1], k.shape[1]
    if q.shape[2] <= SMALL_QUERY:
        return small_query_attention(q, k, v, mask, scale)
    any_ok = mask.any(dim=-1, keepdim=True)  # [B, 1, Tq, 1]
    # A fully masked row would make SDPA produce NaN; give it one dummy key and zero it after.
    safe = mask | ~any_ok
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale,
                                         enable_gqa=(H != Hkv))
    return out.masked_fill(~any_ok, 0.0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention (query t reads keys 0..t) through the fused kernel.

    q ``[B, H, T, D]``, k/v ``[B, Hkv, T, D]`` -> ``[B, H, T, D]``. Equal to
    ``masked_attention`` with the causal mask up to summation order.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=(q.shape[1] != k.shape[1]))
