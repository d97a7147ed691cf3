"""Prepared weights: the cached, memory-mapped quantized model is the model build_model makes.

Equality is exact (``torch.equal`` of the logits): the prepared state holds the very tensors
the quantized model multiplies by. The cache behaves like the conversion cache: a killed
build leaves nothing in place, a damaged entry is rebuilt, and a changed source or format
gets its own entry; a hit never reads the float32 weights.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_dir
from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.paths import CacheWriteError
from longattn.checkpoint.prepared import MODEL_FILE, prepared_model
from longattn.errors import LongattnError
from longattn.models import build_model
from longattn.models.prepared import from_prepared
from longattn.models.weights import parse_recipe

IDS = torch.tensor([[3, 17, 42, 5, 88, 61, 9, 30, 2, 77, 14]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private, empty cache for one test."""
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entries(cache: Path) -> list:
    d = cache / "prepared"
    return sorted(p for p in d.iterdir()) if d.exists() else []


def _maps(path: Path) -> bool:
    """This process has ``path`` memory-mapped."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3", "gpt_oss"])
@pytest.mark.parametrize("recipe", ["int8", "int4", "bf16", "int4+int8:embed", "int5+int8:qkv+int4:gate_up"])
def test_prepared_model_equals_built(family, recipe, cache):
    d = tiny_dir(family)
    ck = load_checkpoint(d, with_tokenizer=False)
    fmt, kinds = parse_recipe(recipe)
    want = build_model(ck.config, ck.state_dict, weights=fmt, kinds=kinds)(IDS)
    first = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), recipe, progress=False)
    assert torch.equal(first(IDS), want)
    (entry,) = _entries(cache)
    second = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), recipe, progress=False)
    assert torch.equal(second(IDS), want)
    assert second.weights == first.weights


def test_a_hit_maps_the_file_and_never_reads_float32(cache):
    d = tiny_dir("llama")
    prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    ck = load_checkpoint(d, with_tokenizer=False, read_weights=False)

    def refuse():
        raise AssertionError("the float32 weights were read on a cache hit")
    ck._weights = refuse
    m = prepared_model(ck, "int8", progress=False)
    (entry,) = _entries(cache)
    assert _maps(entry / MODEL_FILE)
    assert m.model.layers[0].self_attn.qkv.qweight.dtype == torch.int8


def test_real_model_prepared_equals_built():
    """SmolLM2 in the default cache: int8 prepared == int8 built, bit for bit."""
    ck = load_checkpoint("smollm2-135m", progress=False)
    want = build_model(ck.config, ck.state_dict, weights="int8")(IDS)
    for _ in range(2):  # the first call may build the entry, the second maps it
        m = prepared_model(load_checkpoint("smollm2-135m", progress=False, read_weights=False), "int8",
                           progress=False)
        assert torch.equal(m(IDS), want)


def test_format_and_source_get_their_own_entries(cache):
    a, b = tiny_dir("llama", seed=0), tiny_dir("llama", seed=1)
    for d, recipe in [(a, "int8"), (a, "int4"), (b, "int8")]:
        prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), recipe, progress=False)
    assert len(_entries(cache)) == 3
    ck = load_checkpoint(b, with_tokenizer=False)
    want = build_model(ck.config, ck.state_dict, weights="int8")(IDS)
    got = prepared_model(load_checkpoint(b, with_tokenizer=False, read_weights=False), "int8", progress=False)
    assert torch.equal(got(IDS), want)


def test_a_changed_source_file_is_prepared_again(cache, tmp_path):
    import shutil
    d = tmp_path / "model"
    shutil.copytree(tiny_dir("llama", seed=0), d)
    prepared_model(load_checkpoint(str(d), with_tokenizer=False, read_weights=False), "int8", progress=False)
    for f in d.glob("*.safetensors"):
        f.unlink()
    for f in Path(tiny_dir("llama", seed=2)).glob("*.safetensors"):
        shutil.copy(f, d / f.name)
    ck = load_checkpoint(str(d), with_tokenizer=False)
    want = build_model(ck.config, ck.state_dict, weights="int8")(IDS)
    got = prepared_model(load_checkpoint(str(d), with_tokenizer=False, read_weights=False), "int8",
                         progress=False)
    assert torch.equal(got(IDS), want)
    assert len(_entries(cache)) == 2


def test_a_killed_build_leaves_nothing(cache, monkeypatch):
    d = tiny_dir("llama")

    def killed(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    assert _entries(cache) == []
    monkeypatch.undo()
    monkeypatch.setenv("LONGATTN_CACHE", str(cache))
    ck = load_checkpoint(d, with_tokenizer=False)
    want = build_model(ck.config, ck.state_dict, weights="int8")(IDS)
    got = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    assert torch.equal(got(IDS), want)
    assert len(_entries(cache)) == 1


def test_a_damaged_entry_is_prepared_again(cache):
    d = tiny_dir("llama")
    prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    (entry,) = _entries(cache)
    f = entry / MODEL_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new stat: hashed again
    ck = load_checkpoint(d, with_tokenizer=False)
    want = build_model(ck.config, ck.state_dict, weights="int8")(IDS)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8",
                             progress=False)
    assert any("damaged" in str(x.message) for x in w)
    assert torch.equal(got(IDS), want)


def test_a_byte_changed_in_place_is_caught_on_every_load(cache):
    """Damage that keeps the file's size and mtime, which no memo keyed by them can see, is
    caught by the checksum each load checks: a warning, and the entry is prepared again."""
    from longattn.models.prepared import from_prepared
    d = tiny_dir("llama")
    ck = load_checkpoint(d, with_tokenizer=False)
    want = build_model(ck.config, ck.state_dict, weights="int8")(IDS)
    for _ in range(2):  # written, then mapped (and checked) once
        prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8", progress=False)
    (entry,) = _entries(cache)
    f = entry / MODEL_FILE
    st = f.stat()
    row = torch.load(f)["model.layers.0.self_attn.qkv.qweight"][5].numpy().tobytes()
    where = f.read_bytes().index(row) + 7  # one int8 weight of layer 0's q projection
    with open(f, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)[0]
        fh.seek(where)
        fh.write(bytes([byte ^ 0x40]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    damaged = from_prepared(ck.config, torch.load(f), "int8")
    assert not torch.equal(damaged(IDS), want), "the damage would not change the output"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8",
                             progress=False)
    assert [x for x in w if "are damaged" in str(x.message) and "preparing again" in str(x.message)]
    assert torch.equal(got(IDS), want)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        again = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "int8",
                               progress=False)
    assert not [x for x in w if "damaged" in str(x.message)] and torch.equal(again(IDS), want)


class _Full:
    """A file on a disk that is full (or a quota spent, or read-only): every write fails."""

    def __init__(self, f, code: int):
        self.f, self.code = f, code

    def write(self, data):
        raise OSError(self.code, os.strerror(self.code))

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_a_failed_write_while_preparing_is_one_error_naming_the_cache(cache, monkeypatch, code):
    """torch.save's writes fail as a full disk's would: one CacheWriteError naming the cache
    directory and LONGATTN_CACHE (and the free space where room is the trouble), nothing left."""
    real = torch.save

    def save(obj, f, **kw):  # torch.save as ever, onto a disk that takes no more
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as fh:
                return real(obj, _Full(fh, code), **kw)
        return real(obj, _Full(f, code), **kw)
    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(CacheWriteError) as e:
        prepared_model(load_checkpoint(tiny_dir("llama"), with_tokenizer=False, read_weights=False), "int8",
                       progress=False)
    msg = str(e.value)
    assert "\n" not in msg and f"into the cache directory {cache}:" in msg and "LONGATTN_CACHE" in msg
    assert os.strerror(code) in msg and (("free there" in msg) == (code in (errno.ENOSPC, errno.EDQUOT)))
    assert _entries(cache) == [] and not list(cache.rglob(".tmp-*"))


def test_state_of_another_model_is_refused():
    a = load_checkpoint(tiny_dir("llama"), with_tokenizer=False)
    b = load_checkpoint(tiny_dir("gemma2"), with_tokenizer=False)
    state = build_model(b.config, b.state_dict, weights="int8").state_dict()
    with pytest.raises(LongattnError, match="do not match"):
        from_prepared(a.config, state, "int8")


def test_f32_is_built_from_the_checkpoint(cache):
    d = tiny_dir("llama")
    m = prepared_model(load_checkpoint(d, with_tokenizer=False, read_weights=False), "f32", progress=False)
    assert m.weights == "f32" and _entries(cache) == []


def _prepare_tracking_float32(ck, recipe: str) -> tuple:
    """``(model, matrices read, most float32 matrices held at once, matrices per block)`` of
    preparing ``ck``: when a matrix is read, how many matrices read before it still hold
    their memory."""
    from torch.multiprocessing.reductions import StorageWeakRef
    weights = ck.weights()
    per_block = sum(1 for k in weights if k.startswith("model.layers.0.") and len(weights.shape(k)) == 2)
    held, most = [], 0
    cls = type(weights)
    read = cls.__getitem__

    def tracked(self, key):
        nonlocal most
        most = max(most, sum(not r.expired() for r in held))
        t = read(self, key)
        if t.dim() == 2:
            held.append(StorageWeakRef(t.untyped_storage()))
        return t
    cls.__getitem__ = tracked
    try:
        m = prepared_model(ck, recipe, progress=False)
    finally:
        cls.__getitem__ = read
    return m, len(held), most, per_block


@pytest.mark.real
def test_preparing_a_gguf_holds_one_block_of_float32_at_a_time(cache):
    """SmolLM2's 30 blocks read from its GGUF tensor by tensor: the float32 matrices held at
    once are at most one block's (a block is quantized before the next is read); the model is
    the one the whole float32 dict makes."""
    from longattn.checkpoint.gguf_file import GGUFWeights
    ck = load_checkpoint("smollm2-135m", progress=False, read_weights=False)
    assert isinstance(ck.weights(), GGUFWeights)
    m, read, most, per_block = _prepare_tracking_float32(ck, "int8")
    assert read == per_block * ck.config.num_layers + 1 and most <= per_block, (most, per_block)
    full = load_checkpoint("smollm2-135m", progress=False)
    assert torch.equal(m(IDS), build_model(full.config, full.state_dict, weights="int8")(IDS))


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_preparing_an_hf_directory_holds_one_block_of_float32_at_a_time(family, cache):
    """The same from safetensors (Phi-3: fused q/k/v and gate/up read as their parts)."""
    from longattn.checkpoint.hf_dir import HFWeights
    d = tiny_dir(family)
    ck = load_checkpoint(d, with_tokenizer=False, read_weights=False)
    assert isinstance(ck.weights(), HFWeights)
    m, read, most, per_block = _prepare_tracking_float32(ck, "int8")
    assert read > 2 * per_block and most <= per_block, (read, most, per_block)
    full = load_checkpoint(d, with_tokenizer=False)
    assert torch.equal(m(IDS), build_model(full.config, full.state_dict, weights="int8")(IDS))


def test_a_gguf_conversion_is_kept_once_its_weights_are_read(cache, tmp_path):
    """Opening a GGUF reads its header and tokenizer only and writes nothing; the converted
    entry is written by the run that reads every weight (values checked), here a prepare."""
    from longattn.checkpoint.load import _complete
    from tiny_gguf import write_tiny_gguf
    f = write_tiny_gguf(tmp_path / "m.gguf")
    ck = load_checkpoint(str(f), progress=False, read_weights=False)
    assert ck.tokenizer is not None and not (cache / "converted").exists()
    prepared_model(ck, "int8", progress=False)
    (entry,) = (cache / "converted").iterdir()
    assert _complete(entry)
    again = load_checkpoint(str(f), progress=False, read_weights=False)
    assert again.pending_entry is None and again.config == ck.config
