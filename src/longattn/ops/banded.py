"""Banded O(T*W) prefill attention: each query block reads only its window band plus sinks.

A query at absolute position i may read key j when ``j <= i`` and ``i - j < W``, or when
``j < sinks`` (docs/design.md). Full causal attention over T positions scores T(T+1)/2 pairs; a
window needs only about T*W. This module gets close to that with PyTorch's fused SDPA:

* queries are cut into blocks of ``block_size`` rows;
* block ``[s, s+m)`` gathers the keys ``[max(0, s-W+1), s+m)`` -- a contiguous *view* of the
  cache, no copy -- plus the sink columns ``[0, min(S, band_start))`` that fell out of the band
  (only then is a small concatenation made);
* one fused SDPA call per block with a small additive mask; blocks with the same geometry
  share one cached mask.

So a block scores at most ``m * (m + W - 1 + S)`` pairs and the whole call
``Tq * (block_size + W - 1 + S)``: O(T*W) instead of O(T^2).

Why a Python loop over views and not one batched call: gathering every band with ``unfold``
copies (block+W-1)/block times the cache, and the batched call loses the fused kernel's tiling;
an explicit matmul/mask/softmax gives up the fused kernel altogether. Per-call overhead is small
next to each block's work once blocks hold >= 32 queries. Splitting each band into a causal
square plus a flipped causal triangle merged by log-sum-exp would do the ideal T*W work, but the
fused CPU kernel only skips 512-key tiles, so it saves nothing over the masked band and would
need a private op; it is not used.

Block size (``default_block_size``): larger blocks waste ``block-1`` masked keys per query;
smaller ones run the kernel's smaller, less efficient tiles. ``clamp(W // 4, 32, 256)`` rounded
down to a power of two balances the two: small blocks for narrow windows, 256 for wide ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LongattnError
from .dense import causal_attention, flash_attention_lse, with_learned_sinks

MIN_BLOCK = 32
MAX_BLOCK = 256


@dataclass(frozen=True)
class BandBlock:
    """One query block of the plan.

    ``q0:q1`` indexes the query tensor (relative rows); ``k0:k1`` are the absolute key positions
    of the contiguous band; ``sink_cols`` sinks ``[0, sink_cols)`` are prepended because they lie
    before the band.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    sink_cols: int

    @property
    def keys(self) -> int:
        """Keys gathered for this block (band plus prepended sinks)."""
        return (self.k1 - self.k0) + self.sink_cols

    @property
    def scores(self) -> int:
        """(query, key) scores the fused call computes for this block."""
        return (self.q1 - self.q0) * self.keys


