"""Sweeps (lab/sweep.py): the same results serially, in 2 processes and on Ray; resume after a
kill; the intervals (lab/stats.py) against their formulas; the sweep commands and `report`."""

from __future__ import annotations

import json
import shutil
import string
import sys

import numpy as np
import pytest

from longattn.lab import stats


# ------------------------------------------------------------------------------ intervals

def _wilson_roots(k: int, n: int, z: float) -> tuple:
    # The Wilson bounds are the p solving n (k/n - p)^2 = z^2 p (1 - p):
    # (n + z^2) p^2 - (2k + z^2) p + k^2 / n = 0.
    r = np.sort(np.roots([n + z * z, -(2 * k + z * z), k * k / n]).real)
    return float(r[0]), float(r[1])


@pytest.mark.parametrize("k", [0, 5, 10])
def test_wilson_matches_closed_form(k):
    z = stats.z_value(0.95)
    assert z == pytest.approx(1.959963984540054, abs=1e-12)
    lo, hi = stats.wilson_interval(k, 10)
    want = _wilson_roots(k, 10, z)
    assert lo == pytest.approx(want[0], abs=1e-12) and hi == pytest.approx(want[1], abs=1e-12)
    if k == 0:
        assert lo == 0.0 and hi == pytest.approx(z * z / (10 + z * z), abs=1e-15)
    if k == 10:
        assert hi == 1.0 and lo == pytest.approx(10 / (10 + z * z), abs=1e-15)
    if k == 5:
        assert (lo + hi) / 2 == pytest.approx(0.5, abs=1e-15)  # symmetric at p = 1/2


def test_bootstrap_of_a_constant_is_that_constant_with_zero_width():
    lo, hi = stats.mean_interval([0.7] * 25)
    assert lo == hi == pytest.approx(0.7, abs=1e-15)
    lo, hi = stats.ratio_interval([3.0] * 8, [2.0] * 8)  # bits 3 over 2 tokens per passage
    assert lo == hi == 1.5


def test_paired_delta_of_identical_arms_is_zero():
    rng = np.random.default_rng(1)
    bits, counts = rng.uniform(10, 40, 12), rng.integers(5, 20, 12).astype(float)
    assert stats.paired_delta_interval(bits, counts, bits, counts) == (0.0, 0.0)
    # an arm that adds 0.25 bits per token on every passage: exactly +0.25, zero width
    lo, hi = stats.paired_delta_interval(bits, counts, bits + 0.25 * counts, counts)
    assert lo == pytest.approx(0.25, abs=1e-12) and hi == pytest.approx(0.25, abs=1e-12)
    # unpaired, the same shift would inherit the spread between passages
    assert np.ptp(bits / counts) > 0.5


def test_bootstrap_is_seeded_and_covers_the_two_point_extremes():
    vals = [0.0, 1.0] * 3
    assert stats.mean_interval(vals, seed=3) == stats.mean_interval(vals, seed=3)
    # n = 2: resampled means are 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% percentiles of 2000 resamples are the extremes 0 and 1
    assert stats.mean_interval([0.0, 1.0]) == (0.0, 1.0)


def test_score_interval_picks_wilson_for_binary_scores():
    lo, hi, how = stats.score_interval([1, 0, 1, 1])
    assert how == "wilson" and (lo, hi) == stats.wilson_interval(3, 4)
    assert stats.score_interval([0.25, 0.5, 1.0])[2] == "bootstrap"


# ------------------------------------------------------------------------------ tiny text model

