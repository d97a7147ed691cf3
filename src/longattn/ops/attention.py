"""The one place that picks an attention kernel, and the kernels' Python forms.

Every attention site calls one of two functions:

* ``attend``: queries ``[B, H, Tq, D]`` over a cache's keys ``[B, Hkv, S, D]`` whose slots carry
  absolute positions (the eager paths: full forward, chunked prefill, step decode, streams);
* ``attend_buffer_and_new``: one decode query over a read-only buffer plus the step's own new
  key, in one softmax (the fixed-shape static step, which writes its keys after the step).

Both apply the same rule (``ops.masks.allowed_mask``: window W counts the query itself, sinks
stay readable) and choose among the kernels below from shapes, dtypes and positions only:

    fused    longattn's C++ decode kernel (csrc/decode_attention.cpp): one query per stream,
             float32, no soft-cap; the mask is decided from positions inside the kernel
    banded   O(T*W) prefill (ops/banded.py) for long windowed chunks over keys 0..T-1
    causal   SDPA's fused causal kernel when the mask is exactly causal
    prefix   a chunk over every earlier key: the earlier keys whole, the chunk causally, merged by
             log-normalisers (ops.dense.prefix_causal_attention; no mask built)
    masked   SDPA (or grouped matmuls for few queries) under an explicit boolean mask
    matmul   two batched matmuls and a softmax over the static buffer
    flash    ATen's blocked CPU flash kernel over the static buffer, own key merged after

The reference path is one switch away: ``fused=False`` (or ``kernel="matmul"`` for the static
step) per call site, or ``LONGATTN_NATIVE=off`` for the whole process (ops/native.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import native
from .dense import causal_attention, masked_attention, prefix_causal_attention
from .masks import allowed_mask

# Prefill chunks at least this long take the banded path on windowed layers; below it the
# fused causal kernel wins (benchmarks/prefill_attention.py measures the crossover).
BANDED_MIN_TOKENS = 2048

STATIC_KERNELS = ("fused", "matmul", "flash")

# the cache formats' dtypes (cache/kv_format.KV_FORMATS, not imported here: the cache package
# imports this module), which the native readers (decode_attention, scsa_decode) take as stored
STORED_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def _same_positions(kept: torch.Tensor, pos: torch.Tensor) -> bool:
    return (kept.shape == pos.shape and kept.dtype == pos.dtype and kept.device == pos.device
            and bool(torch.equal(kept, pos)))


class MaskMemo:
    """The last boolean mask built per (window, sinks), reused while the positions match.

    Within one forward every layer gets the same query positions, and layers whose caches
    are alike hold the same key positions, so layers sharing a window and sinks share one
    ``allowed_mask``. A hit needs ``q_pos`` and ``k_pos`` equal in value to private copies
    taken when the mask was built. Value, not identity: a cache writes its position
    tensor in place and Python reuses the ids of freed tensors, so an identity key could
    hand back a mask built for other positions; the copies cannot change or be freed.
    Equal positions give the same mask, so a hit is bit-identical to building it again.
    One entry per (window, sinks): the next forward's positions replace it, which bounds
    memory to one mask per distinct setting (``clear()`` drops them).
    """

    def __init__(self):
        self._entries: dict = {}  # (window, sinks) -> (q_pos copy, k_pos copy, mask)
        self.hits = 0
        self.misses = 0

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int],
             sinks: int) -> torch.Tensor:
        """``allowed_mask(q_pos, k_pos, window, sinks)``, built once per distinct positions."""
        entry = self._entries.get((window, sinks))
        if entry is not None and _same_positions(entry[0], q_pos) and _same_positions(entry[1], k_pos):
            self.hits += 1
            return entry[2]
        self.misses += 1
        mask = allowed_mask(q_pos, k_pos, window, sinks)
        self._entries[(window, sinks)] = (q_pos.clone(), k_pos.clone(), mask)
        return mask

    def clear(self) -> None:
        self._entries.clear()


class PagedRows(NamedTuple):
    """A paged cache's keys or values read in place: slot ``s`` of stream ``b`` is row
    ``table[b, s // block_size] * block_size + s % block_size`` of ``pool``.

    ``attend`` hands it to the fused decode kernel as it is; any other kernel reads
    ``gather()``, the ``[B, Hkv, length, D]`` tensor a growing cache would hold."""

    pool: torch.Tensor   # [1, Hkv, R, W]: every stream's blocks, rows contiguous (cache/kv_format.py)
    table: torch.Tensor  # int64 [B, NB]: each stream's blocks in position order
    block_size: int
    length: int          # N slots per stream (<= NB * block_size)

    def gather(self) -> torch.Tensor:
        """``[B, Hkv, N, W]``: each stream's blocks copied whole, in order, cut to N slots (rows
        as stored: ``kv_format.widen`` makes them values)."""
        _, H, _, D = self.pool.shape
        B, nb = self.table.shape
        blocks = self.pool[0].view(H, -1, self.block_size, D).index_select(1, self.table.reshape(-1))
        return blocks.view(H, B, nb * self.block_size, D)[:, :, :self.length].transpose(0, 1).contiguous()

    def widened(self, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """``gather()`` as values of ``dtype``, ``[B, Hkv, N, head_dim]``: a bfloat16 pool widens
        exactly; an int8 pool's rows widen as the kernels widen them."""
        from ..cache.kv_format import widen
        return widen(self.gather(), head_dim, dtype)


