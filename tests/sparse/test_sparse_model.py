"""SCSA wired into the model as the "sparse" attention kind."""

import json

import pytest
import torch

from conftest import tiny_model
from longattn.errors import LongattnError
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session
from longattn.sparse import SCSAConfig
from longattn.sparse.policy import (build_sparse_policy, cache_taus, policy_taus, retune, save_taus,
                                     stream_layers, with_taus)
from tolerance import LOGIT_FLOOR, assert_within_derived

# dense_when_cheaper off: tiny caches would send every layer to its dense read (test_sparse_cost.py)
SMALL = dict(cluster_size=16, rebuild_interval=64, block_size=256, recent=8, sink=2, min_context=0, outliers=2,
             dense_when_cheaper=False)


def _run(model, policy, prompt, steps, before_steps=None):
    """(logits ``[steps+1, V]``, the session's cache); ``before_steps(cache)`` runs after the prefill."""
    s = Session(model, policy)
    out = [s.prefill([prompt])[:, 0]]
    if before_steps is not None:
        before_steps(s.cache)
    for t in steps:
        out.append(s.step(torch.tensor([t])))
    return torch.cat(out), s.cache


def _decode(model, policy, prompt, steps):
    return _run(model, policy, prompt, steps)[0]


def test_tau_zero_sparse_decode_equals_dense():
    m = tiny_model("llama")
    m64 = tiny_model("llama", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (400,), generator=g).tolist()
    steps = torch.randint(0, 96, (12,), generator=g).tolist()
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, packing="f32", calib_steps=0, tau_default=0.0))
    sparse, cache = _run(m, pol, prompt, steps)
    dense = _decode(m, AttentionPolicy.from_config(m.config), prompt, steps)
    ref = _decode(m64, AttentionPolicy.from_config(m64.config), prompt, steps)
    layers = stream_layers(cache)
    assert len(layers) == m.config.num_layers
    assert all(sc.counters["opened_rows"] > 0 for sc in layers.values())  # really went through clusters
    assert_within_derived(sparse, dense, ref, floor=LOGIT_FLOOR)


def test_calibrated_sparse_decode_is_close_and_saves_taus(tmp_path):
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 96, (700,), generator=g).tolist()
    steps = torch.randint(0, 96, (10,), generator=g).tolist()
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4))
    sparse, cache = _run(m, pol, prompt, steps)
    dense = _decode(m, AttentionPolicy.from_config(m.config), prompt, steps)
    assert all(sc.calibrated for sc in stream_layers(cache).values())
    rel = ((sparse - dense).norm(dim=-1) / dense.norm(dim=-1)).max().item()
    assert rel < 0.1, rel
    save_taus(cache, tmp_path / "taus.json")
    taus = json.loads((tmp_path / "taus.json").read_text())
    assert set(taus) == {f"{l}:{h}" for l in range(3) for h in range(2)}


def test_unmet_tolerance_attends_exactly(tmp_path):
    """A tolerance no tau meets (not even tau 0, whose q8_0 rounding errs) makes every layer
    attend exactly after calibration: nothing is opened, the choice survives a save/preset round
    trip as null, and a policy given those taus decodes bit for bit as the dense policy (the
    layer's own dense op; calibration steps use SCSA's exact path, another kernel, so the
    calibrating policy itself is only close). Without exact_when_unmet the same layers run
    sparse at the smallest tau and differ from dense."""
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (700,), generator=g).tolist()
    steps = torch.randint(0, 96, (8,), generator=g).tolist()
    dense = _decode(m, AttentionPolicy.from_config(m.config), prompt, steps)
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=1e-9))
    out, cache = _run(m, pol, prompt, steps)
    assert ((out - dense).norm(dim=-1) / dense.norm(dim=-1)).max().item() < 1e-5
    layers = stream_layers(cache).values()
    assert all(sc.counters["calls"] == len(steps) for sc in layers)  # every call counted
    assert all(sc.calibrated and bool(sc.exact_heads.all()) for sc in layers)
    assert all(sc.counters["opened_rows"] == 0 for sc in layers)
    taus = cache_taus(cache)
    assert all(t == [None] * m.config.num_kv_heads for t in taus.values())
    save_taus(cache, tmp_path / "taus.json")
    assert all(v is None for v in json.loads((tmp_path / "taus.json").read_text()).values())
    fresh = with_taus(build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=1e-9)), taus)
    assert torch.equal(_decode(m, fresh, prompt, steps), dense)
    off = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=1e-9, exact_when_unmet=False))
    out_off, cache_off = _run(m, off, prompt, steps)
    assert not torch.equal(out_off, dense)
    assert all(sc.counters["opened_rows"] > 0 for sc in stream_layers(cache_off).values())


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


def test_retune_and_with_taus():
    """retune re-picks every layer's taus from its calibration; with_taus puts them in a new
    policy, whose streams skip calibration and decode as a calibrated stream given the same taus."""
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 96, (700,), generator=g).tolist()
    steps = torch.randint(0, 96, (8,), generator=g).tolist()
    cfg = SCSAConfig(**SMALL, calib_steps=4)
    pol = build_sparse_policy(m.config, cfg)
    _, cache = _run(m, pol, prompt, steps[:5])  # 4 calibration steps (the prefill's last token is not a step)
    layers = stream_layers(cache)
    assert layers and all(sc.calibrated for sc in layers.values())
    loose = retune(cache, 0.5)
    tight = retune(cache, 1e-9)
    for li, sc in layers.items():
        assert loose[li] == sc.calibrator.choose(cfg.tau_default, 0.5).tolist()
        # no tau meets 1e-9 (q8_0 rounding alone misses it): every head attends exactly
        assert tight[li] == [None] * len(loose[li])
    taus = retune(cache, 0.025)
    fresh = with_taus(build_sparse_policy(m.config, cfg), taus)
    assert policy_taus(fresh) == taus

    def set_in_place(c):  # the calibrating policy's own layers, handed the same taus
        for i, sc in stream_layers(c).items():
            sc.set_taus(taus[i])
    a, _ = _run(m, pol, prompt, steps, before_steps=set_in_place)
    b, fresh_cache = _run(m, fresh, prompt, steps)
    assert torch.equal(a, b)
    assert all(sc.calibrator.calls == 0 for sc in stream_layers(fresh_cache).values())
    with pytest.raises(LongattnError, match="tolerance"):
        retune(cache, 0.0)
