"""The incremental index equals a from-scratch build over the same keys, across rebuild and
block boundaries; truncated or replaced caches are replanned; batch rows are independent."""

import pytest
import torch

from longattn.sparse import SCSALayer
from sparse_fixtures import assert_same_index, attn_case, small_cfg as _small_cfg

H, HKV, D = 4, 2, 32


def small_cfg(**kw):
    return _small_cfg(**{"tau_default": 0.05, **kw})


@pytest.mark.parametrize("packing, hierarchical, outliers", [("q8_0", False, 0), ("f16", True, 0),
                                                             ("q8_0", False, 4)])
def test_incremental_equals_from_scratch(packing, hierarchical, outliers):
    n_max = 1500
    qs, k_all, v_all, _ = attn_case(n_max, H, HKV, D, seed=11, queries=60, query_seed=3)
    cfg = small_cfg(packing=packing, hierarchical=hierarchical, outliers=outliers)
    grow = SCSALayer(cfg, H, HKV, D)
    gen = torch.Generator().manual_seed(0)
    n, step, frozen_seen = 70, 0, set()
    while n <= n_max:
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        out = grow.attend(qs[step % 60], k, v, D ** -0.5)
        index = grow.indexes[0]
        frozen_seen.add(index.frozen_blocks)
        if step % 5 == 0 or n + 40 > n_max:
            fresh = SCSALayer(cfg, H, HKV, D)
            ref = fresh.attend(qs[step % 60], k, v, D ** -0.5)
            assert_same_index(index, fresh.indexes[0])
            assert torch.equal(index.extra_slots, fresh.indexes[0].extra_slots)
            # the outliers' copies follow every rebuild: the cache's rows at today's slots
            idx = index.extra_slots.unsqueeze(-1).expand(-1, -1, D)
            assert torch.equal(index.extra_k, k[0].gather(1, idx)) and torch.equal(index.extra_v, v[0].gather(1, idx))
            assert torch.equal(out, ref)
        n += int(torch.randint(1, 40, (1,), generator=gen))
        step += 1
    assert frozen_seen >= {0, 1, 2, 3, 4, 5}  # crossed every block boundary
    # One rebuild per rebuild_interval crossed (the first call builds once).
    expected = (grow.indexes[0].seal_end - cfg.sink) // cfg.rebuild_interval
    assert grow.counters["rebuilds"] <= expected
    assert grow.counters["rebuilds"] >= expected // 2


def test_frozen_blocks_are_never_rebuilt():
    q, k, v, _ = attn_case(900, H, HKV, D, seed=2, query_seed=1)
    layer = SCSALayer(small_cfg(), H, HKV, D)
    layer.attend(q, k[:, :, :400], v[:, :, :400], D ** -0.5)
    index = layer.indexes[0]
    assert index.frozen_blocks == 1
    block0 = index.summ[:, :16].clone()
    packed0 = index.store.ki[:, :16].clone()
    calls = []
    original = index._build_block
    index._build_block = lambda c0, lo, k, v: (calls.append(lo), original(c0, lo, k, v))
    layer.attend(q, k, v, D ** -0.5)
    assert calls and min(calls) == 4 + 256  # only block 1 onwards
    assert torch.equal(index.summ[:, :16], block0) and torch.equal(index.store.ki[:, :16], packed0)


def test_truncated_or_replaced_cache_is_replanned():
    q, k0, v0, _ = attn_case(1200, H, HKV, D, seed=4, query_seed=1)
    _, k1, v1, _ = attn_case(1200, H, HKV, D, seed=5)
    layer = SCSALayer(small_cfg(), H, HKV, D)
    layer.attend(q, k0, v0, D ** -0.5)
    for k, v in [(k0[:, :, :500], v0[:, :, :500]), (k1, v1)]:
        out = layer.attend(q, k, v, D ** -0.5)
        fresh = SCSALayer(small_cfg(), H, HKV, D)
        assert torch.equal(out, fresh.attend(q, k, v, D ** -0.5))
        assert_same_index(layer.indexes[0], fresh.indexes[0])
    # Shrinking only inside the unsealed suffix keeps the plan.
    seal = layer.indexes[0].seal_end
    layer.attend(q, k1[:, :, :seal + 1], v1[:, :, :seal + 1], D ** -0.5)
    assert layer.indexes[0].seal_end == seal


def test_batch_rows_are_independent():
    cases = [attn_case(700, H, HKV, D, seed=s, query_seed=i) for i, s in enumerate((1, 2, 3))]
    qs = [c[0] for c in cases]
    batched = SCSALayer(small_cfg(), H, HKV, D)
    out = batched.attend(torch.cat(qs), torch.cat([c[1] for c in cases]), torch.cat([c[2] for c in cases]),
                         D ** -0.5)
    for b, (q, k, v, _) in enumerate(cases):
        alone = SCSALayer(small_cfg(), H, HKV, D).attend(q, k, v, D ** -0.5)
        assert torch.equal(out[b:b + 1], alone)
