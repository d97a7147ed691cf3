"""The cache never hands out a damaged or half-written entry: pinned checksums for the
bundled models, entries published once and kept while read, stale temporaries of dead
processes removed, an unusable cache replaced by a private one before any work."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from longattn.checkpoint import bundled, digest, paths
from longattn.errors import LongattnError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LONGATTN_CACHE", str(root))
    monkeypatch.setattr(paths, "_roots", {})
    return root


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("name", list(bundled.BUNDLED))
def test_pinned_sums_match_the_installed_models(name):
    """Hashes each installed model once per installation (the memo remembers a match)."""
    b = bundled.BUNDLED[name]
    if bundled.part_paths(b) is None:
        pytest.skip(f"{name} is not installed")
    parts, d = bundled.verified_parts(b)
    assert d == b.sha256
    assert digest._load_memo()[digest._memo_key(parts)] == b.sha256


def test_damaged_bundled_model_refused_and_match_remembered(cache, tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    import hashlib
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    b = bundled.Bundled("toy", ("toy-pkg",), ("toy",), ("model.gguf",), good, "llama", 1, "", "model.gguf")
    monkeypatch.setattr(bundled, "part_paths", lambda _: [f])
    assert bundled.verified_parts(b) == ([f], good)
    hashed, real = [], hashlib.sha256
    monkeypatch.setattr(digest.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    bundled.verified_parts(b)
    assert not hashed, "a verified installation was hashed again"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(LongattnError, match="do not match the pinned SHA-256.*--force-reinstall"):
        bundled.verified_parts(b)


def test_second_publisher_keeps_the_first_entry(cache):
    """Two processes finishing the same entry: the second keeps the first's (which a reader
    may hold open) and discards its own; nothing temporary is left."""
    target = cache / "converted" / "k"
    with paths.atomic_dir(target) as a:
        (a / "model.safetensors").write_text("first")
    reader = open(target / "model.safetensors")
    with paths.atomic_dir(target, complete=lambda p: (p / "model.safetensors").exists()) as b:
        (b / "model.safetensors").write_text("second")
    assert reader.read() == "first" and (target / "model.safetensors").read_text() == "first"
    assert not list(target.parent.glob(".tmp-*"))


def test_incomplete_entry_replaced(cache):
    target = cache / "converted" / "k"
    (target / "tokenizer").mkdir(parents=True)  # an entry of an older layout, missing its weights
    with paths.atomic_dir(target, complete=lambda p: (p / "model.safetensors").exists()) as t:
        (t / "model.safetensors").write_text("new")
    assert (target / "model.safetensors").read_text() == "new"
    assert not list(target.parent.glob(".tmp-*"))


def test_stale_temporaries_of_dead_processes_removed(cache):
    conv = cache / "converted"
    conv.mkdir(parents=True)
    dead = conv / f".tmp-{paths.owner_tag(_dead_pid())}-abc"
    (dead / "x").parent.mkdir()
    (dead / "x").write_bytes(b"half")
    live = conv / f"{paths.temp_prefix()}def"
    live.mkdir()
    reused = conv / f".tmp-{paths._host()}-{os.getpid()}-1-ghi"  # our pid, another start time
    reused.mkdir()
    old = conv / ".tmp-legacy"
    old.mkdir()
    os.utime(old, (0, 0))
    paths.cache_root()
    assert not dead.exists() and not reused.exists() and not old.exists()
    assert live.exists(), "a live process's temporary was removed"


@pytest.mark.parametrize("layout", ["file", "under a file", "unwritable"])
def test_unusable_cache_falls_back_with_a_warning(tmp_path, monkeypatch, layout):
    (tmp_path / "f").write_text("x")
    where = {"file": tmp_path / "f", "under a file": tmp_path / "f" / "c",
             "unwritable": Path("/proc/longattn-cache")}[layout]
    monkeypatch.setenv("LONGATTN_CACHE", str(where))
    monkeypatch.setattr(paths, "_roots", {})
    monkeypatch.setattr(paths.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        root = paths.cache_root()
    assert root.parent == tmp_path / "tmp" and root.is_dir()
    assert len(w) == 1 and "cache directory unusable" in str(w[0].message)
    assert (tmp_path / "f").read_text() == "x"


def test_clear_cache_refuses_unwritable(monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE", "/proc/self")
    with pytest.raises(LongattnError, match="cannot clear the cache"):
        paths.clear_cache()


def test_damaged_converted_entry_is_converted_again(cache, tmp_path):
    """A byte flipped in a cached conversion is caught by the entry's checksum and the entry
    converted again (with a warning), instead of being used."""
    import torch
    from tiny_gguf import write_tiny_gguf
    from longattn.checkpoint.load import load_checkpoint
    src = write_tiny_gguf(tmp_path / "m.gguf")
    first = {k: v.clone() for k, v in load_checkpoint(str(src), progress=False,
                                                     with_tokenizer=False).state_dict.items()}
    (entry,) = (cache / "converted").iterdir()
    config = entry / "config.json"
    data = bytearray(config.read_bytes())
    data[-10] ^= 0x01
    config.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="is damaged .* converting again"):
        again = load_checkpoint(str(src), progress=False, with_tokenizer=False)
    assert all(torch.equal(first[k], again.state_dict[k]) for k in first)
    assert not list(cache.rglob(".tmp-*"))
