"""SCSAConfig.outliers: each cluster's members farthest from its centroid are taken out when its
block is built and attended exactly on every call. Here: the split is a partition, the outliers
are the farthest members, the summaries describe the members that stay, and a planted far key is
read exactly. (tau = 0 == dense, accounting, incremental == from scratch, native == PyTorch ==
serial with outliers are parametrized into those modules' tests.)"""

import pytest
import torch

from longattn.sparse import SCSALayer
from longattn.sparse.clustering import cluster_block, outlier_counts, summarize
from sparse_fixtures import attn_case, small_cfg

HKV, D = 2, 32


def block(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)


@pytest.mark.parametrize("n, cs, o", [(200, 16, 3), (200, 16, 8), (37, 16, 5), (50, 24, 0)])
def test_members_and_outliers_partition_the_block(n, cs, o):
    k, v = block(n)
    perm0, _, _, _, _ = cluster_block(k, v, cs, 2, 4, 0)
    perm, s, k_rows, v_rows, out_perm = cluster_block(k, v, cs, 2, 4, o)
    sizes = (perm0 >= 0).sum(-1)[0]  # [C] members before taking outliers out
    assert torch.equal(s.counts, sizes - outlier_counts(sizes, o))
    assert torch.equal((out_perm >= 0).sum(-1), outlier_counts(sizes, o).expand(HKV, -1))
    for h in range(HKV):
        rows = torch.cat([perm[h][perm[h] >= 0], out_perm[h][out_perm[h] >= 0]])
        assert torch.equal(rows.sort().values, torch.arange(n))  # every row once, members or outlier
        for c in range(perm.shape[1]):
            # the members keep their split order (outliers cut out of the same cluster)
            before = perm0[h, c][perm0[h, c] >= 0]
            kept = perm[h, c][perm[h, c] >= 0]
            assert torch.equal(kept, before[torch.isin(before, kept)])
            assert bool(torch.isin(out_perm[h, c][out_perm[h, c] >= 0], before).all())
    if o == 0:
        assert torch.equal(perm, perm0) and out_perm.shape[-1] == 0


def test_outliers_are_the_farthest_from_the_whole_cluster_centroid():
    k, v = block(300, seed=1)
    perm0, _, _, _, _ = cluster_block(k, v, 16, 2, 4, 0)
    perm, s, k_rows, v_rows, out_perm = cluster_block(k, v, 16, 2, 4, 4)
    for h in range(HKV):
        for c in range(perm.shape[1]):
            members = perm0[h, c][perm0[h, c] >= 0]
            centroid = k[h, members].mean(0)
            outs = out_perm[h, c][out_perm[h, c] >= 0]
            kept = perm[h, c][perm[h, c] >= 0]
            far = (k[h, outs] - centroid).norm(dim=-1)
            near = (k[h, kept] - centroid).norm(dim=-1)
            assert far.min() >= near.max()


def test_summaries_and_rows_describe_the_kept_members():
    k, v = block(200, seed=2)
    perm, s, k_rows, v_rows, _ = cluster_block(k, v, 16, 2, 4, 3)
    valid = perm >= 0
    for h in range(HKV):
        assert torch.equal(k_rows[h][valid[h]], k[h, perm[h][valid[h]]])
        assert torch.equal(v_rows[h][valid[h]], v[h, perm[h][valid[h]]])
    assert not bool(k_rows[~valid].any()) and not bool(v_rows[~valid].any())  # outliers and padding zeroed
    ref = summarize(k_rows, v_rows, s.counts, 2, 4)
    for name in ("centroid", "vmean", "eigval", "resid", "radius"):
        assert torch.equal(getattr(s, name), getattr(ref, name)), name
    kept_mean = torch.stack([torch.stack([k[h, perm[h, c][perm[h, c] >= 0]].mean(0) for c in range(perm.shape[1])])
                             for h in range(HKV)])
    assert torch.allclose(s.centroid, kept_mean, rtol=0, atol=1e-5)


def test_a_setting_above_half_a_cluster_is_capped():
    """outliers > cluster_size // 2 takes half of each cluster (not an error: the default 8 must
    work with small clusters too)."""
    H, n = 4, 700
    q, k, v, scale = attn_case(n, H, HKV, D, seed=4)
    layer = SCSALayer(small_cfg(tau_default=0.05, outliers=40), H, HKV, D)
    big = layer.attend(q, k, v, scale)
    half = SCSALayer(small_cfg(tau_default=0.05, outliers=8), H, HKV, D)  # cluster_size 16
    assert torch.equal(big, half.attend(q, k, v, scale))
    index = layer.indexes[0]
    assert torch.equal(index.extra_slots, half.indexes[0].extra_slots) and index.out_slots.shape[-1] == 8
    (acc,) = layer.debug_accounting()
    assert torch.equal(acc["coverage"], torch.ones_like(acc["coverage"]))


def test_a_planted_far_key_is_read_exactly():
    """A key far from everything (and aligned with the query) sits in some cluster; with one
    outlier per cluster it leaves its cluster and is attended exactly on every call, at any tau."""
    H, n = 4, 900
    q, k, v, scale = attn_case(n, H, HKV, D, seed=3)
    slot = 300  # sealed (sink 4, recent 8, rebuild 64)
    k = k.clone()
    k[0, :, slot] = 25 * q[0, ::H // HKV, 0] / q[0, ::H // HKV, 0].norm(dim=-1, keepdim=True)
    for tau in (0.0, 0.3, 1.0):
        layer = SCSALayer(small_cfg(tau_default=tau, outliers=1), H, HKV, D)
        layer.attend(q, k, v, scale)
        index = layer.indexes[0]
        assert bool((index.extra_slots == slot).any(1).all())
        (acc,) = layer.debug_accounting()
        assert bool((acc["role"][:, slot] == 0).all())
        assert torch.equal(acc["coverage"], torch.ones_like(acc["coverage"]))
        assert torch.equal(acc["exact_rows"], torch.full((HKV,), 4 + index.extra_slots.shape[1] + n - index.seal_end))
        assert layer.counters["outlier_rows"] == HKV * index.extra_slots.shape[1] > 0
    # without outliers the same key stays in its cluster (opened or in its tail, never exact)
    layer = SCSALayer(small_cfg(tau_default=0.3), H, HKV, D)
    layer.attend(q, k, v, scale)
    (acc,) = layer.debug_accounting()
    assert bool((acc["role"][:, slot] > 0).all()) and layer.indexes[0].extra_slots.shape[1] == 0