def _char_tokenizer(path) -> None:
    """A character-level tokenizer with the tiny model's 96 ids (unknown characters -> id 0)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    punct = [c for c in string.punctuation if c not in "{}~"]
    vocab = ["[UNK]", "{", "}", "\n", " ", *string.digits, *string.ascii_letters, *punct]
    assert len(vocab) == 96
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from conftest import tiny_dir
    d = tmp_path_factory.mktemp("tiny-text") / "model"
    shutil.copytree(tiny_dir("llama"), d)
    _char_tokenizer(d)
    return str(d)


def _grid(model):
    from longattn.lab.quality import quality_cells
    from longattn.lab.retrieval import retrieval_cells
    from longattn.checkpoint import load_checkpoint
    cfg = load_checkpoint(model, with_tokenizer=False).config
    specs = [("full attention", {"mode": "checkpoint"}), ("window 16", {"mode": "window", "window": 16})]
    r = retrieval_cells(model, "f32", ["passkey"], [40, 150], specs, 2, 400, 7, 6, 64)
    q = quality_cells(model, "f32", cfg, 2, 48, [8], [0, 2])
    return [c for c, _ in r] + [c for c, _, _ in q]


def _results(records):
    return {r["key"]: r["result"] for r in records}


def test_workers_and_ray_give_the_serial_results(text_model, tmp_path):
    from longattn.lab.sweep import read_records, run_sweep
    cells = _grid(text_model)
    assert len({c.key for c in cells}) == len(cells) == 8 + 6
    serial = run_sweep(cells, tmp_path / "serial.jsonl", progress=False)
    assert [r["key"] for r in serial] == [c.key for c in cells]
    two = run_sweep(cells, tmp_path / "two.jsonl", workers=2, progress=False)
    assert _results(two) == _results(serial)
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        on_ray = run_sweep(cells, tmp_path / "ray.jsonl", ray="", progress=False)
    finally:
        ray.shutdown()
    assert _results(on_ray) == _results(serial)
    assert _results(read_records(tmp_path / "ray.jsonl").values()) == _results(serial)
    # the grid is not trivial: the window changes some prediction or some passage's bits
    by = {json.dumps(r["cell"]["params"], sort_keys=True): r["result"] for r in serial}
    assert len({json.dumps(v, sort_keys=True) for v in by.values()}) > len(by) // 2


def test_resume_recomputes_only_what_was_lost(text_model, tmp_path):
    from longattn.lab.sweep import model_context, run_sweep
    cells = _grid(text_model)[:8]
    path = tmp_path / "cells.jsonl"
    first = run_sweep(cells, path, progress=False)
    lines = path.read_text().splitlines()
    # a kill after 3 cells, in the middle of writing the 4th line
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:25])
    again = run_sweep(cells, path, progress=False)
    after = path.read_text().splitlines()
    assert after[:3] == lines[:3] and len(after) == len(cells)  # torn line cut, 5 new lines
    assert sorted(json.loads(l)["key"] for l in after[3:]) == sorted(json.loads(l)["key"] for l in lines[3:])
    assert _results(again) == _results(first)
    # a complete file: nothing runs, not even a model load
    model_context.cache_clear()
    run_sweep(cells, path, progress=False)
    assert model_context.cache_info().misses == 0 and path.read_text().splitlines() == after


# ------------------------------------------------------------------------------ commands

def test_cli_sweeps_resume_and_report(text_model, tmp_path, capsys):
    from longattn.cli.main import main
    out = tmp_path / "lab"
    args = ["retrieval", "--model", text_model, "--tasks", "passkey", "--distances", "40", "--length", "400",
            "--samples", "3", "--window", "16", "--sinks", "2", "--max-new-tokens", "4", "--threads", "1",
            "--out", str(out / "retrieval"), "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["n"] for r in doc["rows"]] == [3, 3, 3]
    for r in doc["rows"]:
        assert r["interval"] == "wilson"
        assert (r["score_lo"], r["score_hi"]) == tuple(round(100 * v, 2) for v in stats.wilson_interval(
            round(r["score"] * 3 / 100), 3))
    assert doc["rows"][0]["delta_vs_baseline"] == 0.0 and (doc["rows"][0]["delta_lo"], doc["rows"][0]["delta_hi"]) == (0, 0)
    cells = out / "retrieval" / "retrieval_model.cells.jsonl"
    assert len(cells.read_text().splitlines()) == 9
    assert main(args) == 0  # a rerun resumes: nothing new
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == doc["rows"]
    assert len(cells.read_text().splitlines()) == 9
    assert main(["quality", "--model", text_model, "--passages", "3", "--length", "40", "--windows", "8,64",
                 "--sinks", "0", "--threads", "1", "--out", str(out / "quality"), "--json"]) == 0
    q = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    b, (w8, w64) = q["baseline"], q["rows"]
    assert w64["bits_per_token"] == b["bits_per_token"] and w64["delta_ci"] == [0.0, 0.0]  # W >= length
    assert b["ci"][0] <= b["bits_per_token"] <= b["ci"][1] and w8["delta_ci"][0] <= w8["delta_bits"] <= w8["delta_ci"][1]
    for sub, stem in (("retrieval", "retrieval_model"), ("quality", "quality_model")):
        for ext in ("json", "png", "md"):
            assert (out / sub / f"{stem}.{ext}").exists(), (sub, ext)
    assert main(["report", str(out)]) == 0
    page = (out / "report.md").read_text()
    assert "## Retrieval: model" in page and "## Quality: model" in page
    assert "](quality/quality_model.png)" in page and "](retrieval/retrieval_model.png)" in page
    assert "[95% CI]" in page


def test_cli_quality_and_retrieval_on_quantized_caches(text_model, tmp_path, capsys):
    """--kv runs every arm (the baseline too) on caches of that format: a window that never
    wraps (rings) still equals the baseline (growing caches) bit for bit, and the format's
    rounding moves bits/token a little from f32's."""
    from longattn.cli.main import main
    base = ["quality", "--model", text_model, "--passages", "2", "--length", "40", "--windows", "8,64",
            "--sinks", "0", "--threads", "1", "--json"]
    docs = {}
    for kv in ("f32", "int8"):
        assert main(base + ["--kv", kv, "--out", str(tmp_path / kv)]) == 0
        docs[kv] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    q = docs["int8"]
    assert q["kv"] == "int8" and q["rows"][1]["bits_per_token"] == q["baseline"]["bits_per_token"]
    assert 0 < abs(q["baseline"]["bits_per_token"] - docs["f32"]["baseline"]["bits_per_token"]) < 0.1
    r = ["retrieval", "--model", text_model, "--tasks", "passkey", "--distances", "40", "--length", "400",
         "--samples", "1", "--window", "16", "--sinks", "2", "--max-new-tokens", "2", "--threads", "1",
         "--out", str(tmp_path / "r"), "--json", "--kv", "bf16"]
    assert main(r) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kv"] == "bf16"


