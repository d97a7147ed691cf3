"""SCSA as a user's run meets it: the index sealed during the prefill, taus kept between runs.

An index grown while the prompt's chunks arrive equals the one built at the first decode
step (same clusters, same selection counters, same logits, bit for bit); taus reused from the
cache are the taus calibration chose and take the same decisions on the same inputs; and
``generate --policy sparse`` says which it did and where the time went.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from longattn.cache import KVView
from longattn.engine.session import Session
from longattn.sparse import SCSAConfig
from longattn.sparse.policy import build_sparse_policy, cache_taus, policy_taus, sparse_layers, stream_layers
from longattn.sparse.tau_cache import load_cached_taus, store_taus, tau_cache_path
from sparse_fixtures import assert_same_index

SMALL = dict(cluster_size=16, rebuild_interval=64, block_size=256, recent=8, sink=2, min_context=0, outliers=2,
             dense_when_cheaper=False)
SELECTION = ("opened_rows", "exact_rows", "outlier_rows", "clusters_scored", "calls")


def _run(model, policy, prompt, steps, chunk=64):
    """Logits ``[1 + len(steps), V]``, per sparse layer whether the prefill sealed blocks, and
    the session's cache."""
    s = Session(model, policy)
    out = [s.prefill([prompt], chunk=chunk)[:, 0]]
    held = stream_layers(s.cache)
    sealed = [i in held and bool(held[i].indexes) and held[i].indexes[0].frozen_blocks > 0
              for i in sparse_layers(policy)]
    for t in steps:
        out.append(s.step(torch.tensor([t])))
    return torch.cat(out), sealed, s.cache


@pytest.mark.parametrize("calib_steps", [0, 4])
def test_index_grown_during_prefill_equals_one_built_after(calib_steps):
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 96, (900,), generator=g).tolist()
    steps = torch.randint(0, 96, (12,), generator=g).tolist()
    during = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=calib_steps, index_in_prefill=True))
    after = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=calib_steps, index_in_prefill=False))
    a, sealed_a, cache_a = _run(m, during, prompt, steps)
    b, sealed_b, cache_b = _run(m, after, prompt, steps)
    assert all(sealed_a) and not any(sealed_b)  # the prefill really built the blocks, or did not
    assert torch.equal(a, b)
    la, lb = stream_layers(cache_a), stream_layers(cache_b)
    assert sorted(la) == sorted(lb) == sparse_layers(during)
    for i in la:
        x, y = la[i], lb[i]
        assert_same_index(x.indexes[0], y.indexes[0])
        assert {k: x.counters[k] for k in SELECTION} == {k: y.counters[k] for k in SELECTION}
        assert x.counters["opened_rows"] > 0
        assert x.seconds["index_prefill"] > 0 and y.seconds["index_prefill"] == 0
        assert x.tau_values() == y.tau_values()


def test_prefill_builds_nothing_below_min_context():
    m = tiny_model("llama")
    prompt = torch.randint(0, 96, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    pol = build_sparse_policy(m.config, SCSAConfig(**{**SMALL, "min_context": 10_000}))
    s = Session(m, pol)
    s.prefill([prompt], chunk=64)
    assert stream_layers(s.cache) == {}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cached_taus_are_the_calibrated_ones_and_decide_alike(cache):
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 96, (800,), generator=g).tolist()
    steps = torch.randint(0, 96, (8,), generator=g).tolist()
    cfg = SCSAConfig(**SMALL, calib_steps=4)
    calibrated = build_sparse_policy(m.config, cfg)
    _, _, cal_cache = _run(m, calibrated, prompt, steps)
    path = tau_cache_path("weights-key", "int8", calibrated)
    assert store_taus(path, calibrated, cal_cache)
    reused = load_cached_taus(path, build_sparse_policy(m.config, cfg), m.config)
    assert reused is not None
    assert policy_taus(reused) == cache_taus(cal_cache)
    # same inputs, same decisions: each layer a reused policy makes against the one that calibrated
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 700, 16, generator=g), torch.randn(1, 2, 700, 16, generator=g)
    view = KVView(k, v, torch.arange(700)[None], k[:, :, -1:], v[:, :, -1:], {})
    for i, a in stream_layers(cal_cache).items():
        b = reused.op(i).scsa(view._replace(state={}), 4, 16)
        assert b.calibrated and b.calibrator.calls == 0
        a.reset()
        fresh_counts = dict(b.counters)
        before = dict(a.counters)
        assert torch.equal(a.attend(q, k, v, 0.25), b.attend(q, k, v, 0.25))
        assert {n: a.counters[n] - before[n] for n in SELECTION} == \
            {n: b.counters[n] - fresh_counts[n] for n in SELECTION}


