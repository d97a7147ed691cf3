"""Packed copies of clustered key/value rows, contiguous per cluster: the layout and the read
interface every packing shares (``packing.py``'s q8_0, ``experimental/float_store.py``'s f16/f32).

Layout (every packing): cluster ``c`` of KV head ``h`` owns ``[h, c, 0:cluster_size]`` of a
``[Hkv, capacity, cluster_size, D]`` array, so opening a cluster is one contiguous read and a set
of opened clusters is one ``index_select`` (adjacent clusters are adjacent in memory). Rows past a
cluster's count are zero padding; the index masks them with ``-inf``.
"""

from __future__ import annotations

import torch


def _grow(t: torch.Tensor, capacity: int, dim: int = 1) -> torch.Tensor:
    """A copy of ``t`` with ``dim`` enlarged to ``capacity`` (new entries zero)."""
    shape = list(t.shape)
    shape[dim] = capacity
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


class PackedStore:
    """Cluster-contiguous member rows of one batch row's index, all KV heads.

    Subclasses decide the number format. Shapes: ``keys``/``values`` written as float
    ``[Hkv, C, cluster_size, D]`` (zero padded); ``idx`` is ``[Hkv, K]`` cluster ids per head.
    """

    name = ""

    def __init__(self, num_kv_heads: int, cluster_size: int, head_dim: int) -> None:
        self.hkv, self.cs, self.d = num_kv_heads, cluster_size, head_dim
        self.capacity = 0

    # --- storage -------------------------------------------------------------------------
    def ensure(self, clusters: int) -> None:
        """Make room for ``clusters`` clusters per head (capacity doubles, amortised O(1))."""
        if clusters <= self.capacity:
            return
        cap = max(clusters, 2 * self.capacity, 8)
        for name in self._fields():
            setattr(self, name, _grow(getattr(self, name), cap))
        self.capacity = cap

    def _alloc(self) -> None:
        for name in self._fields():
            setattr(self, name, self._empty(name, 0))

    def write(self, c0: int, keys: torch.Tensor, values: torch.Tensor,
              centers: torch.Tensor | None = None) -> None:
        """Store clusters ``c0 .. c0 + C`` from float ``[Hkv, C, cluster_size, D]`` rows.

        ``centers`` ``[Hkv, C, D]``: each cluster's key centre (stores that quantize keep their
        keys relative to it; ``None``: zero).
        """
        raise NotImplementedError

    def _fields(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _empty(self, name: str, clusters: int) -> torch.Tensor:
        raise NotImplementedError

    def _flat(self, idx: torch.Tensor, h0: int) -> torch.Tensor:
        """``[h, K]`` cluster ids of heads ``h0 .. h0 + h`` -> ``[h * K]`` ids into the flattened heads."""
        base = torch.arange(h0, h0 + idx.shape[0]).mul_(self.capacity).unsqueeze(1)  # [h, 1]
        return (idx + base).reshape(-1)

    def _gather(self, t: torch.Tensor, idx: torch.Tensor, h0: int) -> torch.Tensor:
        """Rows of the given clusters, ``[h, K * cluster_size, last]``."""
        flat = self._flat(idx, h0)
        rows = t.reshape(self.hkv * self.capacity, self.cs, t.shape[-1]).index_select(0, flat)
        return rows.view(idx.shape[0], -1, t.shape[-1])

    # --- reads ---------------------------------------------------------------------------
    def prepare_query(self, qg: torch.Tensor):
        """Per-call query preparation; ``qg`` is float32 ``[Hkv, g, D]``."""
        return qg

    def key_center(self, h: int, c: int) -> torch.Tensor:
        """The centre cluster ``c``'s stored keys are relative to, float64 ``[D]`` (zero when the
        store keeps the keys themselves)."""
        return torch.zeros(self.d, dtype=torch.float64)

    def scores(self, qprep, idx: torch.Tensor, h0: int = 0) -> torch.Tensor:
        """Raw dots (no scale) of the queries with the opened clusters' rows: ``[h, g, K * cs]``.

        ``idx`` ``[h, K]`` holds cluster ids of KV heads ``h0 .. h0 + h`` (``qprep`` sliced alike).
        """
        raise NotImplementedError

    def values(self, idx: torch.Tensor, h0: int = 0) -> torch.Tensor:
        """Opened clusters' value rows as float32 ``[h, K * cs, D]``."""
        raise NotImplementedError

    def query_view(self, qg: torch.Tensor) -> torch.Tensor:
        """The query exactly as scoring sees it (dequantized for q8), float ``[Hkv, g, D]``."""
        return qg

    def cluster_rows(self, h: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored (dequantized) keys relative to ``key_center(h, c)`` and values of one cluster,
        float64 ``[cs, D]`` each."""
        raise NotImplementedError
