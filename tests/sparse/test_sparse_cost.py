"""dense_when_cheaper: the cost model's arithmetic, the calibrator's median ratio at the chosen
taus, and a layer that routes itself to its exact dense read where the sparse call would cost
more (a short cache: the fixed cost alone exceeds the dense read) and stays sparse where it
would not (a long cache, few clusters opened)."""

import torch
import torch.nn.functional as F

from longattn.sparse import SCSAConfig, SCSALayer
from longattn.sparse import cost
from longattn.sparse.calibrate import Calibrator
from longattn.sparse.synthetic import synthetic_cache
from sparse_fixtures import attn_case, small_cfg

H, HKV, D = 4, 2, 32


def test_cost_model_counts_row_reads():
    assert cost.dense_cost(2, 1000) == cost.DENSE_FIXED + 2000.0
    want = cost.FIXED + cost.PER_CLUSTER * 2 * 10 + cost.PER_OPENED * 300 + cost.PER_EXACT * 50
    assert cost.sparse_cost(2, 10, 300, 50) == want
    assert cost.PER_PROBED > 0  # the probe's pass: every probed row at its price
    assert cost.sparse_cost(2, 10, 300, 50, 4000) == want + cost.PER_PROBED * 4000


def test_calibrator_cost_ratio_at_the_chosen_taus():
    cal = Calibrator((0.0, 0.1, 0.2), steps=2, tolerance=0.05, num_kv_heads=2)
    assert cal.cost_ratio() is None  # nothing recorded
    errors = torch.tensor([[0.0, 0.0], [0.01, 0.2], [0.02, 0.3]])  # head 0 picks 0.2, head 1 picks 0.0
    opened = torch.tensor([[900, 800], [500, 400], [100, 300]])  # rows each tau opens, per head
    n_values = (5000, 20000)
    for n in n_values:
        cal.record([errors], [(n, 40, 120, opened, 0)])
    ratios = sorted(cost.sparse_cost(2, 40, 100 + 800, 120) / cost.dense_cost(2, n) for n in n_values)
    assert cal.cost_ratio() == float(torch.tensor(ratios).median())
    # another tolerance, other taus: head 1 may now take 0.2 too
    assert cal.cost_ratio(0.5) == float(torch.tensor(sorted(
        cost.sparse_cost(2, 40, 100 + 300, 120) / cost.dense_cost(2, n) for n in n_values)).median())


def calibrated(cfg: SCSAConfig, q, k, v, scale, steps):
    layer = SCSALayer(cfg, q.shape[1], k.shape[1], q.shape[-1])
    for _ in range(steps):
        layer.attend(q, k, v, scale)
    assert layer.calibrated
    return layer


def test_short_cache_routes_the_layer_to_its_dense_read():
    q, k, v, scale = attn_case(300, H, HKV, D, seed=2)
    cfg = dict(calib_steps=3, tolerance=0.05)
    on = calibrated(small_cfg(**cfg, dense_when_cheaper=True), q, k, v, scale, 3)
    # 300 rows x 2 heads: the dense read costs less than the sparse call's fixed part alone
    assert on.cost_ratio > 1.0 and cost.FIXED > cost.dense_cost(HKV, 300)
    assert on.runs_exact and on.tau_values() == [None, None]
    out = on.attend(q, k, v, scale)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    off = calibrated(small_cfg(**cfg, dense_when_cheaper=False), q, k, v, scale, 3)
    assert off.cost_ratio == on.cost_ratio and not off.runs_exact
    assert None not in off.tau_values() and off.tau_values() == off.choose_taus()


def test_long_cache_with_few_opened_rows_stays_sparse():
    n = 8192
    cache = synthetic_cache(n, HKV, D, seed=3)
    q = cache.queries(1, H, seed=4)[0]
    scale = D ** -0.5
    cfg = SCSAConfig(min_context=0, calib_steps=2, tolerance=0.2, outliers=0)
    layer = calibrated(cfg, q, cache.k, cache.v, scale, 2)
    index = layer.indexes[0]
    opened = layer.calibrator.reads[0][3][layer.calibrator.choice(), torch.arange(HKV)].sum()
    want = cost.sparse_cost(HKV, index.num_clusters, float(opened), HKV * (n - index.seal_end + cfg.sink)) \
        / cost.dense_cost(HKV, n)
    assert abs(layer.cost_ratio - want) <= 1e-6 * want and layer.cost_ratio < 1.0
    assert not layer.runs_exact
    before = layer.counters["opened_rows"]
    layer.attend(q, cache.k, cache.v, scale)
    assert 0 < layer.counters["opened_rows"] - before < HKV * n  # a sparse call, not a dense one


def test_the_probe_is_priced():
    """With the probe on, the layer's predicted cost adds its pass over every packed member row
    (and the calibrator records those rows), at the same chosen taus."""
    n = 8192
    cache = synthetic_cache(n, HKV, D, seed=3)
    q = cache.queries(1, H, seed=4)[0]
    scale = D ** -0.5
    kw = dict(min_context=0, calib_steps=2, tolerance=0.2, outliers=0)
    for dims in (8, D):
        probed = calibrated(SCSAConfig(**kw, probe_dims=dims), q, cache.k, cache.v, scale, 2)
        index = probed.indexes[0]
        rows = HKV * index.packed_rows
        assert probed.calibrator.reads[0][4] == rows
        assert 0 < rows <= HKV * n and rows == HKV * int(index.counts[:index.num_clusters].sum())
        opened = probed.calibrator.reads[0][3][probed.calibrator.choice(), torch.arange(HKV)].sum()
        want = cost.sparse_cost(HKV, index.num_clusters, float(opened), HKV * index.exact_count(n), rows) \
            / cost.dense_cost(HKV, n)
        assert abs(probed.cost_ratio - want) <= 1e-6 * want
        unpriced = cost.sparse_cost(HKV, index.num_clusters, float(opened), HKV * index.exact_count(n)) \
            / cost.dense_cost(HKV, n)
        # the pass is not free: the ratio carries its whole term (the median is taken in float32)
        assert probed.cost_ratio - unpriced >= 0.99 * cost.PER_PROBED * rows / cost.dense_cost(HKV, n) > 0.01


def test_cli_sparse_flags_reach_the_config():
    import argparse

    from conftest import tiny_dir
    from longattn.checkpoint import load_checkpoint
    from longattn.cli.common import add_policy_args
    from longattn.sparse.policy import sparse_policy

    p = argparse.ArgumentParser()
    add_policy_args(p)
    config = load_checkpoint(tiny_dir("llama"), with_tokenizer=False).config
    for argv, want in (([], True), (["--sparse-always"], False)):
        pol = sparse_policy(config, p.parse_args(["--policy", "sparse"] + argv))
        assert pol.sparse_config.dense_when_cheaper is want
    pol = sparse_policy(config, p.parse_args(["--policy", "sparse", "--sparse-calib-quantile", "0.9"]))
    assert pol.sparse_config.calib_quantile == 0.9
    assert sparse_policy(config, p.parse_args(["--policy", "sparse"])).sparse_config.calib_quantile == 0.5
    pol = sparse_policy(config, p.parse_args(["--policy", "sparse", "--sparse-probe", "16"]))
    assert pol.sparse_config.probe_dims == 16
    assert sparse_policy(config, p.parse_args(["--policy", "sparse"])).sparse_config.probe_dims == 0