def test_taus_of_another_setting_or_model_are_not_reused(cache):
    m = tiny_model("llama")
    p1 = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4))
    p2 = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, tolerance=0.05))
    p3 = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4, index_in_prefill=False))
    assert tau_cache_path("a", "int8", p1) != tau_cache_path("a", "int8", p2)
    assert tau_cache_path("a", "int8", p1) != tau_cache_path("b", "int8", p1)
    assert tau_cache_path("a", "int8", p1) != tau_cache_path("a", "int4", p1)
    assert tau_cache_path("a", "int8", p1) == tau_cache_path("a", "int8", p3)  # wiring only
    empty = Session(m, p1).cache
    assert not store_taus(tau_cache_path("a", "int8", p1), p1, empty)  # nothing calibrated yet: nothing kept
    assert load_cached_taus(tau_cache_path("a", "int8", p1), p1, m.config) is None


def test_a_damaged_tau_file_is_ignored(cache):
    m = tiny_model("llama")
    pol = build_sparse_policy(m.config, SCSAConfig(**SMALL, calib_steps=4))
    path = tau_cache_path("a", "int8", pol)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert load_cached_taus(path, pol, m.config) is None
    path.write_text(json.dumps({"0:0": 0.1}))  # a layer missing
    assert load_cached_taus(path, pol, m.config) is None


def test_generate_sparse_keeps_its_taus_for_the_next_run(tmp_path, monkeypatch, capsys):
    """The real CLI on SmolLM2: the first run calibrates and keeps its taus, the second reuses
    them (no calibration time), --sparse-calibrate calibrates again."""
    from longattn.cli.main import main
    from longattn.data import book_body
    import longattn.sparse.tau_cache as tau_cache
    monkeypatch.setattr(tau_cache, "cache_root", lambda: tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(book_body()[:4000])
    args = ["generate", "--policy", "sparse", "--sparse-min-context", "0", "--prompt-file", str(prompt),
            "--max-new-tokens", "40", "--threads", "1", "--json"]

    def run(*extra):
        capsys.readouterr()
        assert main(args + list(extra)) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sparse"]
    first = run()
    assert first["taus"] == "calibrated in this run" and first["calibration_s"] > 0
    assert first["index_in_prefill_s"] == 0  # ~900 tokens fill no 4,096-row block: sealed at decode
    assert first["index_in_decode_s"] > 0
    assert len(list((tmp_path / "taus").glob("*.cost.json"))) == 1  # the taus and their costs
    assert len(list((tmp_path / "taus").iterdir())) == 2
    second = run()
    assert second["taus"] == "reused from the cache" and second["calibration_s"] == 0
    third = run("--sparse-calibrate")
    assert third["taus"] == "calibrated in this run" and third["calibration_s"] > 0


def test_sparse_calibrate_needs_the_sparse_policy(capsys):
    from longattn.cli.main import main
    assert main(["generate", "--sparse-calibrate", "--max-new-tokens", "1"]) == 2
    assert "--sparse-calibrate only applies with --policy sparse" in capsys.readouterr().err
