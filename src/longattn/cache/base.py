"""The cache interface the model talks to, and the plain growing cache.

``KVCache.update(layer, k, v, pos)`` stores this step's keys/values and returns a ``KVView``:
what the layer's attention op may read. The model hands the view to the op and never knows
which layer cache it talks to; the mask built from positions does the rest.

A new layer cache is one class with ``update`` / ``nbytes`` / ``positions`` plus a
``register_layer_cache`` entry.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..ops.attention import MaskMemo
from .kv_format import encode, key_rotation, row_width


class KVView(NamedTuple):
    """What one layer's attention op reads after ``KVCache.update``.

    k, v: ``[B, Hkv, S, D]`` slots (or ``ops.attention.PagedRows``: a paged pool read in place).
    positions: ``[B, S]`` int64 absolute position of each slot (negative = empty, never read).
    new_k, new_v: ``[B, Hkv, T, D]`` this call's keys and values. The growing, ring and paged
        caches have stored them in ``k, v`` already; the static step's buffers have not (it
        writes them after the step), and its ops read them from here.
    state: the layer's per-stream runtime state, owned by the cache so that it lives and dies
        with the streams (an op keeps e.g. SCSA's index and calibrated taus here under a key of
        its own); None when no cache holds the keys (a one-shot forward), where an op keeps none.
    masks: an ``ops.attention.MaskMemo`` shared by the layers of one cache (or of one forward
        without a cache), so layers with the same window build their mask once.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    state: Optional[dict] = None
    masks: Optional[object] = None

    @property
    def cached(self) -> bool:
        """True when a cache holds these keys for the stream's next calls."""
        return self.state is not None

    @classmethod
    def uncached(cls, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, masks=None) -> "KVView":
        """The view of a forward without a cache: the call's own keys, no state kept."""
        return cls(k, v, pos, k, v, None, masks)


class LayerCache:
    """One layer's K/V storage. Subclasses implement ``update``, ``nbytes`` and ``positions``."""

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Store ``k, v [B, Hkv, T, D]`` at positions ``pos [B, T]``; return (k_all, v_all, k_pos)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of the tensors this layer holds (allocated storage, not just filled slots)."""
        raise NotImplementedError

    def positions(self) -> torch.Tensor:
        """``[B, S]`` absolute positions of the slots that are readable (-1 = empty)."""
        raise NotImplementedError

    def tokens(self) -> int:
        """Number of filled slots (max over the batch)."""
        return int((self.positions() >= 0).sum(dim=1).max().item()) if self.positions().numel() else 0


class GrowingLayerCache(LayerCache):
    """Append-only cache; capacity doubles so appends are amortised O(1).

    Slots hold tokens in arrival order; padding tokens (pos < 0) occupy a slot but are
    never read. ``view`` returns the filled prefix. ``dtype`` is the storage format
    (cache/kv_format.py): a slot holds ``row_width(dtype, head_dim)`` elements, rows as stored.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 initial: int = 256, exact_capacity: bool = False):
        self.B, self.H, self.D, self.dtype = batch, kv_heads, head_dim, dtype
        self.exact_capacity = exact_capacity  # grow to exactly what is needed (byte reports)
        self.len = 0
        self.W = row_width(dtype, head_dim)  # elements of a stored row
        self.k = torch.zeros(batch, kv_heads, initial, self.W, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, initial), -1, dtype=torch.int64)

    def _reserve(self, n: int) -> None:
        cap = self.k.shape[2]
        if n <= cap:
            return
        new = n if self.exact_capacity else max(n, 2 * cap)
        k = torch.zeros(self.B, self.H, new, self.W, dtype=self.dtype)
        v = torch.zeros_like(k)
        p = torch.full((self.B, new), -1, dtype=torch.int64)
        k[:, :, : self.len] = self.k[:, :, : self.len]
        v[:, :, : self.len] = self.v[:, :, : self.len]
        p[:, : self.len] = self.pos[:, : self.len]
        self.k, self.v, self.pos = k, v, p

    def update(self, k, v, pos):
        T = k.shape[2]
        self._reserve(self.len + T)
        s = slice(self.len, self.len + T)
        self.k[:, :, s] = encode(k, self.dtype)
        self.v[:, :, s] = encode(v, self.dtype)
        self.pos[:, s] = pos
        self.len += T
        return self.k[:, :, : self.len], self.v[:, :, : self.len], self.pos[:, : self.len]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def positions(self):
        return self.pos[:, : self.len]

    def view(self):
        return self.k[:, :, : self.len], self.v[:, :, : self.len], self.pos[:, : self.len]

    def truncate(self, n: int) -> None:
        """Forget everything from slot ``n`` on (used for speculative / teacher-forced replays)."""
        n = max(0, min(n, self.len))
        with torch.inference_mode():  # storage may have been (re)allocated inside a forward
            self.pos[:, n: self.len] = -1
        self.len = n


LAYER_CACHES: dict = {"growing": GrowingLayerCache}


def register_layer_cache(kind: str, factory: Callable) -> None:
    LAYER_CACHES[kind] = factory


class KVCache:
    """A model's cache: one LayerCache per layer plus the next position of each stream.

    ``key_rotation``: None, or the ``[D, D]`` orthogonal matrix the attention applies to queries
    and keys before storing and reading (a pool whose format needs it: cache/kv_format.py).

    Args:
        cfg: ModelConfig (layer count, KV heads, head_dim).
        batch: number of streams.
        layers: optional list of LayerCache (e.g. ring caches for windowed layers, built by
            ``longattn.cache.make_cache``); default growing everywhere.
    """

    key_rotation = None

    def __init__(self, cfg, batch: int = 1, layers: Optional[list] = None, dtype=torch.float32):
        self.cfg = cfg
        self.batch = batch
        self.layers = layers if layers is not None else [
            GrowingLayerCache(batch, cfg.num_kv_heads, cfg.head_dim, dtype) for _ in range(cfg.num_layers)]
        self.next_pos = torch.zeros(batch, dtype=torch.int64)
        self.key_rotation = key_rotation(dtype, cfg.head_dim)
        self.op_state = [{} for _ in self.layers]  # per layer: what its attention op keeps (KVView.state)
        self.masks = MaskMemo()

    def update(self, layer: int, k, v, pos) -> KVView:
        """Store ``k, v [B, Hkv, T, D]`` at positions ``pos [B, T]`` in layer ``layer``; return
        what that layer's attention reads."""
        k_all, v_all, k_pos = self.layers[layer].update(k, v, pos)
        return KVView(k_all, v_all, k_pos, k, v, self.op_state[layer], self.masks)

    def advance(self, pos: torch.Tensor) -> None:
        """Record that positions ``pos [B, T]`` have been stored (called once per forward)."""
        self.next_pos = torch.maximum(self.next_pos, pos.max(dim=1).values + 1)

    def next_position(self) -> torch.Tensor:
        """``[B, 1]`` the next absolute position of each stream (broadcasts against arange)."""
        return self.next_pos[:, None]

    def nbytes(self) -> int:
        return sum(l.nbytes() for l in self.layers)

    def layer_bytes(self) -> list:
        return [l.nbytes() for l in self.layers]

    def tokens(self) -> list:
        return [l.tokens() for l in self.layers]