def fused_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap,
                  sink_logits: Optional[torch.Tensor] = None) -> bool:
    """The C++ decode kernel serves one float32 query per stream without soft-capping over a
    float32, bfloat16 or int8 (q8 rows) cache read in place (learned sink logits, float32,
    included)."""
    return (q.shape[2] == 1 and softcap is None and q.dtype == torch.float32 and k.dtype == v.dtype
            and k.dtype in STORED_DTYPES
            and (sink_logits is None or sink_logits.dtype == torch.float32) and native.available())


def paged_fused_applies(q: torch.Tensor, pool: torch.Tensor, sink_logits=None) -> bool:
    """The fused kernel reads a paged pool in place: float32 queries, a float32, bfloat16 or
    int8 (q8) pool (soft-capped scores included: a paged cache has no other path that is the same bits
    at every chunking)."""
    return (q.dtype == torch.float32 and pool.dtype in STORED_DTYPES
            and (sink_logits is None or sink_logits.dtype == torch.float32) and native.available())


def attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
           window: Optional[int], sinks: int, scale: float, softcap: Optional[float] = None, *,
           fused: bool = True, banded_min_tokens: Optional[int] = BANDED_MIN_TOKENS,
           masks: Optional["MaskMemo"] = None, sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of queries over cached keys by absolute positions.

    Args:
        q: ``[B, H, Tq, D]``; q_pos: ``[B, Tq]`` int64 (negative = padding query, outputs zeros).
        k, v: ``[B, Hkv, S, D]``, or a cache's stored rows of another format (bfloat16, or int8
            ``[B, Hkv, S, W]``: cache/kv_format.py), or ``PagedRows`` (a paged cache read in
            place); k_pos: ``[B, S]`` (negative = empty slot, never read).
        window: keys per query including itself (None = full causal); sinks: first positions
            always readable; scale: score multiplier; softcap: Gemma-style score soft-capping.
        fused: allow the C++ decode kernel (False keeps the matmul form, its reference).
        banded_min_tokens: chunks this long or longer over keys 0..T-1 take the banded path on
            a windowed layer (None: never).
        masks: a MaskMemo shared by the layers of one forward (masks built once per setting).
        sink_logits: ``[H]`` learned per-head sink logits (gpt-oss), one more term in each
            softmax denominator, on every kernel.
    Returns:
        ``[B, H, Tq, D]``.
    """
    if isinstance(k, PagedRows):
        if fused and paged_fused_applies(q, k.pool, sink_logits):
            return paged_rows_attention(q, q_pos, k, v, k_pos, window, sinks, scale, sink_logits, softcap)
        k, v = (x.widened(q.shape[-1], q.dtype) for x in (k, v))
    use_fused = fused and fused_applies(q, k, v, softcap, sink_logits)
    if k.dtype != q.dtype and not use_fused:  # stored rows widen as the fused kernel widens them
        from ..cache.kv_format import widen
        k, v = widen(k, q.shape[-1], q.dtype), widen(v, q.shape[-1], q.dtype)
    if use_fused:
        none = q.new_empty(k.shape[0], k.shape[1], 0, q.shape[3])  # no separate own key: the cache holds it
        return torch.ops.longattn_cpu.decode_attention(q, k, v, k_pos, q_pos, none, none,
                                                       window or 0, sinks, float(scale), sink_logits)
    if _banded_applies(q, q_pos, k_pos, window, softcap, banded_min_tokens):
        from .banded import banded_attention
        return banded_attention(q, k, v, window, sinks, scale, sink_logits=sink_logits)
    if _reads_every_earlier_key(q, q_pos, k_pos, window, softcap):
        if q.shape[2] == k_pos.shape[1]:
            return causal_attention(q, k, v, scale, sink_logits)
        if q.dtype == torch.float32:  # float64 reference runs keep the masked path
            return prefix_causal_attention(q, k, v, scale, sink_logits)
    mask = masks.mask(q_pos, k_pos, window, sinks) if masks is not None else \
        allowed_mask(q_pos, k_pos, window, sinks)
    return masked_attention(q, k, v, mask, scale, softcap, sink_logits)


def paged_rows_attention(q, q_pos, k: PagedRows, v: PagedRows, k_pos, window, sinks, scale, sink_logits=None,
                         softcap=None, window_sinks: Optional[torch.Tensor] = None):
    """Every query of ``q [B, H, Tq, D]`` as one row of the fused decode kernel over a paged
    cache read in place -> ``[B, H, Tq, D]``.

    A prefill chunk's queries run as decode rows (each row of stream b gets b's block table; the
    kernel's ``pos_k <= pos_q`` test is the causal mask), so a position's attention is the same
    bits whether it was prefilled or decoded, in any chunk: a conversation that continues a
    cached prefix (its last reply decoded) computes what the whole conversation prefilled
    computes. Its cost is the work of causal attention read row by row instead of as a matmul.
    ``window_sinks``: int64 ``[2]`` taking the place of ``window`` and ``sinks`` (a compiled
    step's runtime data).
    """
    B, H, Tq, D = q.shape
    rows = q.transpose(1, 2).reshape(B * Tq, H, 1, D)
    table = k.table.repeat_interleave(Tq, 0) if Tq > 1 else k.table
    kp = k_pos.repeat_interleave(Tq, 0) if Tq > 1 else k_pos
    none = q.new_empty(B * Tq, k.pool.shape[1], 0, D)  # the pool already holds every key
    y = torch.ops.longattn_cpu.decode_attention(rows, k.pool, v.pool, kp, q_pos.reshape(B * Tq, 1), none, none,
                                                window or 0, sinks, float(scale), sink_logits, table, k.block_size,
                                                -1, float(softcap or 0.0), window_sinks)
    return y.view(B, Tq, H, D).transpose(1, 2) if Tq > 1 else y


def _reads_every_earlier_key(q, q_pos, k_pos, window, softcap) -> bool:
    """A chunk of more than a few queries at the end of keys 0..Tk-1, no window within reach
    (an unset window and any window >= Tk alike): its mask is exactly causal. With Tq == Tk (a
    one-shot prefill) the fused causal kernel skips the masked half of the work; with Tq < Tk
    (a chunk of a global layer's chunked prefill) the earlier keys are read whole and the chunk
    causally, no mask built."""
    Tq, Tk = q.shape[2], k_pos.shape[1]
    if softcap is not None or not 16 < Tq <= Tk or q.shape[0] != 1:
        return False
    if window is not None and window < Tk:
        return False
    return _keys_from_zero(q_pos, k_pos)


def _banded_applies(q, q_pos, k_pos, window, softcap, banded_min_tokens) -> bool:
    """Banded pays off for long windowed prefills over keys laid out as 0..Tk-1."""
    Tq, Tk = q.shape[2], k_pos.shape[1]
    if (banded_min_tokens is None or window is None or softcap is not None
            or q.shape[0] != 1 or Tq < banded_min_tokens or window >= Tk):
        return False
    return _keys_from_zero(q_pos, k_pos)


def _keys_from_zero(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when stream 0's keys are exactly positions 0..Tk-1 and its queries are the
    last Tq of them (a one-shot prefill, or a chunk over a cache that holds every earlier
    position in order): the layout the causal and banded kernels assume."""
    Tq, Tk = q_pos.shape[1], k_pos.shape[1]
    ar = torch.arange(Tk, dtype=k_pos.dtype)
    return bool(torch.equal(k_pos[0], ar) and torch.equal(q_pos[0], ar[Tk - Tq:]))


def static_kernel(kernel: str) -> str:
    """The static step's buffer read, resolved once per decoder (never while tracing): "fused"
    falls back to "matmul" where the native kernels are not built."""
    if kernel not in STATIC_KERNELS:
        from ..errors import LongattnError
        raise LongattnError(f"attention must be one of {', '.join(STATIC_KERNELS)}, got {kernel!r}")
    return "matmul" if kernel == "fused" and not native.available() else kernel


def attend_buffer_and_new(q, q_pos, k, v, k_pos, k_new, v_new, window: Optional[int], sinks: int,
                          scale: float, softcap: Optional[float] = None, kernel: str = "fused",
                          sink_logits: Optional[torch.Tensor] = None):
    """One decode query per stream over a read-only buffer plus the step's own key.

    Args:
        q: ``[B, H, 1, D]``; q_pos: ``[B, 1]`` (negative = padding stream, outputs zeros).
        k, v: ``[B, Hkv, S, D]`` buffers; k_pos: ``[B, S]`` slot positions (-1 = empty).
        k_new, v_new: ``[B, Hkv, 1, D]``; window, sinks, scale, softcap: as ``attend``.
        kernel: a ``static_kernel`` result ("fused" | "matmul" | "flash"); soft-capped or
            non-float32 layers read by matmul whatever is asked.
        sink_logits: ``[H]`` learned per-head sink logits (gpt-oss), on every kernel.
    Returns:
        ``[B, H, 1, D]``, equal to attention over the buffer with the new key written into it.
    """
    if kernel == "fused" and softcap is None and q.dtype == k.dtype == torch.float32 and \
            (sink_logits is None or sink_logits.dtype == torch.float32):
        return torch.ops.longattn_cpu.decode_attention(
            q, k, v, k_pos, q_pos, k_new.to(k.dtype), v_new.to(v.dtype), window or 0, sinks, float(scale),
            sink_logits)
    mask = allowed_mask(q_pos, k_pos, window, sinks)  # [B, 1, 1, S]
    if kernel == "flash" and softcap is None:
        return attend_buffer_and_self_flash(q, k, v, mask, k_new, v_new, q_pos >= 0, scale, sink_logits)
    return attend_buffer_and_self(q, k, v, mask, k_new, v_new, q_pos >= 0, scale, softcap, sink_logits)


def _grouped_sinks(sink_logits: Optional[torch.Tensor], Hkv: int, dtype) -> Optional[torch.Tensor]:
    """``[H]`` learned sink logits as ``[1, Hkv, rep, 1]`` (query head h = kv * rep + r)."""
    return None if sink_logits is None else sink_logits.to(dtype).view(1, Hkv, -1, 1)


def attend_buffer_and_self(q, k, v, mask, k_new, v_new, self_ok, scale, softcap=None, sink_logits=None):
    """One decode query over a read-only buffer plus its own new key, in one softmax.

    Args:
        q: ``[B, H, 1, D]``; k, v: ``[B, Hkv, S, D]`` buffers; mask: ``[B, 1, 1, S]`` bool.
        k_new, v_new: ``[B, Hkv, 1, D]`` the step's own key and value.
        self_ok: ``[B, 1]`` bool, False for padding queries (which then output zeros).
        sink_logits: ``[H]`` learned sink logits (one more denominator term per head) or None.
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
    sink = _grouped_sinks(sink_logits, Hkv, s.dtype)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with nothing to read
    p, pn = torch.exp(s - m), torch.exp(sn - m)
    den = p.sum(-1, keepdim=True) + pn
    if sink is not None:
        den = den + torch.exp(sink - m)
    num = torch.matmul(p, v) + pn * v_new.to(p.dtype)             # [B, Hkv, rep, D]
    out = torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), torch.zeros_like(num))
    return out.reshape(B, H, 1, D)


def attend_buffer_and_self_flash(q, k, v, mask, k_new, v_new, self_ok, scale, sink_logits=None):
    """``attend_buffer_and_self`` (no softcap) with the buffer read by ATen's CPU flash kernel.

    The g query heads sharing a KV head ride as the flash kernel's query-length axis
    (``[B, Hkv, g, D]``), so grouped-query attention needs no repeated keys. The kernel returns
    the buffer part's output and log-sum-exp; the step's own key is merged in closed form:
    ``out = (e^lse o + e^s v_new) / (e^lse + e^s)`` (``+ e^sink`` in the denominator with learned
    sinks). Same shapes and result as the matmul form, up to summation order; the kernel blocks
    the buffer and threads over heads.
    """
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qg = q.reshape(B, Hkv, g, D)
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))  # [B, 1, 1, S]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, k, v, 0.0, False, attn_mask=bias, scale=scale)  # [B, Hkv, g, D], [B, Hkv, g]
    lse = lse.float().unsqueeze(-1)
    sn = ((qg * k_new.to(qg.dtype)).sum(-1, keepdim=True) * scale).float()  # [B, Hkv, g, 1]
    sn = sn.masked_fill(~self_ok.view(B, 1, 1, 1), float("-inf"))
    m = torch.maximum(lse, sn)
    sink = _grouped_sinks(sink_logits, Hkv, torch.float32)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with nothing to read
    wb, wn = torch.exp(lse - m), torch.exp(sn - m)  # wb = 0 where the buffer part read nothing
    o = torch.where(wb > 0, o.float(), torch.zeros_like(o, dtype=torch.float32))
    den = wb + wn
    if sink is not None:
        den = den + torch.exp(sink - m)
    num = wb * o + wn * v_new.float()
    out = torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), torch.zeros_like(num))
    return out.to(q.dtype).reshape(B, H, 1, D)


class WindowOp:
    """Attention by absolute positions under one window and sinks (window None = dense causal)
    over a ``KVView``; ``attend`` picks the kernel. It holds settings only: whatever it reuses
    between calls (the mask memo) comes with the view.

    ``banded_min_tokens`` None keeps every prefill off the banded path; ``fused_decode=False``
    keeps decode steps on the matmul form (the fused kernel's reference)."""

    # Learned per-head sink logits (gpt-oss) are honoured (``attend``).
    learned_sinks = True

    def __init__(self, window: Optional[int] = None, sinks: int = 0,
                 banded_min_tokens: Optional[int] = BANDED_MIN_TOKENS, fused_decode: bool = True):
        self.window, self.sinks = window, sinks
        self.banded_min_tokens = banded_min_tokens
        self.fused_decode = fused_decode and native.available()

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        """``q [B, H, Tq, D]`` at ``q_pos [B, Tq]`` over ``view`` (cache.base.KVView) ->
        ``[B, H, Tq, D]``."""
        return attend(q, q_pos, view.k, view.v, view.positions, self.window, self.sinks, scale, softcap,
                      fused=self.fused_decode, banded_min_tokens=self.banded_min_tokens, masks=view.masks,
                      sink_logits=sink_logits)
