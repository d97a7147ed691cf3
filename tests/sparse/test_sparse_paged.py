"""SCSA over one stream of a paged pool read in place (sparse/paged.py, SCSALayer.attend_paged).

The served form must be the same operator as the one ``generate`` runs over a contiguous cache:
every call over a stream's blocks, scattered through a pool of any format, equals
``SCSALayer.attend`` over the gathered stream bit for bit, through calibration, rebuilds and a
history rewritten below the sealed region (a reused prefix cut back), with the same counters.
"""

from __future__ import annotations

import pytest
import torch

from longattn.cache.kv_format import encode
from longattn.cache.paged import BlockPool
from longattn.ops import native
from longattn.ops.attention import PagedRows
from longattn.sparse.layer import SCSALayer
from longattn.sparse.paged import StreamRows
from sparse_fixtures import assert_same_index, decode_run, small_cfg

H, HKV, D, BS = 4, 2, 64, 16


class ScatteredStream:
    """One stream's rows in a pool whose blocks are handed out in a shuffled order."""

    def __init__(self, dtype, blocks: int = 80, seed: int = 0):
        self.pool = BlockPool(blocks, BS, HKV, D, dtype)
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pool._free = order
        self.table: list = []
        self.dtype = dtype

    def write(self, k, v, lo: int) -> None:
        """Store slots ``lo ..`` of ``k, v [1, Hkv, N, D]`` (float32 values)."""
        n = k.shape[2]
        while len(self.table) * BS < n:
            self.table.append(self.pool.alloc())
        slots = torch.tensor([self.table[p // BS] * BS + p % BS for p in range(lo, n)], dtype=torch.int64)
        self.pool.k[:, slots] = encode(k[0, :, lo:], self.dtype)
        self.pool.v[:, slots] = encode(v[0, :, lo:], self.dtype)

    def rows(self, n: int):
        table = torch.tensor([self.table[:-(-n // BS)]], dtype=torch.int64)
        return (PagedRows(self.pool.k.unsqueeze(0), table, BS, n), PagedRows(self.pool.v.unsqueeze(0), table, BS, n))


def _run(paged: SCSALayer, whole: SCSALayer, stream: ScatteredStream, steps):
    """Each step through both layers: the same output, bit for bit, and the same counters."""
    written = 0
    for q, k, v in steps:
        stream.write(k, v, written)
        written = k.shape[2]
        pk, pv = stream.rows(written)
        got = paged.attend_paged(q, pk, pv, D ** -0.5)
        want = whole.attend(q, pk.gather(), pv.gather(), D ** -0.5)
        assert torch.equal(got, want)
    assert paged.counters == whole.counters


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("calib_steps,outliers", [(0, 0), (3, 2)])
def test_scsa_over_a_scattered_paged_stream_equals_scsa_over_the_gathered_cache(dtype, calib_steps, outliers):
    cfg = small_cfg(calib_steps=calib_steps, outliers=outliers)
    paged, whole = SCSALayer(cfg, H, HKV, D), SCSALayer(cfg, H, HKV, D)
    stream = ScatteredStream(dtype, seed=1)
    # 560 -> 720 tokens: rebuilds at every 64, a block of 256 frozen and a new one started
    _run(paged, whole, stream, decode_run(560, 160, H, HKV, D, seed=3, query_seed=4))
    assert paged.counters["opened_rows"] > 0 and paged.counters["rebuilds"] >= 2
    assert_same_index(paged.indexes[0], whole.indexes[0])


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
def test_a_history_rewritten_below_the_sealed_region_replans_the_index_as_the_contiguous_path_does():
    """A reused stream cut back below its sealed region and continued with other rows: its
    fingerprint no longer matches and the index is built again, as over a contiguous cache."""
    cfg = small_cfg(outliers=2)
    paged, whole = SCSALayer(cfg, H, HKV, D), SCSALayer(cfg, H, HKV, D)
    stream = ScatteredStream(torch.bfloat16, seed=2)
    first = decode_run(600, 8, H, HKV, D, seed=5, query_seed=6)
    _run(paged, whole, stream, first)
    cut = paged.indexes[0].seal_end - 40
    k1, v1 = first[-1][1][:, :, :cut], first[-1][2][:, :, :cut]
    written = cut  # slots from cut on are written again with the other run's rows
    for q, k, v in decode_run(640, 8, H, HKV, D, seed=7, query_seed=8):
        k, v = torch.cat([k1, k[:, :, cut:]], 2), torch.cat([v1, v[:, :, cut:]], 2)
        stream.write(k, v, written)
        written = k.shape[2]
        pk, pv = stream.rows(written)
        assert torch.equal(paged.attend_paged(q, pk, pv, D ** -0.5), whole.attend(q, pk.gather(), pv.gather(), D ** -0.5))
    assert paged.counters == whole.counters
    assert_same_index(paged.indexes[0], whole.indexes[0])


def test_stream_rows_read_what_the_gathered_stream_holds():
    stream = ScatteredStream(torch.int8, seed=4)
    _, k, v = decode_run(300, 1, H, HKV, D, seed=1, query_seed=1)[0]
    stream.write(k, v, 0)
    pk, _ = stream.rows(301)
    whole, rows = pk.gather()[0], StreamRows(pk)
    assert rows.shape == whole.shape and rows.dtype == whole.dtype
    assert torch.equal(rows[:, 17:250], whole[:, 17:250]) and torch.equal(rows[:, 299], whole[:, 299])
    assert torch.equal(rows.select(-2, 5), whole.select(-2, 5))
    idx = torch.tensor([[3, 90, 211], [0, 17, 300]]).unsqueeze(-1).expand(-1, -1, whole.shape[-1])
    assert torch.equal(rows.gather(1, idx), whole.gather(1, idx))
    assert StreamRows(pk, length=100).shape[1] == 100
