"""The q8_0 packing of clustered key/value rows, and ``make_store``, which picks a packing
(the cluster-contiguous layout every packing shares is ``store.py``'s; the f16/f32 packings are
experimental, ``experimental/float_store.py``).

q8_0 (as in ggml): each row is cut into blocks of ``qblock`` (32, or gcd(D, 32) when D is not a
multiple of 32) values; a block stores one float scale ``s = amax / 127`` and int8 values
``round(x / s)``, so ``|x - s * i| <= s / 2`` per element. Scores use the query quantized by blocks
once per call, to 12-bit integers (``s = amax / 2047``, 16x finer than int8: the native scorer
widens keys to int16 lanes anyway, so the finer query costs nothing there):
``q.k ~= sum_b sq_b * sk_b * (iq_b . ik_b)``. The integer block dots are run as float32 matmuls,
which is exact here: ``|iq_b . ik_b| <= qblock * 2047 * 127 < 2**24`` (and fits int32 natively).

q8_0 keys are stored relative to their cluster's centre ``c`` (the index passes the centroid of
the cluster's members): the packed row is ``q8(k - c)`` and a score is ``q.c + q8dot(q, k - c)``,
the first term in float32 with the unquantized query. The residuals ``k - c`` are far smaller
than the keys where keys share a large common part (such as Qwen2.5's key biases), and a
block's rounding step is its own amax / 127.
"""

from __future__ import annotations

import math

import torch

from ..errors import LongattnError
from .experimental.float_store import FloatStore
from .store import PackedStore

Q8_MAX = 127.0
QUERY_MAX = 2047.0  # 12-bit query blocks: block dots with int8 keys stay below 2**24 (see above)


def q8_block(head_dim: int) -> int:
    """Values per q8_0 block: 32, or gcd(head_dim, 32) (>= 8 since head_dim % 8 == 0)."""
    return math.gcd(head_dim, 32)


