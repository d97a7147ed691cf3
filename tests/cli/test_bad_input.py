"""Everything a user can get wrong ends in one line `longattn: error: ...`, exit 2, no
traceback, and the cache exactly as it was; a few cases run the real CLI in a subprocess
(Ctrl-C, an unusable cache, files the process must read), the rest call its entry point in
this process on a private cache, which checks the same contract at a fraction of the cost.
Fuzz cases mutate a real GGUF header and an HF config.json with seeded random values."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cli_helpers import assert_one_line_error, cache_listing, error_lines, run_cli
from conftest import tiny_dir
from tiny_gguf import SIZES, write_tiny_gguf

LONG_PROMPT = "the cat sat on the mat. " * 20  # > 256 tokens of the tiny vocabulary


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``cli(*args)`` runs `longattn ARGS` in this process on a private cache (native kernels
    off, unless an earlier test loaded them) -> namespace(returncode, stderr, stdout, cache)."""
    from longattn.cli.main import main
    from longattn.ops import native
    cache = tmp_path / "cache"
    monkeypatch.setenv("LONGATTN_CACHE", str(cache))
    monkeypatch.setenv("LONGATTN_NATIVE", "off")
    monkeypatch.setattr(native, "_state", dict(native._state))  # a private memo, restored after

    def run(*args):
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse
            code = e.code
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stderr=out.err, stdout=out.out, cache=cache)
    return run


def _refused(r, needle: str, before: list) -> None:
    assert_one_line_error(r, needle)
    assert cache_listing(r.cache) == before, "a refused run changed the cache"


def _refused_keeping_only_good_entries(r, before: list) -> None:
    """A refusal that may come after a good conversion (a setting the converted model then
    refuses, such as a prompt past a tiny trained context): one line, and the cache gained
    at most complete converted entries and the digest memo, never a temporary."""
    from longattn.checkpoint.load import _complete
    assert_one_line_error(r, "")
    added = set(cache_listing(r.cache)) - set(before)
    entries = {Path(p).parts[1] for p in added if p.startswith("converted/")}
    assert all(_complete(r.cache / "converted" / e) for e in entries), added
    assert all(p in ("converted", "digests.json") or p.startswith("converted/") for p in added), added


# ---------------------------------------------------------------- options and inputs

@pytest.mark.parametrize("args,needle", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--seed", "1e23"], "invalid int value"),
    (["--seed", str(2 ** 70)], "seed must be an integer in [0, 2**64)"),
    (["--chunk", "0"], "--chunk must be >= 1"),
    (["--threads", "100000"], "more than 4x this machine's"),
    (["--window", "0"], "--window must be >= 1"),
    (["--window", "8", "--policy", "dense"], "no effect under --policy dense"),
    (["--sparse-outliers", "3"], "--sparse-outliers only applies with --policy sparse"),
    (["--sparse-tolerance", "0.1", "--sparse-probe", "4", "--policy", "window", "--window", "8"],
     "only apply with --policy sparse"),
    (["--window", "1000000000000"], "longer than tiny-random's trained context (256)"),
    (["--window", "8", "--sinks", "1000000000000"], "more than tiny-random's trained context (256)"),
])
def test_impossible_options_refused(cli, tiny_gguf, args, needle):
    r = cli("generate", "--model", tiny_gguf, "--max-new-tokens", 1, *args)
    _refused(r, needle, cache_listing(r.cache) if "context (256)" in needle else [])
    assert "--policy window" not in r.stderr  # never blames a policy the user did not pass


def test_compile_aot_refused_in_one_line_where_it_cannot_run(cli, tiny_gguf, monkeypatch):
    """The ahead-of-time step calls the native kernels and has no sparse path: both refused in
    one line before anything is read or written."""
    from longattn.ops import native
    monkeypatch.setattr(native, "available", lambda: False)  # as if not built (an earlier test may have)
    for extra, needle in [((), "native kernels"), (("--policy", "sparse"), "window and dense layers")]:
        _refused(cli("generate", "--model", tiny_gguf, "--max-new-tokens", 1, "--compile", "aot", *extra),
                 needle, [])
    _refused(cli("generate", "--model", tiny_gguf, "--compile", "sometimes"), "invalid choice", [])


