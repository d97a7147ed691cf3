"""Inputs that would hang, trace back or slip through unchecked: paths naming a FIFO or a
device, text without end, argv bytes that are not UTF-8, sampling and SCSA settings out of
range, and a header whose head counts do not fit together. Each ends in one line, exit 2, no traceback and
nothing in the cache. The cases that would wait for ever without their check run the real CLI
in a subprocess with a time limit, so a regression fails instead of stalling the suite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, cache_listing, hf_dir, run_cli
from test_bad_input import _mutated, _refused, cli, tiny_gguf  # noqa: F401 (fixtures)
from tiny_gguf import write_tiny_gguf

HANG_LIMIT_S = 120  # a refusal takes seconds; a read that waits takes this long, then fails
# config.json of the tiny llama (tiny_gguf.SIZES)
TINY_HF = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 98, "max_position_embeddings": 256}


@pytest.fixture
def fifo(tmp_path) -> Path:
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


# ---------------------------------------------------------------- paths: FIFOs, devices, size

@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
@pytest.mark.parametrize("command", ["generate --model", "generate --prompt-file", "stream --file"])
def test_a_path_that_is_not_a_regular_file_is_refused(tmp_path, tiny_gguf, fifo, target, command):
    """A FIFO waits for a writer for ever and /dev/zero never ends: refused before any read."""
    *cmd, opt = command.split()
    path = fifo if target == "fifo" else target
    model = [] if opt == "--model" else ["--model", tiny_gguf]
    r = run_cli([*cmd, *model, opt, path, "--max-tokens" if cmd == ["stream"] else "--max-new-tokens", 2],
                tmp_path / "c", timeout=HANG_LIMIT_S)
    assert_one_line_error(r, "not a regular file" if opt != "--model" else "neither a regular file nor a directory")
    assert str(path) in r.stderr
    assert cache_listing(tmp_path / "c") == []


def test_an_hf_directory_holding_a_fifo_is_refused(tmp_path, fifo):
    d = hf_dir(tmp_path / "hf", TINY_HF)
    os.mkfifo(d / "tokenizer.json")
    r = run_cli(["generate", "--model", d], tmp_path / "c", timeout=HANG_LIMIT_S)
    assert_one_line_error(r, "tokenizer.json is not a regular file")


def test_report_skips_a_fifo_among_the_results_and_refuses_one_as_output(tmp_path, fifo):
    results = tmp_path / "results"
    results.mkdir()
    (results / "q.md").write_text("# quality\n")
    (results / "q.json").write_text("{}")
    os.mkfifo(results / "x.md")
    (results / "x.json").write_text("{}")
    r = run_cli(["report", results], tmp_path / "c", timeout=HANG_LIMIT_S)
    assert r.returncode == 0, r.stderr
    assert "quality" in (results / "report.md").read_text()
    r = run_cli(["report", results, "--output", fifo], tmp_path / "c", timeout=HANG_LIMIT_S)
    assert_one_line_error(r, "is not a regular file")


def test_a_text_file_over_the_limit_is_refused_unread(cli, tiny_gguf, tmp_path):
    from longattn.cli.common import MAX_TEXT_BYTES
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)  # sparse: costs no disk
    for cmd in (["generate", "--prompt-file"], ["stream", "--file"]):
        _refused(cli(cmd[0], "--model", tiny_gguf, cmd[1], big),
                 f"holds {MAX_TEXT_BYTES + 1} bytes, more than the 64 MiB", [])


def test_undecodable_report_page_refused(cli, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "q.md").write_bytes(b"# q\n\xff\n")
    (tmp_path / "r" / "q.json").write_text("{}")
    _refused(cli("report", tmp_path / "r"), "q.md is not UTF-8 text (byte 0xff at offset 4)", [])
    assert not (tmp_path / "r" / "report.md").exists()


# ---------------------------------------------------------------- text from argv

@pytest.mark.parametrize("prompt,needle", [
    ("caf\udcff", "--prompt is not UTF-8 text (byte 0xff at offset 3)"),  # argv $'caf\xff'
    ("a\ud800b", "--prompt is not UTF-8 text (a lone surrogate U+D800 at offset 1)"),
])
def test_prompt_that_is_not_utf8_refused(cli, tiny_gguf, prompt, needle):
    _refused(cli("generate", "--model", tiny_gguf, "--prompt", prompt, "--max-new-tokens", 1), needle, [])


def test_prompt_bytes_from_a_real_argv_refused(tmp_path, tiny_gguf):
    """Bytes a shell passes as they are ($'\\xff'): Python's argv holds them surrogate-escaped."""
    r = run_cli(["generate", "--model", tiny_gguf, "--prompt", "\udcff", "--max-new-tokens", 1], tmp_path / "c")
    assert_one_line_error(r, "--prompt is not UTF-8 text (byte 0xff at offset 0)")


# ---------------------------------------------------------------- sampling settings

@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature=-inf"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-p", "nan"], "top-p must be in (0, 1]"),
    (["--top-k", "-1"], "top-k must be >= 0"),
])
def test_sampling_settings_out_of_range_refused(cli, tiny_gguf, args, needle):
    _refused(cli("generate", "--model", tiny_gguf, "--max-new-tokens", 1, *args), needle, [])


def test_tiny_temperature_and_top_p_sample_near_greedily(cli, tiny_gguf):
    """The smallest positive settings are legal and run (the best token, in effect)."""
    r = cli("generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-new-tokens", 2,
            "--temperature", "1e-300", "--top-p", "1e-300", "--compile", "none")
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- policy settings

