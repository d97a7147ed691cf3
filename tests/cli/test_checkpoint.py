"""Conversion cache: written atomically, keyed by the source file, reused on reload."""

import os
import shutil
import time

import pytest

from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.bundled import BUNDLED, bundled_path, installed_size

pytestmark = pytest.mark.real


def test_changed_source_is_reconverted(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    converted = tmp_path / "cache" / "converted"
    src = tmp_path / "m.gguf"
    shutil.copy(bundled_path("smollm2-135m"), src)
    a = load_checkpoint(str(src), progress=False)
    assert len(list(converted.iterdir())) == 1
    t0 = time.perf_counter()
    b = load_checkpoint(str(src), progress=False)
    reload_s = time.perf_counter() - t0
    assert len(list(converted.iterdir())) == 1
    assert a.config == b.config
    # The same content at another path, or touched, is the same entry: a fresh virtual
    # environment must not convert (and store) every model again.
    other = tmp_path / "elsewhere.gguf"
    shutil.copy(src, other)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    load_checkpoint(str(other), progress=False, with_tokenizer=False)
    load_checkpoint(str(src), progress=False, with_tokenizer=False)
    assert len(list(converted.iterdir())) == 1
    with open(src, "ab") as f:  # changed content (trailing bytes: still a valid GGUF)
        f.write(bytes(32))
    load_checkpoint(str(src), progress=False, with_tokenizer=False)
    assert len(list(converted.iterdir())) == 2
    assert not list((tmp_path / "cache").rglob(".tmp-*"))
    print(f"reload from the conversion cache: {reload_s:.2f} s")


def test_bundled_models_listed_and_located():
    for name, b in BUNDLED.items():
        assert installed_size(b) > 50 * 2**20, name
    g = bundled_path("gemma3-270m")  # assembled from 4 chunks, SHA-256 checked
    assert g.stat().st_size == installed_size(BUNDLED["gemma3-270m"])


def test_models_cache_shows_and_clears_the_cache_dir(tmp_path):
    import json
    import subprocess
    import sys
    cache = tmp_path / "cache"
    (cache / "converted" / "abc").mkdir(parents=True)
    (cache / "converted" / "abc" / "model.safetensors").write_bytes(bytes(3000))
    (cache / "kernels").mkdir()
    (cache / "kernels" / "k.so").write_bytes(bytes(500))
    (cache / "digests.json").write_text("{}")
    env = dict(os.environ, LONGATTN_CACHE=str(cache))

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "longattn.cli.main", "models", *args, "--json"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    shown = run("--cache")["cache"]
    assert shown["entries"] == {"converted": 3000, "digests.json": 2, "kernels": 500}
    assert run("--clear-cache") == {"cache_dir": str(cache), "freed_bytes": 3502}
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
def test_models_reports_the_kv_bytes_a_full_context_holds_in_each_format(name):
    """``longattn models`` sizes the KV cache from published shapes: they must be the bundled
    files' own, and the bytes those of the pool's blocks (windowed layers holding their window)."""
    from longattn.cache.kv_format import KV_FORMATS
    from longattn.cache.paged import BlockPool
    from longattn.checkpoint import load_checkpoint
    from longattn.cli.models import SHAPES, kv_bytes
    from longattn.lab.arithmetic import PUBLISHED_CONFIGS
    cfg = load_checkpoint(name, progress=False, read_weights=False).config
    row = PUBLISHED_CONFIGS[SHAPES[name]]
    assert (row.num_layers, row.num_kv_heads, row.head_dim) == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert list(row.layer_windows) == list(cfg.layer_windows)
    got = kv_bytes(name, 1000)
    for fmt, dtype in KV_FORMATS.items():
        per_token = BlockPool.bytes_per_block(1, cfg.num_kv_heads, cfg.head_dim, dtype)
        held = sum(min(1000, w) if w else 1000 for w in cfg.layer_windows)
        assert got[fmt] == per_token * held