def default_block_size(window: int) -> int:
    """Query rows per block for a window of ``window`` keys (see the module docstring)."""
    b = max(MIN_BLOCK, min(MAX_BLOCK, int(window) // 4))
    return 1 << (b.bit_length() - 1)  # round down to a power of two


def _full_causal(window: int | None, tk: int) -> bool:
    return window is None or window <= 0 or window >= tk


def plan_blocks(tq: int, tk: int, window: int | None, sinks: int = 0,
                block_size: int | None = None) -> list[BandBlock]:
    """The blocks ``banded_attention`` runs, with the keys each one gathers.

    Args:
        tq: number of queries; they are the last ``tq`` of the ``tk`` positions.
        tk: number of keys (positions ``0 .. tk-1``).
        window: keys per query including itself; ``None``/``0``/``>= tk`` = full causal.
        sinks: first ``sinks`` positions readable by every query.
        block_size: query rows per block (default: ``default_block_size(window)``).
    Returns:
        list of ``BandBlock``; ``sum(b.scores)`` <= ``tq * (block + W - 1 + sinks)``.
    """
    _check_sizes(tq, tk, window, sinks, block_size)
    offset = tk - tq
    if _full_causal(window, tk):
        w, s_eff = tk, 0  # every earlier key is in the window; sinks add nothing
    else:
        w, s_eff = int(window), int(sinks)
    bs = block_size if block_size is not None else default_block_size(w)
    blocks = []
    for q0 in range(0, tq, bs):
        q1 = min(tq, q0 + bs)
        start = offset + q0  # absolute position of the block's first query
        k0 = max(0, start - w + 1)
        k1 = offset + q1
        blocks.append(BandBlock(q0, q1, k0, k1, min(s_eff, k0)))
    return blocks


def _check_sizes(tq: int, tk: int, window, sinks, block_size) -> None:
    if tq > tk:
        raise LongattnError(f"banded attention needs at least as many keys as queries "
                            f"(got {tq} queries, {tk} keys); queries are the last Tq positions")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise LongattnError(f"window must be an int or None, got {window!r}")
    if window is not None and window < 0:
        raise LongattnError(f"window must be >= 0 (0 or None = full causal), got {window}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise LongattnError(f"sinks must be a non-negative int, got {sinks!r}")
    if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
        raise LongattnError(f"block_size must be a positive int, got {block_size!r}")


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise LongattnError(f"banded attention expects 4-D [B, H, T, D] tensors, got "
                            f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape != v.shape:
        raise LongattnError(f"k and v shapes differ: k{tuple(k.shape)} v{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise LongattnError(f"q{tuple(q.shape)} and k{tuple(k.shape)} disagree on batch or head_dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise LongattnError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
                            f"({k.shape[1]}) for grouped-query attention")


def _band_mask(m: int, rel: int, width: int, sink_cols: int, sink_in_band: int,
               window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask ``[m, sink_cols + width]`` (0 = read, -inf = skip) for one block.

    Query row r sits at ``rel + r`` relative to the band's first key; band column c is the key
    ``c`` positions after the band start. Band columns ``c < sink_in_band`` are sinks.
    """
    qp = torch.arange(m, device=device)[:, None] + rel  # [m, 1]
    kp = torch.arange(width, device=device)[None, :]     # [1, width]
    ok = (kp <= qp) & (((qp - kp) < window) | (kp < sink_in_band))  # [m, width]
    if sink_cols:
        ok = torch.cat([ok.new_ones(m, sink_cols), ok], dim=1)  # sinks before the band: all read
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                     sinks: int = 0, scale: float | None = None,
                     block_size: int | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Sliding-window (+ sinks) causal attention doing O(Tq * W) work.

    Args:
        q: ``[B, H, Tq, D]`` queries; query t sits at absolute position ``Tk - Tq + t`` (the last
            Tq positions: ``Tq == Tk`` is one-shot prefill, ``Tq < Tk`` a chunk of a longer one).
        k, v: ``[B, Hkv, Tk, D]`` keys/values at positions ``0 .. Tk-1``; ``H % Hkv == 0`` (GQA:
            query head h reads key head ``h // (H // Hkv)``).
        window: W, keys per query including itself (query i reads j with ``j <= i`` and
            ``i - j < W``). ``None`` or ``0`` = full causal; ``W >= Tk`` is the same thing and
            takes the same path (bit-identical to ``None``).
        sinks: S, positions ``0 .. S-1`` stay readable by every later query.
        scale: score multiplier, default ``D ** -0.5``.
        block_size: query rows per block; default ``default_block_size(W)``.
        sink_logits: ``[H]`` learned per-head sink logits (gpt-oss): each block's output is
            renormalised with its flash log-normaliser (``dense.with_learned_sinks``).
    Returns:
        ``[B, H, Tq, D]`` in q's dtype; equals ``reference_attention`` under
        ``allowed_mask(q_pos, k_pos, window, sinks)`` to floating-point rounding.
    Raises:
        LongattnError: bad shapes, negative window/sinks, Tq > Tk, heads not grouping.
    """
    _check_tensors(q, k, v)
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    blocks = plan_blocks(Tq, Tk, window, sinks, block_size)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    gqa = H != Hkv
    full = _full_causal(window, Tk)
    if Tq == 0:
        return q.new_empty(B, H, 0, D)
    if full and Tq == Tk:
        # Whole prompt, no effective window: the fused causal kernel already skips the upper half.
        return causal_attention(q, k, v, scale, sink_logits)
    w = Tk if full else int(window)
    s_eff = 0 if full else sinks  # with every earlier key in the window, sinks add nothing
    offset = Tk - Tq
    out = q.new_empty(B, H, Tq, D)
    masks: dict = {}  # blocks with the same geometry (all interior ones) share one mask
    for b in blocks:
        m = b.q1 - b.q0
        rel = offset + b.q0 - b.k0         # first query's position relative to the band start
        width = b.k1 - b.k0
        sink_in_band = max(0, s_eff - b.k0)  # band columns that are sinks
        key = (m, rel, width, b.sink_cols, sink_in_band)
        mask = masks.get(key)
        if mask is None:
            mask = _band_mask(m, rel, width, b.sink_cols, sink_in_band, w, q.dtype, q.device)
            masks[key] = mask
        kb = k[:, :, b.k0:b.k1]  # [B, Hkv, width, D] view, no copy
        vb = v[:, :, b.k0:b.k1]
        if b.sink_cols:
            kb = torch.cat([k[:, :, :b.sink_cols], kb], dim=2)  # [B, Hkv, S' + width, D]
            vb = torch.cat([v[:, :, :b.sink_cols], vb], dim=2)
        qb = q[:, :, b.q0:b.q1]
        if sink_logits is None:
            out[:, :, b.q0:b.q1] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                                                  enable_gqa=gqa)
        else:  # every query reads at least itself, so no row is fully masked
            o, lse = flash_attention_lse(qb, kb, vb, mask, False, scale)
            out[:, :, b.q0:b.q1] = with_learned_sinks(o, lse, sink_logits)
    return out