def test_kv_formats_refused_where_the_step_stores_float32(cli, tiny_gguf):
    """The torch.compile step stores float32: another format asked of it is refused in one line
    before anything is read."""
    _refused(cli("generate", "--model", tiny_gguf, "--max-new-tokens", 1, "--compile", "jit", "--kv", "int8"),
             "--kv int8", [])


def test_eager_generate_decodes_through_caches_of_any_format(cli, tiny_gguf):
    import json
    for kv, policy in (("bf16", "sparse"), ("int8", "checkpoint")):
        r = cli("generate", "--model", tiny_gguf, "--max-new-tokens", 3, "--compile", "none", "--kv", kv, "--json",
                "--policy", policy)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["kv"] == kv and out["new_tokens"] == 3 and out["step"] == "eager"


def test_a_bad_model_name_is_refused_before_the_kernels_build(tmp_path):
    """The default step choice needs the native kernels; it is made after the load, so a typo
    on a fresh machine costs no build."""
    cache = tmp_path / "cache"
    r = run_cli(["generate", "--model", "nope", "--max-new-tokens", 1], cache, native=True)
    assert_one_line_error(r, "unknown model")
    assert not (cache / "kernels").exists()


def test_stream_chunk_zero_refused_like_generate(cli, tiny_gguf):
    _refused(cli("stream", "--model", tiny_gguf, "--chunk", 0), "--chunk must be >= 1", [])


def test_stream_kv_formats_run(cli, tiny_gguf, tmp_path):
    import json
    text = _text_file(tmp_path, "the cat sat on the mat. " * 8)
    runs = {}
    for kv in ("f32", "bf16", "int8"):
        r = cli("stream", "--model", tiny_gguf, "--file", text, "--kv", kv, "--json",
                *(["--window", "8", "--sinks", "2", "--reindex"] if kv == "int8" else []))
        assert r.returncode == 0, r.stderr
        runs[kv] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["bf16"]["kv"] == "bf16" and runs["bf16"]["max_cache_bytes"] * 2 == runs["f32"]["max_cache_bytes"]
    assert runs["int8"]["reindex"] and runs["int8"]["max_cache_bytes"] > 0


def test_prompt_past_trained_context(cli, tiny_gguf):
    """Dense runs past the trained context are refused, naming what can run them; a window
    on every layer, or the explicit flag, runs them."""
    ok = cli("generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-new-tokens", 2)
    assert ok.returncode == 0, ok.stderr
    before = cache_listing(ok.cache)
    r = cli("generate", "--model", tiny_gguf, "--prompt", LONG_PROMPT, "--max-new-tokens", 2)
    _refused(r, "past tiny-random's trained context of 256", before)
    assert "--policy window" in r.stderr and "--allow-beyond-context" in r.stderr
    r = cli("stream", "--model", tiny_gguf, "--file", _text_file(r.cache.parent, LONG_PROMPT))
    _refused(r, "--reindex", before)
    for extra in (["--allow-beyond-context"], ["--policy", "window", "--window", "64", "--sinks", "4"]):
        r = cli("generate", "--model", tiny_gguf, "--prompt", LONG_PROMPT, "--max-new-tokens", 2, *extra)
        assert r.returncode == 0, r.stderr


def test_huge_repeat_builds_only_what_is_scored(cli, tiny_gguf, tmp_path):
    r = cli("stream", "--model", tiny_gguf, "--file", _text_file(tmp_path, "the cat sat."),
            "--repeat", 10 ** 12, "--max-tokens", 40)
    assert r.returncode == 0, r.stderr


def _text_file(d: Path, text: str | bytes) -> Path:
    p = d / ("input.txt" if isinstance(text, str) else "input.bin")
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


@pytest.mark.parametrize("data,needle", [
    ("caf\u00e9 au lait".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 3)"),
    (bytes(range(256)) * 4, "is a binary file"),
])
@pytest.mark.parametrize("command", ["generate --prompt-file", "stream --file"])
def test_undecodable_text_refused(cli, tiny_gguf, tmp_path, data, needle, command):
    *cmd, opt = command.split()
    r = cli(*cmd, "--model", tiny_gguf, opt, _text_file(tmp_path, data))
    _refused(r, needle, [])


