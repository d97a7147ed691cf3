"""Slow, obviously-correct attention: explicit scores, mask, softmax, weighted sum.

Used as the reference every fast path is compared against (runs in float64 if given
float64 inputs).
"""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, softcap: float | None = None,
                        sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(mask(q k^T * scale)) v with grouped-query heads.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, Hkv, Tk, D]`` with ``H % Hkv == 0``.
        mask: bool, broadcastable to ``[B, H, Tq, Tk]``; True = may read.
        scale: multiplier on q.k (usually ``D ** -0.5``).
        softcap: if set, scores become ``softcap * tanh(scores / softcap)``.
        sink_logits: ``[H]`` learned per-head logits (gpt-oss): each joins its head's softmax
            denominator as one more score whose value row is zero.
    Returns:
        ``[B, H, Tq, D]``; rows with no readable key are zero.
    """
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    k = k.repeat_interleave(rep, dim=1)  # [B, H, Tk, D]
    v = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Tq, Tk]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    any_ok = mask.any(dim=-1, keepdim=True)
    s = s.masked_fill(~any_ok, 0.0)
    if sink_logits is not None:
        sink = sink_logits.to(s.dtype).view(1, H, 1, 1).expand(B, H, Tq, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    else:
        p = torch.softmax(s, dim=-1)
    p = p * any_ok
    return torch.matmul(p, v)
