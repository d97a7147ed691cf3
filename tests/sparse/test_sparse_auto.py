"""``--policy auto``: SCSA only where the cost model says it pays for this run.

The rule's arithmetic is checked against a direct sum over the run's decode steps; its refusals
(no calibrated taus, below min_context, a head attending exactly, no cost prediction, a cost
ratio >= 1) each keep the layer dense with the reason said; a restricted policy computes what
the checkpoint's attention computes (bit for bit); and the real CLI on SmolLM2 declines without
taus, then engages SCSA with the taus and costs an earlier run kept."""

import json

import torch

from conftest import tiny_model
from longattn.engine.session import Session
from longattn.policy import AttentionPolicy
from longattn.sparse import SCSAConfig, auto
from longattn.sparse.cost import DENSE_FIXED
from longattn.sparse.policy import build_sparse_policy, sparse_layers


class Cfg:
    num_kv_heads = 2


def _saving_by_steps(ratio, hkv, prompt, new, min_context):
    """The saving summed step by step: step i reads ``prompt + i`` cached tokens (i = 1..new)."""
    return sum((1 - ratio) * (DENSE_FIXED + hkv * c) for c in range(prompt + 1, prompt + new + 1)
               if c >= min_context)


def test_saving_is_the_sum_over_the_decode_steps():
    for ratio, prompt, new, mc in [(0.5, 16384, 256, 8192), (0.3, 1000, 500, 1200), (0.9, 100, 50, 0),
                                   (0.5, 100, 50, 10_000)]:
        direct = _saving_by_steps(ratio, 2, prompt, new, mc)
        assert abs(auto.decode_saving(ratio, 2, prompt, new, mc) - direct) <= 1e-9 * max(direct, 1.0)
    assert auto.decode_saving(1.2, 2, 16384, 256, 0) == 0.0


def test_sparse_exactly_past_the_break_even():
    """The first new-token count whose saving exceeds the index, found by direct sums, is where
    the choice turns from dense to sparse."""
    prompt, ratio, mc = 16384, 0.5, 8192
    taus, costs = {0: [0.1, 0.2], 1: [0.1, 0.1]}, {0: ratio, 1: ratio}
    n = 1
    while _saving_by_steps(ratio, 2, prompt, n, mc) <= auto.PER_INDEXED * 2 * (prompt + n):
        n += 1
    assert auto.choose(Cfg, [0, 1], prompt, n - 1, mc, taus, costs).sparse_layers == []
    chosen = auto.choose(Cfg, [0, 1], prompt, n, mc, taus, costs)
    assert chosen.sparse_layers == [0, 1] and chosen.saving > chosen.index > 0


def test_each_refusal_keeps_the_layer_dense_and_says_why():
    taus = {0: [0.1, 0.1], 1: [0.1, None], 2: [0.1, 0.1], 3: [0.1, 0.1]}
    costs = {0: 0.3, 1: 0.3, 2: None, 3: 1.4}
    c = auto.choose(Cfg, [0, 1, 2, 3], 16384, 4096, 8192, taus, costs)
    assert c.sparse_layers == [0]
    none = auto.choose(Cfg, [1, 2, 3], 16384, 4096, 8192, taus, costs)
    assert none.sparse_layers == [] and "attends exactly (its calibration found no tau) on layers 1" in none.reason
    assert "no cost prediction kept with the taus on layers 2" in none.reason
    assert "does not cover the index on layers 3" in none.reason
    assert "no calibrated taus" in auto.choose(Cfg, [0], 16384, 4096, 8192, None, None).reason
    assert "below min_context" in auto.choose(Cfg, [0], 1000, 100, 8192, taus, costs).reason


def test_restricted_policy_is_the_checkpoint_attention_bit_for_bit():
    m = tiny_model("llama")
    pol = build_sparse_policy(m.config, SCSAConfig(min_context=0, calib_steps=0, dense_when_cheaper=False))
    none = auto.restrict(pol, [])
    assert not sparse_layers(none) and none.sparse_config is None
    one = auto.restrict(pol, [1])
    assert sparse_layers(one) == [1]
    ids = torch.randint(0, m.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))

    def run(policy):
        s = Session(m, policy)
        return torch.cat([s.prefill(ids[:, :30])[:, 0]] + [s.step(ids[0, t:t + 1]) for t in range(30, 40)])
    assert torch.equal(run(none), run(AttentionPolicy.from_config(m.config)))


def test_generate_auto_declines_then_engages_with_kept_taus(tmp_path, monkeypatch, capsys):
    """The real CLI on SmolLM2: without taus auto runs dense and says why; after a sparse run
    kept its taus (and a cost file predicting a saving), auto runs SCSA from the first step."""
    from longattn.cli.main import main
    from longattn.data import book_body
    import longattn.sparse.tau_cache as tau_cache
    monkeypatch.setattr(tau_cache, "cache_root", lambda: tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(book_body()[:4000])
    common = ["--sparse-min-context", "0", "--sparse-always", "--prompt-file", str(prompt), "--threads", "1",
              "--json"]

    def run(policy, n):
        capsys.readouterr()
        assert main(["generate", "--policy", policy, "--max-new-tokens", str(n)] + common) == 0
        out = capsys.readouterr()
        return json.loads(out.out.strip().splitlines()[-1]), out.err
    first, err = run("auto", 8)
    assert first["auto"]["sparse_layers"] == [] and "no calibrated taus" in first["auto"]["reason"]
    assert "-- policy auto: no calibrated taus" in err and "sparse" not in first
    calibrated, _ = run("sparse", 40)
    assert calibrated["sparse"]["taus"] == "calibrated in this run"
    files = sorted(p.name for p in (tmp_path / "taus").iterdir())
    assert len(files) == 2 and files[0].endswith(".cost.json")
    cost = tmp_path / "taus" / files[0]
    layers = json.loads(cost.read_text())
    assert set(layers) == {str(i) for i in range(30)}  # every layer's predicted ratio was kept
    cost.write_text(json.dumps({k: 0.05 for k in layers}))  # a layer 20x cheaper than its dense read
    engaged, err = run("auto", 100)
    assert engaged["auto"]["sparse_layers"] == list(range(30)), engaged["auto"]
    assert engaged["sparse"]["taus"] == "reused from the cache" and engaged["sparse"]["calibration_s"] == 0
    cost.write_text(json.dumps({k: 1.5 for k in layers}))  # dearer than the dense read: declined
    declined, _ = run("auto", 100)
    assert declined["auto"]["sparse_layers"] == [] and "does not cover" in declined["auto"]["reason"]


def test_auto_never_calibrates(capsys):
    from longattn.cli.main import main
    assert main(["generate", "--policy", "auto", "--sparse-calibrate", "--max-new-tokens", "1"]) == 2
    assert "--policy auto never calibrates" in capsys.readouterr().err
