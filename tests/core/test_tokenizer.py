"""The checkpoint tokenizer (the `tokenizers` library for encode and decode) gives transformers'
ids and text, exactly, on the three bundled models; everything else comes from transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import real_checkpoint
from longattn.checkpoint.tokenizer import CheckpointTokenizer, checkpoint_tokenizer, load_tokenizer
from longattn.data import all_books_text
from longattn.errors import LongattnError

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]
ODD = ["", " ", "Hello  world\n\n", "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user hi<end_of_turn>",
       "café naïve — “quotes” 日本語 🙂", "\t\ttabs  and   spaces  ", "<bos><eos><pad>"]


def _tokenizer_files(name: str, tmp_path) -> Path:
    """A directory holding the bundled model's tokenizer files as the converted cache entry
    holds them (written by the tokenizer itself: a first load in an empty cache has no entry
    yet, its weights not proven)."""
    d = tmp_path / f"{name}-files"
    real_checkpoint(name).tokenizer.save_pretrained(str(d))
    return d


def _samples() -> list:
    text = all_books_text()
    return [text[i:i + 2500] for i in range(0, 150_000, 5_000)] + ODD


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_bundled_tokenizers_equal_transformers(name, tmp_path):
    """The tokenizer a run gets, whether this is the model's first run (transformers' GGUF
    tokenizer wrapped) or a later one (the converted directory), and the directory's own
    CheckpointTokenizer, against transformers' tokenizer of the same files."""
    first = real_checkpoint(name).tokenizer
    assert isinstance(first, CheckpointTokenizer)
    d = _tokenizer_files(name, tmp_path)
    assert _equal_to_transformers(first, first.hf if first._path is None else load_tokenizer(first._path))
    tok = checkpoint_tokenizer(d)
    assert isinstance(tok, CheckpointTokenizer)
    assert _equal_to_transformers(tok, load_tokenizer(d))


def _equal_to_transformers(tok, hf) -> bool:
    for s in _samples():
        ids = tok(s)["input_ids"]
        assert ids == hf(s)["input_ids"], s[:60]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.eos_token_id == hf.eos_token_id  # from transformers, on first use
    assert tok.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    return True


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_bundled_gguf_tokenizer_class_is_the_one_autotokenizer_picks(name, tmp_path):
    """The converted tokenizer is built by the class GGUF_TOKENIZER_CLASS names for the file's
    architecture; AutoTokenizer (which parses the whole file to choose) saves the same files."""
    from transformers import AutoTokenizer
    ck = real_checkpoint(name)
    ours = load_tokenizer(ck.source.parent, gguf_file=ck.source.name, gguf_arch=ck.config.family)
    auto = AutoTokenizer.from_pretrained(str(ck.source.parent), gguf_file=ck.source.name)
    assert type(ours) is type(auto)
    for t, d in ((ours, tmp_path / "ours"), (auto, tmp_path / "auto")):
        t.save_pretrained(str(d))
    files = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for f in files:
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "auto" / f).read_bytes(), f


def _tokenizer_dir(tmp_path, config: dict):
    d = tmp_path / "tok"
    d.mkdir()
    src = _tokenizer_files("smollm2-135m", tmp_path)
    (d / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_settings_transformers_applies_itself_send_the_directory_to_transformers(tmp_path):
    assert isinstance(checkpoint_tokenizer(_tokenizer_dir(tmp_path, {})), CheckpointTokenizer)
    d = tmp_path / "b"
    d.mkdir()
    other = _tokenizer_dir(d, {"clean_up_tokenization_spaces": True})
    assert not isinstance(checkpoint_tokenizer(other), CheckpointTokenizer)


@pytest.mark.parametrize("damage", ["tokenizer.json", "tokenizer_config.json"])
def test_damaged_files_are_one_line(tmp_path, damage):
    d = _tokenizer_dir(tmp_path, {})
    (d / damage).write_text("{ not json")
    with pytest.raises(LongattnError, match="the tokenizer files are damaged"):
        checkpoint_tokenizer(d, what="the test directory")


_RSS_AFTER_LOAD = """
import sys
from pathlib import Path
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
import tokenizers
from longattn.checkpoint import tokenizer
before = rss()
if sys.argv[2] == "checkpoint":
    tokenizer.checkpoint_tokenizer(Path(sys.argv[1]))
else:
    tokenizers.Tokenizer.from_file(str(Path(sys.argv[1]) / "tokenizer.json"))
print(rss() - before)
"""


@pytest.mark.real
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads /proc")
def test_loading_a_large_tokenizer_hands_its_parse_memory_back(tmp_path):
    """Gemma 3's 33 MB tokenizer.json: the parse frees most of what it allocated, and the
    checkpoint tokenizer hands that back to the system (glibc keeps it otherwise)."""
    import subprocess
    import sys
    path = _tokenizer_files("gemma3-270m", tmp_path)
    grew = {how: int(subprocess.run([sys.executable, "-c", _RSS_AFTER_LOAD, str(path), how], check=True,
                                    capture_output=True, text=True).stdout) for how in ("plain", "checkpoint")}
    assert grew["checkpoint"] < grew["plain"] / 2, grew


@pytest.mark.real
def test_encoding_lets_other_threads_run():
    """A server tokenizes on a worker thread; the encoder must release the GIL meanwhile, or
    a megabyte prompt freezes the event loop (every other client's stream and /health)."""
    import threading
    import time
    tok = real_checkpoint("smollm2-135m").tokenizer
    text = (all_books_text()[:200_000] * 5)
    ticks, done = [], threading.Event()

    def encode():
        tok(text)
        done.set()
    worker = threading.Thread(target=encode)
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.002)
    worker.join()
    # holding the GIL, encode would leave this loop one or two turns in ~1 s of work
    assert len(ticks) >= 20