def test_context_length_zero(cli, tmp_path):
    bad = write_tiny_gguf(tmp_path / "ctx0.gguf", context=0)
    _refused(cli("generate", "--model", bad), "max_context (the trained context length) must be a "
             "positive integer, got 0", [])


# ---------------------------------------------------------------- damaged GGUF files

def test_header_contradicting_tensors_refused_before_anything_is_written(cli, tiny_gguf, tmp_path):
    """The header's KV head count changed (2 -> 1): the first tensor it contradicts is named."""
    bad = _mutated(tiny_gguf, tmp_path, {"llama.attention.head_count_kv": 1})
    r = cli("generate", "--model", bad, "--max-new-tokens", 1)
    _refused(r, "tensor 'blk.0.attn_k.weight' has shape (32, 64)", [])


def test_flipped_tensor_bytes_refused(cli, tiny_gguf, tmp_path):
    """4 KB of random bytes in the embedding table: refused, naming the tensor."""
    import gguf
    t = next(t for t in gguf.GGUFReader(str(tiny_gguf)).tensors if t.name == "token_embd.weight")
    data = bytearray(tiny_gguf.read_bytes())
    rng = np.random.default_rng(7)
    data[t.data_offset + 1024:t.data_offset + 5120] = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    bad = tmp_path / "flipped.gguf"
    bad.write_bytes(bytes(data))
    _refused(cli("generate", "--model", bad, "--max-new-tokens", 1), "tensor 'token_embd.weight' holds", [])


@pytest.mark.parametrize("cut", [-3000, 0, 3])
def test_truncated_tiny_gguf(cli, tiny_gguf, tmp_path, cut):
    bad = tmp_path / "short.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:cut])
    _refused(cli("generate", "--model", bad, "--max-new-tokens", 1), "corrupt", [])


def _mutated(src: Path, tmp_path: Path, values: dict) -> Path:
    """A copy of GGUF ``src`` with header fields set to ``values`` in place (same types)."""
    import gguf
    dst = tmp_path / f"mut-{len(list(tmp_path.glob('mut-*')))}.gguf"
    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    for key, v in values.items():
        f = r.fields[key]
        part = f.parts[f.data[0]]
        with np.errstate(invalid="ignore", over="ignore"):
            part[0] = np.array(v).astype(part.dtype)  # wraps like a careless writer would
    r.data.flush()
    del r
    return dst


NUMERIC_FIELDS = ["llama.block_count", "llama.context_length", "llama.embedding_length",
                  "llama.feed_forward_length", "llama.attention.head_count",
                  "llama.attention.head_count_kv", "llama.rope.freq_base",
                  "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.eos_token_id"]
WILD = [0, 1, 3, -1, 7, 2 ** 31 - 1, 1e30, float("nan"), float("inf"), -2.5]


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_gguf_header(cli, tiny_gguf, tmp_path, seed):
    """Random header fields set to random values: the run either works or is refused in one
    line with the cache untouched; never a traceback, never a half-written entry."""
    rng = random.Random(seed)
    for case in range(4):
        values = {k: rng.choice(WILD) for k in rng.sample(NUMERIC_FIELDS, rng.randint(1, 3))}
        bad = _mutated(tiny_gguf, tmp_path, values)
        before = cache_listing(tmp_path / "cache")
        r = cli("generate", "--model", bad, "--prompt", "the cat", "--max-new-tokens", 1)
        assert r.returncode in (0, 2), (values, r.stderr)
        if r.returncode == 2 and "llama.context_length" not in values:
            assert cache_listing(r.cache) == before, (values, r.stderr)  # refused before converting
        if r.returncode == 2:
            _refused_keeping_only_good_entries(r, before)
        assert not list((tmp_path / "cache").rglob(".tmp-*")), values


# ---------------------------------------------------------------- HF directories

