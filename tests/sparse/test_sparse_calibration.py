"""Self-calibration: exact while calibrating, then each head's frozen tau meets the tolerance."""

import pytest
import torch
import torch.nn.functional as F

from longattn.errors import LongattnError
from longattn.sparse import SCSAConfig, SCSALayer
from longattn.sparse.calibrate import Calibrator, group_error, relative_error
from sparse_fixtures import decode_run, small_cfg as _small_cfg

H, HKV, D = 8, 2, 64
START, STEPS = 2000, 32


def small_cfg(**kw):
    return _small_cfg(**{"cluster_size": 32, "block_size": 512, "recent": 16, "calib_steps": STEPS,
                         "tolerance": 0.025, **kw})


@pytest.fixture(scope="module")
def decode():
    """A decode run: the cache grows by one token per call (crossing a rebuild)."""
    return decode_run(START, STEPS, H, HKV, D, seed=21, query_seed=4)


def run(layer, steps):
    return [layer.attend(q, k, v, D ** -0.5) for q, k, v in steps]


@pytest.mark.parametrize("hierarchical", [False, True])
def test_calibration_runs_exactly_then_freezes_taus_that_meet_the_tolerance(decode, hierarchical):
    cfg = small_cfg(hierarchical=hierarchical)
    layer = SCSALayer(cfg, H, HKV, D)
    assert torch.equal(layer.taus, torch.full((HKV,), cfg.tau_default))
    outs = run(layer, decode)
    for out, (q, k, v) in zip(outs, decode):  # calibrating: exact dense output
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True))
    assert layer.calibrated and layer.calibrator.calls == STEPS
    taus = layer.taus
    assert bool((taus > 0).all()), f"calibration should find a sparse threshold, got {taus}"
    # Replay the same decode with the frozen taus: per query head, median error <= tolerance.
    frozen = SCSALayer(small_cfg(calib_steps=0, hierarchical=hierarchical), H, HKV, D)
    frozen.set_taus(taus)
    errs = torch.stack([relative_error(o, F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5,
                                                                         enable_gqa=True))[0, :, 0]
                        for o, (q, k, v) in zip(run(frozen, decode), decode)])  # [STEPS, H]
    assert bool((errs.median(0).values <= cfg.tolerance).all()), errs.median(0).values
    assert frozen.counters["opened_rows"] < 0.9 * STEPS * HKV * START  # and it is sparse


def test_tighter_tolerance_picks_smaller_taus(decode):
    loose = SCSALayer(small_cfg(tolerance=0.05), H, HKV, D)
    tight = SCSALayer(small_cfg(tolerance=0.002), H, HKV, D)
    run(loose, decode)
    run(tight, decode)
    assert bool((tight.taus <= loose.taus).all())
    assert bool((tight.taus < loose.taus).any())


def test_calibrator_choice_rules():
    cal = Calibrator((0.0, 0.1, 0.2, 0.4), steps=3, tolerance=0.05, num_kv_heads=3)
    assert torch.equal(cal.choose(0.07), torch.full((3,), 0.07))  # no samples: tau_default
    # head 0 passes up to 0.2; head 1 never passes (-> smallest tau); head 2 passes everywhere.
    table = torch.tensor([[0.0, 0.2, 0.0], [0.01, 0.3, 0.01], [0.04, 0.4, 0.02], [0.09, 0.5, 0.03]])
    for _ in range(3):
        cal.record([table])
    assert cal.done
    assert torch.allclose(cal.choose(0.07), torch.tensor([0.2, 0.0, 0.4]))
    assert cal.unmet().tolist() == [False, True, False]  # head 1: no tau meets 0.05
    assert cal.unmet(0.5).tolist() == [False, False, False]


def test_calibrator_quantile():
    """0.5 is torch's (lower) median; a higher quantile judges each tau by a worse step."""
    g = torch.Generator().manual_seed(0)
    samples = [torch.rand(4, 2, generator=g, dtype=torch.float64).cumsum(0) * 0.02 for _ in range(10)]
    median, high = (Calibrator((0.0, 0.1, 0.2, 0.4), steps=10, tolerance=0.05, num_kv_heads=2, quantile=q)
                    for q in (0.5, 0.9))
    for cal in (median, high):
        for s in samples:
            cal.record([s])
    stacked = torch.stack(samples)
    assert torch.equal(median.levels(), stacked.median(0).values)
    assert torch.equal(high.levels(), stacked.sort(0).values[8])  # ceil(0.9 * 10) = 9th smallest
    assert bool((high.choice() <= median.choice()).all())
    assert bool((high.levels() >= median.levels()).all())
    with pytest.raises(LongattnError, match="calib_quantile"):
        SCSAConfig(calib_quantile=0.0)


def test_loaded_taus_skip_calibration(decode, tmp_path):
    layer = SCSALayer(small_cfg(), H, HKV, D)
    layer.set_taus([0.02, 0.04])
    layer.save_taus(tmp_path / "t.json")
    other = SCSALayer(small_cfg(), H, HKV, D)
    other.load_taus(tmp_path / "t.json")
    q, k, v = decode[0]
    assert torch.equal(other.attend(q, k, v, D ** -0.5), layer.attend(q, k, v, D ** -0.5))
    assert other.calibrator.calls == 0


