"""Bad input gets one clear line on stderr, exit code 2, no traceback, nothing in the cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_dir


def run_cli(args, cache: Path, timeout=300):
    env = dict(os.environ, LONGATTN_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "longattn.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def assert_one_line_error(r, needle: str):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("longattn: error:"), lines[0]
    assert needle.lower() in lines[0].lower(), lines[0]


def cache_is_clean(cache: Path) -> bool:
    if not cache.exists():
        return True
    junk = [p for p in cache.rglob("*") if p.is_file() or p.name.startswith(".tmp-")]
    return not junk


def _hf_dir(tmp: Path, cfg: dict) -> Path:
    from safetensors.torch import save_file
    import torch
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file({"x": torch.zeros(1)}, str(tmp / "model.safetensors"))
    return tmp


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
    (["--window", "-3"], "non-negative"),
    (["--window", "4", "--sinks", "-1"], "non-negative"),
    (["--threads", "0"], "threads"),
    (["--temperature", "-1"], "temperature"),
    (["--weights", "fp8"], "unknown weight format"),
    (["--weights", "int8+int8:qkv"], "only int4"),
    (["--policy", "sparse", "--sparse-outliers", "-1"], "outliers must be >= 0"),
    (["--policy", "sparse", "--sparse-probe", "-2"], "probe_dims must be >= 0"),
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