def _one_error_line(capsys) -> str:
    lines = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("longattn: error:"), lines
    return lines[0]


def test_cli_ray_missing_and_bad_workers_are_one_line(text_model, tmp_path, capsys, monkeypatch):
    from longattn.cli.main import main
    base = ["quality", "--model", text_model, "--passages", "1", "--length", "16", "--windows", "4", "--sinks", "0",
            "--out", str(tmp_path / "o")]
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as when it is not installed
    assert main(base + ["--ray"]) == 2
    assert "pip install" in _one_error_line(capsys)
    assert main(base + ["--workers", "0"]) == 2
    assert "--workers" in _one_error_line(capsys)
    assert main(base + ["--workers", "2", "--ray", "auto"]) == 2
    assert "not both" in _one_error_line(capsys)
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert main(["report", str(tmp_path)]) == 2
    assert "no lab results" in _one_error_line(capsys)


def test_policy_specs_build_the_policies_they_name():
    from conftest import tiny_model
    from longattn.lab.sweep import build_policy
    cfg = tiny_model("gemma3").config  # trained windows on local layers, global every 3rd
    assert build_policy(cfg, {"mode": "checkpoint"}).windows == list(cfg.layer_windows)
    pol = build_policy(cfg, {"mode": "global", "window": 4, "sinks": 2})
    assert pol.windows == [w or 4 for w in cfg.layer_windows] and {lp.sinks for lp in pol.layers} == {2}
    sparse = build_policy(cfg, {"mode": "sparse", "scsa": {"min_context": 16}})
    kinds = [lp.kind for lp in sparse.layers]
    assert kinds == ["sparse" if w is None else "window" for w in cfg.layer_windows]
    assert sparse.sparse_config.min_context == 16
