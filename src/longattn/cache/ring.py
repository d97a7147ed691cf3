"""Rolling (ring) KV cache with pinned sink slots: constant memory for a windowed layer.

Layout per stream: ``sinks`` pinned slots followed by ``window`` rotating slots. Position
``p`` lives in slot ``p`` if ``p < sinks`` else ``sinks + (p - sinks) % window``
(docs/design.md), computed per batch row, so streams may sit at different positions.

``update(k, v, pos)`` with a chunk of T tokens (T may exceed the window: Mistral-style
chunked prefill into a rolling cache) returns the ring contents from BEFORE the chunk
followed by the chunk itself, with absolute positions. Every query of the chunk therefore
sees every key of its window, even keys the chunk is about to overwrite; the mask built
from positions (``ops.masks.allowed_mask``) keeps it exact. The chunk is then written;
only its sinks and its last ``window`` non-sink positions survive. A single-token decode
step writes first and returns the ring itself (the slot it overwrites held position
``p - window``, outside the query's window), so the decode view has a static shape.

Position re-indexing (StreamingLLM), ``reindex=True``: attention sees positions *within
the cache* -- sinks at ``0..S-1``, the window following them in order -- so the relative
distances never exceed what the cache spans, however long the stream runs. RoPE scores
depend only on ``q_pos - k_pos``, so instead of re-rotating queries we leave the model's
absolute query rotation alone and move keys: a key is rotated to
``absolute_q - (cache_q - cache_k)``. Window keys follow the chunk contiguously, so for
them that is their own absolute position (no work, bit-identical); only the sinks move,
by ``gap = max(0, lo - sinks)`` where ``lo = first_query - window + 1`` is the first
window position the chunk reads. Keys are stored as the model rotated them (absolute
positions) and the sinks are re-rotated on read; ``k_pos`` stays absolute so the mask is
unchanged. Cache positions of a chunk are its view's order: sinks ``0..S-1``, then
``lo, lo+1, ...`` at ``S, S+1, ...``; a decode query sits at ``S + window - 1`` once the
window has left the sinks, and a chunk of T queries reaches ``S + window + T - 2``.
Note: the query is still rotated at its absolute angle in float32 by the model, so for
very long streams (angles ~1e6 rad) the rotation itself loses precision; the distances
are what re-indexing bounds.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import LongattnError, check_int
from .base import LayerCache, register_layer_cache
from .kv_format import encode, rerotate_rows, row_width


def ring_slot(pos: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Slot of each absolute position ``pos`` (any shape, int64, >= 0) in a ring of
    ``sinks`` pinned slots and ``window`` rotating ones (docs/design.md)."""
    return torch.where(pos < sinks, pos, sinks + (pos - sinks).remainder(window))


