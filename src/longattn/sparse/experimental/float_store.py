"""The f16 and f32 packings (``SCSAConfig.packing``): rows kept as floats, scored by float32
matmuls on the PyTorch path (the native kernel reads q8_0 only). f32 is the diagnostic packing
with which tau = 0 equals dense to floating-point rounding.
"""

from __future__ import annotations

import torch

from ..store import PackedStore


class FloatStore(PackedStore):
    """f16 or f32 rows; scores are float32 matmuls of the upcast rows."""

    def __init__(self, num_kv_heads: int, cluster_size: int, head_dim: int, dtype: torch.dtype):
        super().__init__(num_kv_heads, cluster_size, head_dim)
        self.dtype = dtype
        self.name = {torch.float16: "f16", torch.float32: "f32"}[dtype]
        self._alloc()

    def _fields(self):
        return ("k", "v")

    def _empty(self, name, clusters):
        return torch.zeros(self.hkv, clusters, self.cs, self.d, dtype=self.dtype)

    def write(self, c0, keys, values, centers=None):
        C = keys.shape[1]
        self.ensure(c0 + C)
        self.k[:, c0:c0 + C] = keys.to(self.dtype)  # the keys themselves: rounding is relative here
        self.v[:, c0:c0 + C] = values.to(self.dtype)

    def scores(self, qprep, idx, h0=0):
        kr = self._gather(self.k, idx, h0).float()  # [h, R, D]
        return torch.bmm(qprep, kr.transpose(1, 2))  # [h, g, R]

    def values(self, idx, h0=0):
        return self._gather(self.v, idx, h0).float()  # [h, R, D]

    def cluster_rows(self, h, c):
        return self.k[h, c].double(), self.v[h, c].double()