@pytest.mark.parametrize("args,needle", [
    (["--sparse-probe", "100000"], "--sparse-probe must be in 0..16 (dimensions of tiny-random's 16-dimensional"),
    (["--sparse-probe", str(10 ** 30)], "--sparse-probe must be in 0..16"),
    (["--sparse-outliers", "65"], "--sparse-outliers must be >= 0 and at most 64"),
    (["--sparse-outliers", str(10 ** 30)], "--sparse-outliers must be >= 0 and at most 64"),
    (["--sparse-min-context", str(10 ** 30)], "--sparse-min-context must be >= 0 and at most 2147483647"),
    (["--sparse-min-context", "-1"], "--sparse-min-context must be >= 0"),
    (["--sparse-tolerance", "inf"], "--sparse-tolerance must be > 0 and at most 1"),
    (["--sparse-tolerance", "nan"], "--sparse-tolerance must be > 0 and at most 1"),
    (["--sparse-calib-quantile", "nan"], "--sparse-calib-quantile must be in (0, 1]"),
    (["--sparse-calib-quantile", "0"], "--sparse-calib-quantile must be in (0, 1]"),
])
def test_sparse_settings_out_of_range_refused(cli, tiny_gguf, args, needle):
    r = cli("generate", "--model", tiny_gguf, "--max-new-tokens", 1, "--policy", "sparse", *args)
    _refused(r, needle, cache_listing(r.cache))


@pytest.mark.parametrize("command", ["generate", "stream"])
@pytest.mark.parametrize("args,needle", [
    (["--sinks", "-1"], "--sinks must be a non-negative integer"),
    (["--sinks", str(10 ** 30)], "more than tiny-random's trained context (256)"),
    (["--window", str(10 ** 30)], "longer than tiny-random's trained context (256)"),
])
def test_window_and_sinks_out_of_range_refused(cli, tiny_gguf, command, args, needle):
    r = cli(command, "--model", tiny_gguf, *args)
    _refused(r, needle, cache_listing(r.cache))


def test_sparse_settings_at_their_bounds_run(cli, tiny_gguf):
    r = cli("generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-new-tokens", 2, "--policy", "sparse",
            "--sparse-probe", 16, "--sparse-outliers", 64, "--sparse-tolerance", 1, "--sparse-calib-quantile", 1,
            "--sparse-min-context", 0)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- head counts

@pytest.fixture(scope="module")
def tiny_gguf_rope(tmp_path_factory) -> Path:
    """The tiny GGUF with rope.dimension_count written (16, its head size), as llama.cpp does."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-rope.gguf", rope_dims=16)


@pytest.mark.parametrize("values,needle", [
    # 4 heads of 16 over a width of 64, 2 KV heads, rope on 16 dimensions
    ({"llama.attention.head_count": 3},
     "llama.attention.head_count (3) is not divisible by llama.attention.head_count_kv (2)"),
    ({"llama.attention.head_count_kv": 3},
     "llama.attention.head_count (4) is not divisible by llama.attention.head_count_kv (3)"),
    ({"llama.attention.head_count": 8},  # heads of 8: fewer dimensions than rope turns
     "llama.rope.dimension_count (16) is more than the head size 8 (llama.embedding_length 64 / "
     "llama.attention.head_count 8)"),
    ({"llama.attention.head_count": 2},  # heads of 32: the key projection has rows for 16
     "llama.attention.head_count_kv (2) heads of size 32 (llama.embedding_length 64 / llama.attention.head_count "
     "2) make 64 key rows, but tensor 'blk.0.attn_k.weight' has 32"),
    ({"llama.embedding_length": 66, "llama.attention.head_count": 4},
     "llama.embedding_length (66) is not divisible by llama.attention.head_count (4)"),
    ({"llama.attention.head_count": 0}, "llama.attention.head_count must be a positive integer, got 0"),
    ({"llama.rope.dimension_count": 8}, "rope on part of each head (partial rotary) is not implemented"),
])
def test_gguf_head_counts_that_do_not_fit_are_named(cli, tiny_gguf_rope, tmp_path, values, needle):
    """A corrupt head count is named as such, never taken for partial rotary; partial rotary
    (a rope width below a head size the tensors confirm) is refused as what it is."""
    bad = _mutated(tiny_gguf_rope, tmp_path, values)
    r = cli("generate", "--model", bad, "--max-new-tokens", 1)
    _refused(r, needle, [])
    if "partial rotary" not in needle:
        assert "partial rotary" not in r.stderr


@pytest.mark.parametrize("over,needle", [
    ({"num_key_value_heads": 3}, "num_attention_heads (4) is not divisible by num_key_value_heads (3)"),
    ({"num_attention_heads": 3, "num_key_value_heads": 1},
     "hidden_size (64) is not divisible by num_attention_heads (3), and it sets no head_dim"),
])
def test_hf_head_counts_that_do_not_fit_are_named(over, needle):
    from longattn.checkpoint.hf_dir import read_hf_config
    from longattn.errors import LongattnError
    with pytest.raises(LongattnError) as e:
        read_hf_config({**TINY_HF, **over})
    assert needle in str(e.value)
    # a head_dim of its own (Gemma, Qwen 3) makes the width's division irrelevant
    assert read_hf_config({**TINY_HF, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}).head_dim == 16


def test_hf_head_counts_refused_by_the_cli(cli, tmp_path):
    d = hf_dir(tmp_path / "hf", json.dumps({**TINY_HF, "num_attention_heads": 3, "num_key_value_heads": 1}))
    _refused(cli("generate", "--model", d), "config.json: hidden_size (64) is not divisible by num_attention_heads (3)",
             [])
