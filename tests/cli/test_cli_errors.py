"""Bad input gets one clear line on stderr, exit code 2, no traceback, nothing in the cache."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, cache_is_clean, hf_dir as _hf_dir, run_cli
from conftest import tiny_dir


def test_missing_file(tmp_path):
    r = run_cli(["generate", "--model", str(tmp_path / "nothing.gguf")], tmp_path / "c")
    assert_one_line_error(r, "not found")
    assert cache_is_clean(tmp_path / "c")


def test_unknown_model_name(tmp_path):
    r = run_cli(["generate", "--model", "llama-9000"], tmp_path / "c")
    assert_one_line_error(r, "unknown model")


def test_truncated_gguf(tmp_path):
    from longattn.checkpoint.bundled import bundled_path
    src = bundled_path("smollm2-135m")
    half = tmp_path / "half.gguf"
    with open(src, "rb") as f:
        half.write_bytes(f.read(src.stat().st_size // 2))
    r = run_cli(["generate", "--model", str(half), "--max-new-tokens", "1"], tmp_path / "c")
    assert_one_line_error(r, "truncated")
    assert cache_is_clean(tmp_path / "c")


def test_unsupported_architecture(tmp_path):
    d = _hf_dir(tmp_path / "gpt2", {"model_type": "gpt2", "n_layer": 2})
    r = run_cli(["generate", "--model", str(d)], tmp_path / "c")
    assert_one_line_error(r, "unsupported architecture")


def test_heads_not_divisible(tmp_path):
    cfg = json.loads((Path(tiny_dir("llama")) / "config.json").read_text())
    cfg.update(num_attention_heads=5, num_key_value_heads=2)
    d = _hf_dir(tmp_path / "bad", cfg)
    r = run_cli(["generate", "--model", str(d)], tmp_path / "c")
    assert_one_line_error(r, "not divisible")


@pytest.mark.parametrize("args,needle", [
    (["--window", "-3"], "--window must be >= 1"),
    (["--window", "4", "--sinks", "-1"], "non-negative"),
    (["--threads", "0"], "threads"),
    (["--temperature", "-1"], "temperature"),
    (["--weights", "fp8"], "unknown weight format"),
    (["--weights", "f32+int8:qkv"], "formats per kind"),
    (["--weights", "int4+int9:qkv"], "bad recipe part"),
    (["--policy", "sparse", "--sparse-outliers", "-1"], "outliers must be >= 0"),
    (["--policy", "sparse", "--sparse-probe", "-2"], "--sparse-probe must be >= 0"),
    (["--policy", "sparse", "--sparse-tolerance", "0"], "tolerance must be > 0"),
])
def test_impossible_settings(tmp_path, args, needle):
    r = run_cli(["generate", "--model", tiny_dir("llama"), "--max-new-tokens", "1", *args], tmp_path / "c")
    assert_one_line_error(r, needle)


def test_help_shows_defaults():
    r = subprocess.run([sys.executable, "-m", "longattn.cli.main", "generate", "--help"],
                       capture_output=True, text=True)
    out = " ".join(r.stdout.split())
    assert r.returncode == 0 and "--max-new-tokens MAX_NEW_TOKENS tokens to generate (default: 64)" in out, out


def test_serve_offers_the_sparse_policy_but_not_auto(tmp_path):
    """serve lists SCSA's policy and flags; ``--policy auto`` (which weighs one request's length)
    and ``--sparse-calibrate`` (a generate run's) are not its options: one line each."""
    r = subprocess.run([sys.executable, "-m", "longattn.cli.main", "serve", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "sparse" in r.stdout and "--sparse-tolerance" in r.stdout, r.stdout
    for args in (["--policy", "auto"], ["--sparse-calibrate"]):
        r = run_cli(["serve", "--model", tiny_dir("llama"), *args], tmp_path / "c")
        assert_one_line_error(r, args[0])