@pytest.fixture(scope="module")
def tiny_hf(tiny_gguf, tmp_path_factory) -> Path:
    """A tiny HF llama directory whose tokenizer (taken from the tiny GGUF's conversion)
    matches its vocabulary."""
    from longattn.checkpoint.load import load_tokenizer
    d = Path(tmp_path_factory.mktemp("hf")) / "tiny-hf"
    shutil.copytree(tiny_dir("llama", vocab_size=SIZES["vocab"]), d)
    load_tokenizer(tiny_gguf.parent, gguf_file=tiny_gguf.name).save_pretrained(str(d))
    return d


def _hf_with(tiny_hf: Path, tmp_path: Path, config) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(tiny_hf, d)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


@pytest.mark.parametrize("edit,needle", [
    (lambda c: "{not json", "is not valid JSON"),
    (lambda c: "[1, 2]", "holds a JSON list"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "lacks the setting 'hidden_size'"),
    (lambda c: {**c, "num_attention_heads": "nine"}, "invalid value"),
    (lambda c: {**c, "num_attention_heads": 0, "head_dim": None}, "to zero"),
    (lambda c: {**c, "max_position_embeddings": 0}, "max_context"),
    (lambda c: {**c, "rope_theta": -1.0, "rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     "rope_theta must be a positive finite number"),
])
def test_bad_config_json(cli, tiny_hf, tmp_path, edit, needle):
    cfg = json.loads((tiny_hf / "config.json").read_text())
    d = _hf_with(tiny_hf, tmp_path, edit(cfg))
    _refused(cli("generate", "--model", d, "--max-new-tokens", 1), needle, [])


def test_corrupt_tokenizer_json(cli, tiny_hf, tmp_path):
    d = _hf_with(tiny_hf, tmp_path, (tiny_hf / "config.json").read_text())
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 3')
    _refused(cli("generate", "--model", d, "--max-new-tokens", 1), "cannot read the tokenizer", [])


def test_tokenizer_of_another_model(cli, tiny_hf, tmp_path):
    d = _hf_with(tiny_hf, tmp_path, {**json.loads((tiny_hf / "config.json").read_text()), "vocab_size": 40})
    from safetensors.torch import load_file, save_file
    sd = load_file(str(d / "model.safetensors"))
    sd = {k: (v[:40].contiguous() if v.shape[0] == SIZES["vocab"] else v) for k, v in sd.items()}
    save_file(sd, str(d / "model.safetensors"))
    _refused(cli("generate", "--model", d, "--prompt", "zz", "--max-new-tokens", 1),
             "the tokenizer belongs to another model", [])


@pytest.mark.parametrize("damage,needle", [
    (lambda t: t.fill_(float("nan")), "holds 64 non-finite values"),
    (lambda t: t.fill_(1e6), "magnitude 1e+06"),
    (lambda t: t.index_fill_(0, torch.tensor([3]), float("-inf")), "holds 1 non-finite values"),
    (lambda t: t[:-1].clone(), "has shape (63,), config expects (64,)"),
])
def test_damaged_hf_weights(cli, tiny_hf, tmp_path, damage, needle):
    from safetensors.torch import load_file, save_file
    d = _hf_with(tiny_hf, tmp_path, (tiny_hf / "config.json").read_text())
    sd = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.input_layernorm.weight"
    sd[key] = damage(sd[key].clone()).contiguous()
    save_file(sd, str(d / "model.safetensors"))
    r = cli("generate", "--model", d, "--max-new-tokens", 1)
    _refused(r, needle, [])
    assert "input_layernorm" in r.stderr


HF_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
           "rms_norm_eps", "model_type", "tie_word_embeddings", "eos_token_id"]
HF_WILD = [0, -1, 1, 3, "x", None, [], {}, 1e30, True, 2 ** 40]


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_hf_config(cli, tiny_hf, tmp_path, seed):
    """config.json keys deleted or set to wild values: works, or one line and nothing kept."""
    rng = random.Random(100 + seed)
    base = json.loads((tiny_hf / "config.json").read_text())
    for case in range(4):
        cfg = dict(base)
        for k in rng.sample(HF_KEYS, rng.randint(1, 3)):
            if rng.random() < 0.25:
                cfg.pop(k, None)
            else:
                cfg[k] = rng.choice(HF_WILD)
        d = _hf_with(tiny_hf, tmp_path / str(case), cfg)
        before = cache_listing(tmp_path / "cache")  # an earlier case that ran left its prepared weights
        r = cli("generate", "--model", d, "--prompt", "the cat", "--max-new-tokens", 1)
        assert r.returncode in (0, 2), (cfg, r.stderr)
        if r.returncode == 2:
            _refused(r, "", before)


# ---------------------------------------------------------------- the real CLI, in a subprocess

def test_cli_undecodable_prompt_file(tmp_path, tiny_gguf):
    p = _text_file(tmp_path, b"\xff\xfe\x00b\x00a\x00d")
    r = run_cli(["generate", "--model", tiny_gguf, "--prompt-file", p], tmp_path / "c")
    assert_one_line_error(r, "is a binary file")
    assert cache_listing(tmp_path / "c") == []


@pytest.mark.parametrize("layout,needle", [("file", "is a file; set LONGATTN_CACHE"),
                                           ("under", "which is a file")])
def test_cli_cache_commands_on_unusable_cache(tmp_path, layout, needle):
    (tmp_path / "f").write_text("x")
    cache = tmp_path / "f" if layout == "file" else tmp_path / "f" / "cache"
    r = run_cli(["models", "--cache", "--clear-cache"], cache)
    assert_one_line_error(r, needle)
    assert (tmp_path / "f").read_text() == "x"


def test_cli_unusable_cache_falls_back_before_converting(tmp_path, tiny_gguf):
    """LONGATTN_CACHE under a file: one warning, a private temporary cache, and the run works."""
    (tmp_path / "f").write_text("x")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_cli(["generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-new-tokens", 2],
                tmp_path / "f" / "cache", TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    warn = [l for l in error_lines(r.stderr) if l.startswith("longattn: warning:")]
    assert len(warn) == 1 and "cache directory unusable" in warn[0], r.stderr
    assert "Traceback" not in r.stderr
    assert list(tmp.glob("longattn-cache-*/converted/*/config.json"))


def test_ctrl_c_that_tears_an_import_still_reads_interrupted(monkeypatch, capsys):
    """An interrupt inside a C extension's import (numpy under torch) resurfaces as an
    ImportError once the import is retried; the CLI must still say "interrupted", exit 130."""
    import os

    import longattn.cli.models as models_cmd
    from longattn.cli.main import main

    def torn_import(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except KeyboardInterrupt:
            pass  # what an import machinery's cleanup does
        raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(models_cmd, "run", torn_import)
    # as in a terminal: SIGINT raises (a runner started in the background may have it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["models"]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err == "longattn: interrupted\n"


def _sigint_as_in_a_terminal() -> None:
    """In the child: SIGINT at its default, as a terminal starts a command (a test runner started
    in the background inherits it ignored, and the CLI leaves an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("delay", [0.2, 0.9])
def test_cli_ctrl_c_early(tmp_path, delay):
    env = dict(__import__("os").environ, LONGATTN_CACHE=str(tmp_path / "c"), LONGATTN_NATIVE="off")
    p = subprocess.Popen([sys.executable, "-m", "longattn.cli.main", "generate", "--max-new-tokens", "1"],
                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                         preexec_fn=_sigint_as_in_a_terminal)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    if p.returncode == 2 and "error" in err:  # finished (with an error) before the signal
        return
    assert p.returncode == 130, err
    assert error_lines(err) == ["longattn: interrupted"], err


def test_ctrl_c_inside_an_import_ends_at_once_with_one_line(tmp_path):
    """An interrupt that lands while a module is being imported (torch runs parts of its
    import from C++, where a raised KeyboardInterrupt aborts the process) ends the process at
    once with the one line and 130."""
    (tmp_path / "slow_import.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                             "time.sleep(5)\n")
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from longattn.cli import interrupt; interrupt.install(); import slow_import\n")
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{Path(__file__).parents[2] / 'src'}")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 130 and p.stderr == "longattn: interrupted\n", p.stderr