class RingLayerCache(LayerCache):
    """One layer's rolling cache: ``sinks + window`` slots per stream, allocated up front.

    Args:
        batch, kv_heads, head_dim: storage shape ``[batch, kv_heads, sinks + window, head_dim]``.
        window: rotating slots (>= 1); usually the layer's attention window (plus slack).
        sinks: pinned slots for positions ``0..sinks-1``.
        dtype: storage format of K and V (cache/kv_format.py; rows as stored).
        inv_freq: ``[head_dim // 2]`` the layer's RoPE inverse frequencies (needed by
            ``reindex`` and by eviction's re-rotation).
        reindex: attend by positions within the cache (StreamingLLM); see the module doc.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, window: int, sinks: int = 0,
                 dtype=torch.float32, inv_freq: Optional[torch.Tensor] = None, reindex: bool = False):
        check_int("ring cache window", window, minimum=1)
        check_int("ring cache sinks", sinks)
        if reindex and inv_freq is None:
            raise LongattnError("ring cache reindex=True needs the layer's RoPE inv_freq "
                                "(build it with make_cache(..., model=model))")
        self.B, self.H, self.D, self.dtype = batch, kv_heads, head_dim, dtype
        self.window, self.sinks = window, sinks
        self.inv_freq = inv_freq
        self.reindex = reindex
        cap = sinks + window
        self.W = row_width(dtype, head_dim)  # elements of a stored row (D unless int8)
        self.k = torch.zeros(batch, kv_heads, cap, self.W, dtype=dtype)  # [B, Hkv, S+W, W]
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, cap), -1, dtype=torch.int64)         # [B, S+W]
        # Slots [hi, S+W) have never been written in any row. Views stop at hi, so before the
        # ring wraps a view is laid out exactly like a growing cache's (slot i = position i):
        # same shapes, same summation order, bit-identical results (DESIGN invariant 2).
        self.hi = 0

    # ------------------------------------------------------------------ interface

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def update(self, k, v, pos):
        """Store ``k, v [B, Hkv, T, D]`` at positions ``pos [B, T]`` (-1 = padding, not stored).

        Returns ``(k_all, v_all, k_pos)``: ``[B, Hkv, N, D]`` twice and ``[B, N]`` absolute
        positions, N = the written slots (``sinks + window`` once the ring is full) plus T when
        T > 1. See the module doc.
        """
        if k.shape[2] == 1:
            self._write(k, v, pos)
            h = self.hi
            k_all, v_all, k_pos = self.k[:, :, :h], self.v[:, :, :h], self.pos[:, :h]
        else:
            h = self.hi
            # the chunk as stored, so its keys read as every later read of them will
            k_all = torch.cat((self.k[:, :, :h], encode(k, self.dtype)), dim=2)  # [B, Hkv, hi+T, W]
            v_all = torch.cat((self.v[:, :, :h], encode(v, self.dtype)), dim=2)
            k_pos = torch.cat((self.pos[:, :h], pos), dim=1)  # [B, hi+T]
            self._write(k, v, pos)
        if self.reindex:
            k_all = self._reindexed_keys(k_all, k_pos, pos)
        return k_all, v_all, k_pos

    def nbytes(self) -> int:
        """Bytes of K and V storage (constant: allocated once at ``sinks + window`` slots)."""
        return self.k.nbytes + self.v.nbytes

    def positions(self) -> torch.Tensor:
        return self.pos

    def view(self):
        """The ring as stored: ``(k [B, Hkv, S+W, D], v, pos [B, S+W])``, slot order."""
        return self.k, self.v, self.pos

    # ------------------------------------------------------------------ internals

    def _write(self, k, v, pos) -> None:
        """Write the surviving tokens of a chunk into their slots.

        Survivors per row: sinks, and non-sink positions within ``window`` of the row's
        last position -- distinct positions there map to distinct slots, so the indexed
        write never sees a duplicate slot.
        """
        last = pos.max(dim=1, keepdim=True).values  # [B, 1]
        keep = (pos >= 0) & ((pos < self.sinks) | (pos > last - self.window))  # [B, T]
        b, t = keep.nonzero(as_tuple=True)  # [N] each
        if b.numel() == 0:
            return
        p = pos[b, t]
        s = ring_slot(p, self.sinks, self.window)
        self.k[b, :, s] = encode(k[b, :, t], self.dtype)  # [N, Hkv, W]
        self.v[b, :, s] = encode(v[b, :, t], self.dtype)
        self.pos[b, s] = p
        self.hi = max(self.hi, int(s.max()) + 1)

    def sink_gap(self, q_pos: torch.Tensor) -> torch.Tensor:
        """``[B]`` how far re-indexing moves the sinks for a chunk at ``q_pos [B, T]``:
        ``max(0, first_query - window + 1 - sinks)`` (0 for an all-padding row)."""
        valid = q_pos >= 0
        big = torch.iinfo(torch.int64).max
        first = torch.where(valid, q_pos, torch.full_like(q_pos, big)).min(dim=1).values  # [B]
        gap = (first - self.window + 1 - self.sinks).clamp(min=0)
        return torch.where(valid.any(dim=1), gap, torch.zeros_like(gap))

    def _reindexed_keys(self, k_all, k_pos, q_pos):
        """Rotate the sink keys of a view forward by the sink gap (module doc)."""
        S = self.sinks
        if S == 0:
            return k_all
        gap = self.sink_gap(q_pos)  # [B]
        if not bool((gap > 0).any()):
            return k_all
        # When the gap is positive the chunk starts past the sinks, so every sink in the
        # view sits in the ring's sink slots 0..S-1.
        is_sink = (k_pos[:, :S] >= 0) & (k_pos[:, :S] < S)  # [B, S]
        delta = torch.where(is_sink, gap[:, None], torch.zeros_like(k_pos[:, :S]))  # [B, S]
        moved = rerotate_rows(k_all[:, :, :S], delta, self.inv_freq, self.D)  # [B, Hkv, S, W]
        return torch.cat((moved, k_all[:, :, S:]), dim=2)

    def replace_contents(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Empty the ring and place stored rows ``k, v [B, Hkv, N, W]`` at ``pos [B, N]``
        (-1 = nothing) by their slots; where two entries share a slot the later position
        wins. Used by eviction after renumbering."""
        valid = pos >= 0
        slot = ring_slot(pos.clamp(min=0), self.sinks, self.window)  # [B, N]
        best = torch.full((self.B, self.capacity), -1, dtype=torch.int64)
        best = best.scatter_reduce(1, slot, torch.where(valid, pos, torch.full_like(pos, -1)),
                                   reduce="amax", include_self=True)  # [B, S+W]
        win = valid & (pos == best.gather(1, slot))  # [B, N]
        self.k.zero_()
        self.v.zero_()
        self.pos.fill_(-1)
        b, n = win.nonzero(as_tuple=True)
        s = slot[b, n]
        self.k[b, :, s] = k[b, :, n]
        self.v[b, :, s] = v[b, :, n]
        self.pos[b, s] = pos[b, n]
        filled = (self.pos >= 0).any(dim=0).nonzero()
        self.hi = int(filled.max()) + 1 if filled.numel() else 0


register_layer_cache("ring", RingLayerCache)
