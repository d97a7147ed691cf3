"""Eviction: forget a span of positions, renumber what follows, and trim to the window.

``evict(cache, start, end, model)`` removes absolute positions ``[start, end)`` from every
layer and (``renumber=True``) moves every later position down by ``d = end - start``,
re-rotating those keys by ``-d`` with the layer's own RoPE frequencies, so the cache holds
what it would hold had the span never been seen -- exactly for positions and values,
and for keys up to float32 RoPE-angle rounding (``rerotate_error_bound``). Whether the
*contents* of later tokens equal a never-seen run depends on the model: they do once
the span lies out of reach of those tokens (for windowed attention, ``L * (W - 1)``
positions back).

``trim_to_window(cache, policy, slack)`` drops growing-cache slots that no future query
can read under a windowed policy (older than ``window + slack``; sinks kept), without
renumbering: bounded memory with an unbounded cache class.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from ..errors import LongattnError, check_int
from .base import GrowingLayerCache, KVCache
from .kv_format import rerotate_rows
from .ring import RingLayerCache


def rerotate_error_bound(max_angle: float, rotations: int = 2) -> float:
    """Relative bound on ``|R(a') k - R(a) k| / max|k pair|`` when ``a'`` reaches the angle
    ``a`` through ``rotations`` float32 RoPE rotations (``rope_cos_sin`` forms angles in
    float32 whatever the key dtype).

    Each rotation's angle ``fl32(p * f)`` is off by at most half an ulp of the largest angle,
    and its cos and sin by at most 2**-24 each; a rotation error of ``e`` radians moves a
    pair by at most ``e`` times its norm. Comparing ``R(-d) R(p) k`` with ``R(p - d) k``
    involves three angles, so ``rotations + 1`` angle roundings and ``rotations + 1``
    cos/sin roundings:

        bound = (rotations + 1) * (ulp32(max_angle) / 2 + 2 * 2**-24)

    Arithmetic on the keys themselves adds dtype rounding on top (float64 in tests).
    """
    ulp = 2.0 ** (math.floor(math.log2(max(max_angle, 2.0 ** -126))) - 23)  # float32 ulp
    return (rotations + 1) * (ulp / 2 + 2 * 2.0 ** -24)


def refuse_length_dependent_rope(layers, what: str) -> None:
    """Re-rotating a key needs one fixed frequency set per layer; dynamic and longrope
    scaling change theirs with the sequence length, so moving keys there is refused."""
    for blk in layers:
        if blk.self_attn.rope_varies:
            raise LongattnError(f"{what} re-rotates keys, which needs fixed RoPE frequencies; this "
                                f"model's rope_type '{blk.self_attn.rope_scaling['rope_type']}' changes "
                                "them with the sequence length")


def layer_inv_freqs(model_or_inv_freqs, num_layers: int) -> list:
    """Per-layer ``[head_dim // 2]`` inv_freq from a Transformer or a sequence of tensors."""
    if hasattr(model_or_inv_freqs, "model") and hasattr(model_or_inv_freqs.model, "layers"):
        fs = [blk.self_attn.inv_freq for blk in model_or_inv_freqs.model.layers]
    elif isinstance(model_or_inv_freqs, (list, tuple)):
        fs = list(model_or_inv_freqs)
    else:
        raise LongattnError("evict needs the model (or a list of per-layer inv_freq tensors) "
                            "to re-rotate keys")
    if len(fs) != num_layers:
        raise LongattnError(f"got {len(fs)} inv_freq tensors for a cache of {num_layers} layers")
    return fs


def _validate_span(cache: KVCache, start, end) -> None:
    check_int("evict start", start, minimum=None)
    check_int("evict end", end, minimum=None)
    if start < 0:
        raise LongattnError(f"evict start must be >= 0, got {start}")
    if start >= end:
        raise LongattnError(f"evict range [{start}, {end}) is empty: start must be < end")
    held = int(cache.next_pos.min().item())
    if end > held:
        raise LongattnError(f"evict range [{start}, {end}) is outside the cache: it holds positions "
                            f"0..{held - 1}" + (" in every stream" if cache.batch > 1 else ""))
    for i, layer in enumerate(cache.layers):
        if type(layer) not in _EVICTORS:
            raise LongattnError(f"layer {i} cache ({type(layer).__name__}) does not support eviction")
        if isinstance(layer, RingLayerCache) and start < layer.sinks:
            # Positions [end, end + sinks - start) would become sinks; the ring must still hold them.
            need_hi = torch.minimum(torch.full_like(cache.next_pos, end + layer.sinks - start),
                                    cache.next_pos)  # [B]
            for b in range(cache.batch):
                want = torch.arange(end, int(need_hi[b]))
                if not torch.isin(want, layer.pos[b]).all():
                    raise LongattnError(f"cannot evict [{start}, {end}) from layer {i}: its ring has "
                                        f"already dropped the tokens that would become its {layer.sinks} "
                                        f"sink(s)")


def _renumbered(k, pos, start: int, end: int, inv_f, renumber: bool, head_dim: int):
    """Shift positions >= end down by ``end - start`` and re-rotate those keys (stored rows
    ``k [B, Hkv, N, W]``)."""
    if not renumber:
        return k, pos
    d = end - start
    moved = pos >= end  # [B, N]
    if not bool(moved.any()):
        return k, pos
    delta = torch.where(moved, torch.full_like(pos, -d), torch.zeros_like(pos))  # [B, N]
    # A zero delta leaves a row bit-identical (kv_format.rerotate_rows), so rotate all in one go.
    return rerotate_rows(k, delta, inv_f, head_dim), torch.where(moved, pos - d, pos)


def _compact_growing(layer: GrowingLayerCache, keep: torch.Tensor):
    """Gather each row's kept slots to the front (arrival order kept); ``keep [B, len]``.

    Returns the compacted ``(k, v, pos)`` of the new length; rows with fewer kept slots are
    padded with empty slots (pos -1).
    """
    n = layer.len
    B, H, W = layer.B, layer.H, layer.W
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # [B, n], kept first
    new_len = int(keep.sum(dim=1).max().item()) if n else 0
    order = order[:, :new_len]
    idx = order[:, None, :, None].expand(B, H, new_len, W)  # [B, H, new_len, W]
    k = torch.gather(layer.k[:, :, :n], 2, idx)
    v = torch.gather(layer.v[:, :, :n], 2, idx)
    pos = torch.gather(layer.pos[:, :n], 1, order)
    pos = torch.where(torch.gather(keep, 1, order), pos, torch.full_like(pos, -1))
    return k, v, pos


def _store_growing(layer: GrowingLayerCache, k, v, pos) -> None:
    n_old, n = layer.len, k.shape[2]
    layer.k[:, :, :n] = k
    layer.v[:, :, :n] = v
    layer.pos[:, :n] = pos
    layer.pos[:, n:n_old] = -1
    layer.k[:, :, n:n_old] = 0
    layer.v[:, :, n:n_old] = 0
    layer.len = n


def _evict_growing(layer: GrowingLayerCache, start: int, end: int, inv_f, renumber: bool) -> None:
    p = layer.pos[:, : layer.len]
    keep = ~((p >= start) & (p < end))  # [B, len]
    k, v, pos = _compact_growing(layer, keep)
    k, pos = _renumbered(k, pos, start, end, inv_f, renumber, layer.D)
    _store_growing(layer, k, v, pos)


def _evict_ring(layer: RingLayerCache, start: int, end: int, inv_f, renumber: bool) -> None:
    k, v, pos = layer.view()
    drop = (pos >= start) & (pos < end)
    pos = torch.where(drop, torch.full_like(pos, -1), pos)
    k, pos = _renumbered(k.clone(), pos, start, end, inv_f, renumber, layer.D)
    # Renumbering changes slots (a slot is a function of the position): place again.
    layer.replace_contents(k, v.clone(), pos)


_EVICTORS = {GrowingLayerCache: _evict_growing, RingLayerCache: _evict_ring}


def evict(cache: KVCache, start: int, end: int,
          model_or_inv_freqs: Union[torch.nn.Module, Sequence[torch.Tensor]],
          renumber: bool = True) -> KVCache:
    """Remove absolute positions ``[start, end)`` from every layer of ``cache``.

    Args:
        cache: a KVCache (growing and/or ring layers); every stream must hold ``end - 1``.
        start, end: the span, ``0 <= start < end <= min(next_pos)``.
        model_or_inv_freqs: the Transformer (each layer's ``self_attn.inv_freq``) or a list
            of per-layer inv_freq tensors.
        renumber: shift later positions down by ``end - start`` (re-rotating their keys) and
            lower ``cache.next_pos`` to match; False leaves a gap in the positions.
    Returns:
        ``cache`` (changed in place). Bad input raises LongattnError and changes nothing.

    Ring layers drop whatever part of the span they still hold. A ring with sinks refuses a
    span that starts inside the sinks once it no longer holds the tokens that would take
    their place.
    """
    _validate_span(cache, start, end)
    if hasattr(model_or_inv_freqs, "model"):
        refuse_length_dependent_rope(model_or_inv_freqs.model.layers, "evict with renumbering")
    fs = layer_inv_freqs(model_or_inv_freqs, len(cache.layers))
    for layer, inv_f in zip(cache.layers, fs):
        _EVICTORS[type(layer)](layer, start, end, inv_f, renumber)
    if renumber:
        cache.next_pos = cache.next_pos - (end - start)
    return cache


def trim_to_window(cache: KVCache, policy, slack: int = 0) -> KVCache:
    """Drop growing-cache slots no future query can read; positions are not renumbered.

    For each growing layer whose policy has a window W (and S sinks), keep per stream the
    sinks (positions ``< S``) and the last ``W + slack`` positions (``>= next_pos - W - slack``);
    the next query at ``next_pos`` reads back to ``next_pos - W + 1``, so decoding on goes on
    reading exactly what it read before. Empty (padding) slots are dropped too. Afterwards
    each such layer holds at most ``W + S + slack`` slots (``<= max window + sinks + slack``).
    Global layers and ring layers are left alone.
    """
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise LongattnError(f"trim slack must be a non-negative integer, got {slack!r}")
    if len(policy.layers) != len(cache.layers):
        raise LongattnError(f"policy has {len(policy.layers)} layers; the cache has {len(cache.layers)}")
    nxt = cache.next_pos[:, None]  # [B, 1]
    for layer, lp in zip(cache.layers, policy.layers):
        if type(layer) is not GrowingLayerCache or not lp.window or lp.kind != "window":
            continue
        p = layer.pos[:, : layer.len]
        keep = (p >= 0) & ((p < lp.sinks) | (p >= nxt - lp.window - slack))  # [B, len]
        if bool(keep.all()):
            continue
        _store_growing(layer, *_compact_growing(layer, keep))
    return cache