def quantize_q8(x: torch.Tensor, qblock: int, qmax: float = Q8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric integers per block (int8 at the default ``qmax`` 127).

    Args:
        x: float ``[..., D]`` with ``D % qblock == 0``.
        qmax: largest integer magnitude (127: q8_0; ``QUERY_MAX``: the queries' 12-bit ints).
    Returns:
        ``(ints, scales)``: int8 (int16 when ``qmax`` > 127) ``[..., D]`` and float32
        ``[..., D // qblock]``; ``x ~= ints * scales`` block-wise with ``|error| <= scale / 2``
        per element.
    """
    *lead, D = x.shape
    xb = x.float().reshape(*lead, D // qblock, qblock)  # [..., nb, qblock]
    scale = xb.abs().amax(-1) / qmax  # [..., nb]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    ints = torch.round(xb / safe.unsqueeze(-1)).clamp_(-qmax, qmax)
    return ints.to(torch.int8 if qmax <= Q8_MAX else torch.int16).reshape(*lead, D), scale


def quantize_query(q: torch.Tensor, qblock: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A query's block quantization for scoring: ``quantize_q8`` with 12-bit ints (int16)."""
    return quantize_q8(q, qblock, QUERY_MAX)


def dequantize_q8(ints: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_q8``: ``[..., D]`` int8 and ``[..., nb]`` scales -> float32."""
    *lead, D = ints.shape
    nb = scales.shape[-1]
    x = ints.float().reshape(*lead, nb, D // nb) * scales.unsqueeze(-1)
    return x.reshape(*lead, D)


def q8_dot(q: torch.Tensor, k: torch.Tensor, qblock: int) -> torch.Tensor:
    """The dot product used for scoring, 12-bit query blocks x q8_0 key blocks:
    ``[..., D] x [..., D] -> [...]``."""
    qi, qs = quantize_query(q, qblock)
    ki, ks = quantize_q8(k, qblock)
    nb = qs.shape[-1]
    dots = (qi.float().unflatten(-1, (nb, qblock)) * ki.float().unflatten(-1, (nb, qblock))).sum(-1)
    return (dots * qs * ks).sum(-1)


def q8_dot_bound(q: torch.Tensor, k: torch.Tensor, qblock: int) -> torch.Tensor:
    """Bound on ``|q.k - q8_dot(q, k)|`` from the quantization steps (broadcasting ``[..., D]``).

    With ``q = q^ + eq`` and ``k = k^ + ek`` (``|eq| <= sq/2``, ``|ek| <= sk/2`` per element),
    ``q.k - q^.k^ = q.ek + eq.k^``, so per block the error is at most
    ``||q_b||_1 * sk_b / 2 + sq_b / 2 * ||k^_b||_1``; the bound is the sum over blocks.
    """
    qi, qs = quantize_query(q, qblock)
    ki, ks = quantize_q8(k, qblock)
    nb = qs.shape[-1]
    q_l1 = q.float().abs().unflatten(-1, (nb, qblock)).sum(-1)  # [..., nb]
    khat_l1 = ki.float().abs().unflatten(-1, (nb, qblock)).sum(-1) * ks
    return (q_l1 * ks / 2 + qs / 2 * khat_l1).sum(-1)


class Q8Store(PackedStore):
    """q8_0 rows: int8 values with one float32 scale per block of ``qblock`` values; keys relative
    to their cluster's centre ``kc`` ``[Hkv, C, D]`` (see the module docstring).

    Keys are stored in the native scorer's layout, ``kt`` ``[Hkv, C, T, D/2, 8, 2]``: each
    cluster's rows in tiles of 8 (``T = ceil(cluster_size / 8)``, zero padded) with dimensions
    ``(2p, 2p+1)`` of the tile's 8 rows side by side, so one 16-byte read feeds eight rows' dot
    products (ops/csrc/scsa_decode.cpp). ``ki`` gives the row-major form ``[Hkv, C, cs, D]`` (a
    copy); the PyTorch path un-tiles only the clusters it gathers.
    """

    name = "q8_0"
    TILE = 8

    def __init__(self, num_kv_heads: int, cluster_size: int, head_dim: int):
        super().__init__(num_kv_heads, cluster_size, head_dim)
        self.qblock = q8_block(head_dim)
        self.nb = head_dim // self.qblock
        self.tiles = -(-cluster_size // self.TILE)
        self.block_eye = torch.eye(self.nb).repeat_interleave(self.qblock, dim=1)  # [nb, D]
        self._alloc()

    def _fields(self):
        return ("kt", "ks", "vi", "vs", "kc")

    def _empty(self, name, clusters):
        if name == "kc":
            return torch.zeros(self.hkv, clusters, self.d)
        if name == "kt":
            return torch.zeros(self.hkv, clusters, self.tiles, self.d // 2, self.TILE, 2, dtype=torch.int8)
        if name == "vi":
            return torch.zeros(self.hkv, clusters, self.cs, self.d, dtype=torch.int8)
        return torch.zeros(self.hkv, clusters, self.cs, self.nb, dtype=torch.float32)

    def _tile(self, ints: torch.Tensor) -> torch.Tensor:
        """Row-major int8 ``[..., cs, D]`` -> tiled ``[..., T, D/2, 8, 2]``."""
        *lead, cs, D = ints.shape
        pad = self.tiles * self.TILE - cs
        if pad:
            ints = torch.cat([ints, ints.new_zeros(*lead, pad, D)], dim=-2)
        t = ints.reshape(*lead, self.tiles, self.TILE, D // 2, 2)
        return t.transpose(-3, -2)

    def _untile(self, tiled: torch.Tensor) -> torch.Tensor:
        """Inverse of ``_tile``: ``[..., T, D/2, 8, 2]`` -> ``[..., cs, D]`` (a copy)."""
        *lead, T, half, tile, two = tiled.shape
        rows = tiled.transpose(-3, -2).reshape(*lead, T * tile, half * two)
        return rows[..., :self.cs, :]

    @property
    def ki(self) -> torch.Tensor:
        """Row-major keys ``[Hkv, C, cs, D]`` int8 (a copy of ``kt``'s contents)."""
        return self._untile(self.kt)

    def write(self, c0, keys, values, centers=None):
        C = keys.shape[1]
        self.ensure(c0 + C)
        self.kc[:, c0:c0 + C] = 0.0 if centers is None else centers
        if centers is not None:
            keys = keys - centers.unsqueeze(2)  # padding rows too: the index masks them anyway
        ki, self.ks[:, c0:c0 + C] = quantize_q8(keys, self.qblock)
        self.kt[:, c0:c0 + C] = self._tile(ki)
        self.vi[:, c0:c0 + C], self.vs[:, c0:c0 + C] = quantize_q8(values, self.qblock)

    def prepare_query(self, qg):
        """Quantize once; lay the int blocks out block-diagonally so one bmm gives all block dots.

        Returns ``(qbd_t, qs, qg)``: float ``[Hkv, D, g * nb]`` whose column ``(j, b)`` holds head
        j's int block b in rows ``b*qblock:(b+1)*qblock`` (zeros elsewhere), scales
        ``[Hkv, 1, g, nb]``, and the float query (for the centre terms ``q.c``).
        """
        hkv, g, D = qg.shape
        qi, qs = quantize_query(qg, self.qblock)  # [Hkv, g, D], [Hkv, g, nb]
        qbd = qi.float().unsqueeze(2) * self.block_eye  # [Hkv, g, nb, D]
        return qbd.reshape(hkv, g * self.nb, D).transpose(1, 2), qs.unsqueeze(1), qg

    def _gather_keys(self, idx: torch.Tensor, h0: int) -> torch.Tensor:
        """Row-major int8 keys of the given clusters, ``[h, K * cs, D]``."""
        flat = self._flat(idx, h0)
        tiles = self.kt.reshape(self.hkv * self.capacity, *self.kt.shape[2:]).index_select(0, flat)
        return self._untile(tiles).reshape(idx.shape[0], -1, self.d)

    def scores(self, qprep, idx, h0=0):
        qbd_t, qs, qg = qprep
        hh, K = idx.shape
        ki = self._gather_keys(idx, h0).float()  # [h, R, D] exact small ints
        ks = self._gather(self.ks, idx, h0)  # [h, R, nb]
        dots = torch.bmm(ki, qbd_t)  # [h, R, g*nb]: exact integer block dots
        dots = dots.view(hh, dots.shape[1], -1, self.nb)  # [h, R, g, nb]
        resid = (dots * ks.unsqueeze(2) * qs).sum(-1).transpose(1, 2)  # [h, g, R]
        centers = self.kc.reshape(self.hkv * self.capacity, self.d).index_select(0, self._flat(idx, h0))
        qc = torch.bmm(qg, centers.view(hh, K, self.d).transpose(1, 2))  # [h, g, K]: q.c per cluster
        return (resid.view(hh, -1, K, self.cs) + qc.unsqueeze(-1)).view(hh, -1, K * self.cs)

    def values(self, idx, h0=0):
        vi = self._gather(self.vi, idx, h0).float()  # [h, R, D]
        vs = self._gather(self.vs, idx, h0)  # [h, R, nb]
        return (vi.unflatten(-1, (self.nb, self.qblock)) * vs.unsqueeze(-1)).flatten(-2)

    def query_view(self, qg):
        qi, qs = quantize_query(qg, self.qblock)
        return dequantize_q8(qi, qs)

    def key_center(self, h, c):
        return self.kc[h, c].double()

    def cluster_rows(self, h, c):
        k = dequantize_q8(self._untile(self.kt[h, c]), self.ks[h, c]).double()
        v = dequantize_q8(self.vi[h, c], self.vs[h, c]).double()
        return k, v


def make_store(packing: str, num_kv_heads: int, cluster_size: int, head_dim: int) -> PackedStore:
    """The store for a packing name ("q8_0", "f16", "f32")."""
    if packing == "q8_0":
        return Q8Store(num_kv_heads, cluster_size, head_dim)
    if packing == "f16":
        return FloatStore(num_kv_heads, cluster_size, head_dim, torch.float16)
    if packing == "f32":
        return FloatStore(num_kv_heads, cluster_size, head_dim, torch.float32)
    raise LongattnError(f"unknown packing {packing!r}; use q8_0, f16 or f32")