FACTOR_TWO_GRID = (0.0, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)  # the grid before sqrt(2) steps


def frozen_replay(taus, decode, **kw):
    """Run ``decode`` with frozen ``taus``: (outputs, layer)."""
    layer = SCSALayer(small_cfg(calib_steps=0, **kw), H, HKV, D)
    layer.set_taus(taus)
    return run(layer, decode), layer


def exact_outputs(decode):
    return [F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True) for q, k, v in decode]


def test_finer_default_grid_never_opens_more(decode):
    """The default grid holds every value of the factor-2 grid, so each head's largest passing tau
    can only grow, and the stop rule's prefix only shrinks as tau grows."""
    from longattn.sparse.config import DEFAULT_TAU_GRID
    assert set(FACTOR_TWO_GRID) <= set(DEFAULT_TAU_GRID)
    coarse = SCSALayer(small_cfg(tau_grid=FACTOR_TWO_GRID), H, HKV, D)
    fine = SCSALayer(small_cfg(), H, HKV, D)
    run(coarse, decode)
    run(fine, decode)
    assert bool((fine.taus >= coarse.taus).all())
    _, a = frozen_replay(coarse.taus, decode)
    _, b = frozen_replay(fine.taus, decode)
    assert b.counters["opened_rows"] <= a.counters["opened_rows"]


def test_group_error_never_exceeds_the_worst_head():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(50, HKV, H // HKV, D, generator=g) * torch.rand(50, HKV, H // HKV, 1, generator=g)
    o_tau = o + 0.1 * torch.randn(o.shape, generator=g) * torch.rand(50, HKV, H // HKV, 1, generator=g)
    head, group = group_error(o_tau, o, "head"), group_error(o_tau, o, "group")
    assert bool((group <= head * (1 + 1e-12)).all())
    assert bool((group < head).any())
    one = o_tau[:, :, :1], o[:, :, :1]  # a single query head per group: the two metrics coincide
    assert torch.allclose(group_error(*one, "group"), group_error(*one, "head"), rtol=1e-12, atol=0)


def test_group_metric_meets_its_tolerance_with_larger_taus(decode):
    head = SCSALayer(small_cfg(), H, HKV, D)
    group = SCSALayer(small_cfg(calib_metric="group"), H, HKV, D)
    run(head, decode)
    run(group, decode)
    assert bool((group.taus >= head.taus).all())
    outs, layer = frozen_replay(group.taus, decode)
    errs = torch.stack([group_error(o[0, :, 0].view(HKV, -1, D), e[0, :, 0].view(HKV, -1, D), "group")
                        for o, e in zip(outs, exact_outputs(decode))])  # [STEPS, Hkv]
    assert bool((errs.median(0).values <= 0.025).all()), errs.median(0).values


def test_choose_at_another_tolerance_equals_calibrating_at_it(decode):
    """Re-picking from the recorded errors == a calibration run at that tolerance."""
    base = SCSALayer(small_cfg(tolerance=0.025), H, HKV, D)
    run(base, decode)
    for tol in (0.002, 0.05, 0.2):
        other = SCSALayer(small_cfg(tolerance=tol), H, HKV, D)
        run(other, decode)
        assert torch.equal(base.calibrator.choose(base.cfg.tau_default, tol), other.taus)


@pytest.mark.parametrize("hierarchical, refine, probe", [(False, 0, 0), (True, 0, 0), (False, 2, 0), (False, 0, 4),
                                                         (False, 2, 4)])
def test_replay_errors_equal_one_sparse_output_per_tau(decode, hierarchical, refine, probe):
    # replay_errors shares one output among taus that open the same clusters; each row must
    # still equal the error of the sparse output computed at that tau on its own (with refine,
    # the replay prices every cluster once where the live call reads only what it opened)
    layer = SCSALayer(small_cfg(hierarchical=hierarchical, refine=refine, probe_dims=probe), H, HKV, D)
    q, k, v = decode[-1]
    layer.attend(q, k, v, D ** -0.5)  # builds the index (a calibration call)
    index = layer.indexes[0]
    prep = layer._prepare(index, q[0, :, 0], k[0], v[0], D ** -0.5)
    o_exact = F.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, enable_gqa=True)[0, :, 0]
    o_exact = o_exact.view(HKV, H // HKV, D)
    table = layer.replay_errors(index, prep, o_exact, D ** -0.5)
    grid = layer.calibrator.grid.float()
    assert table.shape == (len(grid), HKV)
    for row, tau in zip(table, grid):
        o_tau, _ = layer._sparse(index, prep, D ** -0.5, tau.expand(HKV))
        assert torch.equal(row, group_error(o_tau, o_exact, layer.cfg.calib_metric))
    assert torch.equal(layer.calibrator.samples[0], table)  # what the calibration call recorded
    assert float(table[0].max()) < float(table[-1].max())  # tau 0 is exact up to rounding, the largest is not
