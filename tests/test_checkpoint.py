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
