"""SCSA wired into the model as the "sparse" attention kind."""

import json

import pytest
import torch

from conftest import tiny_model
from longattn.errors import LongattnError
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session
from longattn.sparse import SCSAConfig
from longattn.sparse.policy import build_sparse_policy, save_taus, sparse_ops
from tolerance import LOGIT_FLOOR, assert_within_derived

# dense_when_cheaper off: tiny caches would send every layer to its dense read (test_sparse_cost.py)
SMALL = dict(cluster_size=16, rebuild_interval=64, block_size=256, recent=8, sink=2, min_context=0, outliers=2,
             dense_when_cheaper=False)


def _decode(model, policy, prompt, steps):
    s = Session(model, policy)
    out = [s.prefill([prompt])[:, 0]]
    for t in steps:
        out.append(s.step(torch.tensor([t])))
    return torch.cat(out)  # [steps+1, V]


def test_tau_zero_sparse_decode_equals_dense():
    m = tiny_model("llama")
    m64 = tiny_model("llama", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (400,), generator=g).tolist()
    steps = torch.randint(0, 96, (12,), generator=g).tolist()
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, packing="f32", calib_steps=0, tau_default=0.0))
    sparse = _decode(m, pol, prompt, steps)
    dense = _decode(m, AttentionPolicy.from_config(m.config), prompt, steps)
    ref = _decode(m64, AttentionPolicy.from_config(m64.config), prompt, steps)
    ops = sparse_ops(pol)
    assert len(ops) == m.config.num_layers
    assert all(op.scsa.counters["opened_rows"] > 0 for op in ops)  # really went through clusters
    assert_within_derived(sparse, dense, ref, floor=LOGIT_FLOOR)


def test_calibrated_sparse_decode_is_close_and_saves_taus(tmp_path):
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 96, (700,), generator=g).tolist()
    steps = torch.randint(0, 96, (10,), generator=g).tolist()
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4))
    sparse = _decode(m, pol, prompt, steps)
    dense = _decode(m, AttentionPolicy.from_config(m.config), prompt, steps)
    assert all(op.scsa.calibrated for op in sparse_ops(pol))
    rel = ((sparse - dense).norm(dim=-1) / dense.norm(dim=-1)).max().item()
    assert rel < 0.1, rel
    save_taus(pol, tmp_path / "taus.json")
    taus = json.loads((tmp_path / "taus.json").read_text())
    assert set(taus) == {f"{l}:{h}" for l in range(3) for h in range(2)}


def test_unmet_tolerance_attends_exactly(tmp_path):
    """A tolerance no tau meets (not even tau 0, whose q8_0 rounding errs) makes every layer
    attend exactly after calibration: nothing is opened, the choice survives a save/preset round
    trip as null, and a policy given those taus decodes bit for bit as the dense policy (the
    layer's own dense op; calibration steps use SCSA's exact path, another kernel, so the
    calibrating policy itself is only close). Without exact_when_unmet the same layers run
    sparse at the smallest tau and differ from dense."""
    from longattn.sparse.policy import policy_taus, preset_taus
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (700,), generator=g).tolist()
    steps = torch.randint(0, 96, (8,), generator=g).tolist()
    dense = _decode(m, AttentionPolicy.from_config(m.config), prompt, steps)
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=1e-9))
    out = _decode(m, pol, prompt, steps)
    assert ((out - dense).norm(dim=-1) / dense.norm(dim=-1)).max().item() < 1e-5
    ops = sparse_ops(pol)
    assert all(op.scsa.counters["calls"] == len(steps) for op in ops)  # every call counted
    assert all(op.scsa.calibrated and bool(op.scsa.exact_heads.all()) for op in ops)
    assert all(op.scsa.counters["opened_rows"] == 0 for op in ops)
    taus = policy_taus(pol)
    assert all(t == [None] * m.config.num_kv_heads for t in taus.values())
    save_taus(pol, tmp_path / "taus.json")
    assert all(v is None for v in json.loads((tmp_path / "taus.json").read_text()).values())
    fresh = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=1e-9))
    preset_taus(fresh, m.config, taus)
    assert torch.equal(_decode(m, fresh, prompt, steps), dense)
    off = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=1e-9, exact_when_unmet=False))
    assert not torch.equal(_decode(m, off, prompt, steps), dense)
    assert all(op.scsa.counters["opened_rows"] > 0 for op in sparse_ops(off))


def test_gemma3_sparse_defaults_to_global_layers():
    m = tiny_model("gemma3")
    pol = build_sparse_policy(m.config)
    assert [lp.kind for lp in pol.layers] == ["window", "window", "sparse"] * 2
    assert [lp.window for lp in pol.layers] == [8, 8, None] * 2


def test_sparse_below_min_context_is_dense_bit_for_bit():
    m = tiny_model("llama")
    prompt = list(range(1, 60))
    pol = build_sparse_policy(m.config, SCSAConfig(min_context=10_000))
    a = _decode(m, pol, prompt, [5, 6, 7])
    b = _decode(m, AttentionPolicy.from_config(m.config), prompt, [5, 6, 7])
    assert torch.equal(a, b)


def test_sparse_layer_out_of_range():
    m = tiny_model("llama")
    with pytest.raises(LongattnError, match="out of range"):
        build_sparse_policy(m.config, layers=[7])


def test_retune_and_preset_taus():
    """retune re-picks every layer's taus from its calibration; preset_taus hands them to a new
    policy whose decode skips calibration and equals the calibrated policy's decode."""
    from longattn.sparse.policy import policy_taus, preset_taus, retune
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 96, (700,), generator=g).tolist()
    steps = torch.randint(0, 96, (8,), generator=g).tolist()
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4))
    _decode(m, pol, prompt, steps[:5])  # 4 calibration steps (the prefill's last token is not a step)
    assert all(op.scsa.calibrated for op in sparse_ops(pol))
    loose = retune(pol, 0.5)
    tight = retune(pol, 1e-9)
    for op in sparse_ops(pol):
        li = op.layer_index
        assert loose[li] == op.scsa.calibrator.choose(op.cfg.tau_default, 0.5).tolist()
        # no tau meets 1e-9 (q8_0 rounding alone misses it): every head attends exactly
        assert tight[li] == [None] * len(loose[li])
    taus = retune(pol, 0.025)
    fresh = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4))
    preset_taus(fresh, m.config, taus)
    assert policy_taus(fresh) == taus
    for op in sparse_ops(pol):
        op.scsa.reset()
    a = _decode(m, pol, prompt, steps)
    b = _decode(m, fresh, prompt, steps)
    assert torch.equal(a, b)
    assert all(op.scsa.calibrator.calls == 0 for op in sparse_ops(fresh))
    with pytest.raises(LongattnError, match="tolerance"):
        retune(pol, 0.0)
