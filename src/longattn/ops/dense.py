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


def small_query_attention(q, k, v, mask, scale, sink_logits=None):
    """Explicit GQA attention for few queries without copying K/V per query head.

    q ``[B, H, Tq, D]`` is viewed as ``[B, Hkv, rep * Tq, D]`` so each KV head is read once.
    sink_logits ``[H]`` (or None): learned sinks, one more denominator term per head.
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
    if sink_logits is None:
        p = torch.softmax(s.masked_fill(~any_ok, 0.0), dim=-1) * any_ok
    else:
        sink = sink_logits.to(s.dtype).view(1, Hkv, rep, 1, 1)
        mx = torch.maximum(s.amax(-1, keepdim=True), sink)  # finite: the sink always counts
        p = torch.exp(s - mx)
        p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - mx))
    o = torch.matmul(p.view(B, Hkv, rep * Tq, S), v)  # [B, Hkv, rep*Tq, D]
    return o.view(B, H, Tq, D)


def flash_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                        is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's CPU flash attention with its log-normaliser (grouped heads read in place).

    Args:
        q ``[B, H, Tq, D]``; k, v ``[B, Hkv, Tk, D]``; bias: additive mask broadcastable to
        ``[B, H, Tq, Tk]`` (0 = read, -inf = skip) or None; is_causal: the causal mask instead.
    Returns:
        ``(out [B, H, Tq, D], lse [B, H, Tq])``, lse the log of each row's softmax denominator.
    """
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
    return o, lse


def with_learned_sinks(o: torch.Tensor, lse: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """An attention output normalised over its keys, renormalised with learned sinks.

    With one more denominator term ``e^sink`` whose value row is zero, ``o Z / (Z + e^sink)``
    with ``Z = e^lse`` is ``o * sigmoid(lse - sink)``. o ``[B, H, T, D]``, lse ``[B, H, T]``,
    sink_logits ``[H]`` -> ``[B, H, T, D]``.
    """
    w = torch.sigmoid(lse.to(o.dtype) - sink_logits.to(o.dtype).view(1, -1, 1))
    return o * w.unsqueeze(-1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention under a boolean mask.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, Hkv, Tk, D]`` (``H % Hkv == 0``).
        mask: bool ``[B, 1, Tq, Tk]`` (True = may read).
        scale: score multiplier.
        softcap: Gemma-2 style score soft-capping; falls back to the explicit path.
        sink_logits: ``[H]`` learned per-head sink logits (gpt-oss): one more term in each
            head's softmax denominator (flash kernel's log-normaliser, ``with_learned_sinks``).
    Returns:
        ``[B, H, Tq, D]``; rows with no readable key (padding queries) are zero.
    """
    if softcap is not None:
        from .reference import reference_attention
        return reference_attention(q, k, v, mask, scale, softcap, sink_logits)
    H, Hkv = q.shape[1], k.shape[1]
    if q.shape[2] <= SMALL_QUERY:
        return small_query_attention(q, k, v, mask, scale, sink_logits)
    any_ok = mask.any(dim=-1, keepdim=True)  # [B, 1, Tq, 1]
    # A fully masked row would make SDPA produce NaN; give it one dummy key and zero it after.
    safe = mask | ~any_ok
    if sink_logits is not None:
        bias = torch.zeros(safe.shape, dtype=q.dtype).masked_fill_(~safe, float("-inf"))
        o, lse = flash_attention_lse(q, k, v, bias, False, scale)
        return with_learned_sinks(o, lse, sink_logits).masked_fill(~any_ok, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale,
                                         enable_gqa=(H != Hkv))
    return out.masked_fill(~any_ok, 0.0)


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk over everything before it: queries ``[1, H, T, D]`` at the last T of the
    keys ``[1, Hkv, S, D]`` (S > T), query t reading keys ``0 .. S - T + t``.

    Two flash calls merged by their log-normalisers: every query reads the ``S - T`` earlier keys
    whole (a KV head's G query heads as one ``G * T``-row product), and the chunk's own keys
    causally. No ``[T, S]`` mask is built or read (the masked path's boolean and float masks are
    ~24 MiB a layer for a 512-token chunk at 8K), and the earlier keys meet all of a group's
    queries in one product. Equal to
    ``masked_attention`` under the causal mask up to summation order (learned ``sink_logits``
    ``[H]`` included). -> ``[1, H, T, D]``.
    """
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    P = S - T
    o1, l1 = flash_attention_lse(q.reshape(1, Hkv, (H // Hkv) * T, D), k[:, :, :P], v[:, :, :P], None, False,
                                 scale)
    o1, l1 = o1.reshape(1, H, T, D), l1.reshape(1, H, T)
    o2, l2 = flash_attention_lse(q, k[:, :, P:], v[:, :, P:], None, True, scale)
    m = torch.maximum(l1, l2)
    a, b = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1 * a.unsqueeze(-1) + o2 * b.unsqueeze(-1)) / (a + b).unsqueeze(-1)
    if sink_logits is not None:
        return with_learned_sinks(o, m + torch.log(a + b), sink_logits)
    return o


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Plain causal attention (query t reads keys 0..t) through the fused kernel.

    q ``[B, H, T, D]``, k/v ``[B, Hkv, T, D]`` -> ``[B, H, T, D]``. Equal to
    ``masked_attention`` with the causal mask up to summation order (learned ``sink_logits``
    ``[H]`` included).
    """
    if sink_logits is not None:
        o, lse = flash_attention_lse(q, k, v, None, True, scale)
        return with_learned_sinks(o, lse, sink_logits)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=(q.shape[1] != k.shape[1]))
