"""Writing into the cache and clearing it while other runs use it.

A write that fails for want of room or permission ends in one CacheWriteError naming the cache
directory and what to do, with nothing half-written left. ``clear_cache`` removes every entry
but those a live process reads (a shared lock, ``hold_entry``) or writes (its temporary), and
names what it kept; a run whose entry was kept goes on.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_dir
from longattn.checkpoint import load, paths
from longattn.checkpoint.load import load_checkpoint
from longattn.checkpoint.paths import CacheWriteError, atomic_dir, atomic_write_path, clear_cache, hold_entry
from longattn.checkpoint.prepared import prepared_model

IDS = torch.tensor([[3, 17, 42, 5, 88, 61, 9]])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LONGATTN_CACHE", str(root))
    monkeypatch.setattr(paths, "_roots", {})
    return root


def _left(cache: Path) -> list:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []


# ---------------------------------------------------------------- failed writes

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_write_without_room_or_permission_is_one_error_naming_the_cache(cache, kind, code):
    target = cache / "converted" / "k"
    with pytest.raises(CacheWriteError) as e:
        with (atomic_dir(target) if kind == "dir" else atomic_write_path(target)) as tmp:
            (tmp / "half" if kind == "dir" else tmp).write_bytes(b"half")
            raise OSError(code, os.strerror(code))
    msg = str(e.value)
    assert msg.startswith(f"cannot write converted/k into the cache directory {cache}: {os.strerror(code)}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        assert "free there); free some space, or set LONGATTN_CACHE" in msg
    else:
        assert msg.endswith("set LONGATTN_CACHE to a writable directory")
    assert e.value.errno == code and isinstance(e.value, OSError)
    assert _left(cache) == ["converted"]


def test_a_rust_library_out_of_room_is_one_error_too(cache, tmp_path):
    """tokenizers (Rust) reports a full disk as a bare Exception carrying ``(os error 28)``:
    the conversion of a GGUF, whose tokenizer it writes, ends in the same one line."""
    from tiny_gguf import write_tiny_gguf
    ck = load_checkpoint(str(write_tiny_gguf(tmp_path / "m.gguf")), progress=False, read_weights=False)

    def full(*a, **k):
        raise Exception("No space left on device (os error 28)")
    hf = type(ck.tokenizer.hf)  # transformers' tokenizer writes the files (CheckpointTokenizer hands it on)
    hf.save_pretrained, real = full, hf.save_pretrained
    try:
        with pytest.raises(CacheWriteError, match=f"cannot write converted/.* into the cache directory {cache}"):
            ck.state_dict  # noqa: B018 -- reading every weight commits the conversion
    finally:
        hf.save_pretrained = real
    assert _left(cache) == ["converted"]


def test_other_failures_pass_unchanged(cache, tmp_path):
    """Only a write into the cache is reported as one: a source that cannot be read while an
    entry is written keeps its own error, and so does anything else."""
    with pytest.raises(PermissionError, match="source.gguf"):
        with atomic_write_path(cache / "sources" / "x"):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "source.gguf"))
    with pytest.raises(ValueError):
        with atomic_dir(cache / "converted" / "k"):
            raise ValueError("not about the disk")
    assert _left(cache) == ["converted", "sources"]


def test_the_digest_memo_is_skipped_on_a_full_disk(cache, monkeypatch):
    """The memo only saves hashing time: a disk without room leaves it unwritten, no error."""
    from longattn.checkpoint import digest
    (cache / "f").parent.mkdir(parents=True)
    (cache / "f").write_bytes(b"x")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Path, "write_text", full)
    digest.remember_digest([cache / "f"], "abc")
    assert _left(cache) == ["f"]


# ---------------------------------------------------------------- clearing while in use

def _entry(cache: Path, name: str) -> Path:
    d = cache / name
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(bytes(1000))
    return d


def test_clear_keeps_an_entry_a_process_holds_and_names_it(cache):
    held, free = _entry(cache, "prepared/aaaa"), _entry(cache, "prepared/bbbb")
    (cache / "digests.json").write_text("{}")
    hold = hold_entry(held)
    assert hold is not None
    freed, kept = clear_cache()
    assert kept == ["prepared/aaaa"] and freed == 1002
    assert (held / "model.pt").read_bytes() == bytes(1000) and not free.exists()
    assert _left(cache) == ["prepared", "prepared/aaaa", "prepared/aaaa/model.pt"]
    hold.close()
    assert clear_cache() == (1000, []) and _left(cache) == []


def test_clear_keeps_a_live_processs_temporary(cache):
    """An entry being written (its temporary, owned by a live process) is left to finish."""
    target = cache / "prepared" / "k"
    with atomic_dir(target) as tmp:
        (tmp / "model.pt").write_bytes(b"weights")
        freed, kept = clear_cache()
        assert kept == [str(tmp.relative_to(cache))]
        (tmp / "recipe.json").write_text("{}")
    assert (target / "model.pt").read_bytes() == b"weights"


def test_a_held_entry_taken_out_meanwhile_reads_as_missing(cache):
    entry = _entry(cache, "prepared/k")
    clear_cache()
    assert hold_entry(entry) is None
    replaced = _entry(cache, "prepared/k")
    hold = hold_entry(replaced)
    assert hold is not None and clear_cache()[1] == ["prepared/k"]
    hold.close()


def test_a_loaded_model_keeps_its_prepared_entry_through_a_clear(cache):
    """The model maps its prepared weights: clearing leaves them (removing them would free
    nothing while they are mapped), the model runs on, and once it is gone they go too."""
    d = tiny_dir("llama")
    prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    model = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    want = model(IDS)
    (entry,) = (cache / "prepared").iterdir()
    freed, kept = clear_cache()
    assert kept == [f"prepared/{entry.name}"] and (entry / "model.pt").exists()
    assert torch.equal(model(IDS), want)
    del model
    gc.collect()
    assert clear_cache()[1] == [] and not (cache / "prepared").exists()


def test_a_source_assembled_in_the_cache_is_kept_while_its_checkpoint_lives(cache, tmp_path, monkeypatch):
    """A bundled model's parts assembled into ``sources/`` are read again whenever its
    weights are prepared; a clear between loading and preparing leaves the file to the run."""
    from tiny_gguf import write_tiny_gguf
    (cache / "sources").mkdir(parents=True)
    src = write_tiny_gguf(cache / "sources" / "0123-tiny.gguf")
    monkeypatch.setitem(load.BUNDLED, "tiny", None)
    monkeypatch.setattr(load, "resolve_model", lambda name: (name, src))
    ck = load_checkpoint("tiny", progress=False, read_weights=False)
    freed, kept = clear_cache()
    assert "sources/0123-tiny.gguf" in kept and src.exists()
    assert prepared_model(ck, "int8", progress=False)(torch.tensor([[1, 5, 9, 2]])).isfinite().all()
    del ck
    gc.collect()
    assert "sources/0123-tiny.gguf" not in clear_cache()[1] and not src.exists()


def test_cli_clear_cache_says_what_it_kept(cache):
    entry = _entry(cache, "prepared/aaaa")
    env = dict(os.environ, LONGATTN_CACHE=str(cache))
    with hold_entry(entry):
        r = subprocess.run([sys.executable, "-m", "longattn.cli.main", "models", "--clear-cache", "--json"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert "kept 1 in use by running processes (clear again once they end): prepared/aaaa" in out
    assert json.loads(out[-1]) == {"cache_dir": str(cache), "freed_bytes": 0, "kept_in_use": ["prepared/aaaa"]}
    assert (entry / "model.pt").exists()
