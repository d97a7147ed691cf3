"""Tiny checkpoints converted to GGUF by llama.cpp's own converter (``convert_hf_to_gguf.py``
from the llama-cpp-python 0.3.36 sdist, not built) load through longattn's GGUF path and
give the HF directory's logits (within 1e-4, float32). Where the converter cannot carry a
family's function into the file, the test says so.

The sdist is found through ``LONGATTN_LLAMACPP_SDIST`` (the ``.tar.gz`` or its extracted
directory); without it these tests skip. Fetch it with
``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d DIR``.
"""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import tiny_dir
from longattn.errors import LongattnError

SDIST_ENV = "LONGATTN_LLAMACPP_SDIST"
INNER = "vendor/llama.cpp"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
# Gemma 3 as its 4B-27B checkpoints ship: linear x8 on the global layers only, the local
# layers with a base of their own (written as rope.freq_base_swa); every 6th layer global.
GEMMA3_LINEAR = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
GEMMA3_PATTERN = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)]
# name: (family, config fields); Gemma 2 and 3 with query_pre_attn_scalar = head_dim, the value
# the file's readers assume (the converter does not write it).
MATCH = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3, "max_position_embeddings": 64}),
    "mistral-nowindow": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3-linear": ("gemma3", {"rope_parameters": GEMMA3_LINEAR, "layer_types": GEMMA3_PATTERN}),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Convert every case once (one converter process): name -> GGUF path."""
    src = os.environ.get(SDIST_ENV)
    if not src or not Path(src).exists():
        pytest.skip(f"llama.cpp's converter is not here: set {SDIST_ENV} to the llama-cpp-python 0.3.36 sdist "
                    "(pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d DIR)")
    tmp = tmp_path_factory.mktemp("llamacpp")
    src = Path(src)
    if src.is_dir():
        root = next(p for p in [src / INNER, src] if (p / "convert_hf_to_gguf.py").exists())
    else:
        with tarfile.open(src) as tar:
            members = [m for m in tar.getmembers() if f"/{INNER}/" in m.name and
                       any(part in m.name for part in ("convert_hf_to_gguf.py", "/conversion/", "/gguf-py/"))]
            tar.extractall(tmp, members=members, filter="data")
        root = next(tmp.glob(f"*/{INNER}"))
    cases = {**MATCH, "mistral-window": ("mistral", {}), "gpt_oss": ("gpt_oss", {})}
    out = {name: tmp / f"{name}.gguf" for name in cases}
    args = [str(a) for name, (fam, over) in cases.items() for a in (tiny_dir(fam, **over), out[name])]
    helper = Path(__file__).parents[1] / "llamacpp_convert.py"
    r = subprocess.run([sys.executable, str(helper), str(root), *args], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _hf_logits(d, ids):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("name", list(MATCH))
def test_llamacpp_gguf_gives_hf_logits(gguf_files, name):
    from longattn.checkpoint.gguf_file import load_gguf
    from longattn.models import build_model
    family, over = MATCH[name]
    cfg, sd = load_gguf(gguf_files[name])
    ids = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(9))
    err = (build_model(cfg, sd)(ids) - _hf_logits(tiny_dir(family, **over), ids)).abs().max().item()
    assert err < 1e-4, f"{name}: max |delta logit| {err:.2e}"
    if name == "llama3-rope":
        assert cfg.rope_scaling["rope_type"] == "freq_factors"
    if family in ("phi3", "gemma2", "gemma3"):
        assert any(w == 8 for w in cfg.layer_windows)
    if family == "gemma3":  # the scaling and the file's base on the global layer only
        assert cfg.layer_rope_theta == [2e4] * 5 + [1e6]
        assert cfg.layer_rope_scaling == [None] * 5 + [{"rope_type": "linear", "factor": 8.0}]


def test_llamacpp_drops_mistral_window(gguf_files):
    """The converter writes Mistral as a llama file without its sliding window (llama.cpp runs
    it with full attention), so a windowed Mistral GGUF cannot give the HF directory's
    logits: longattn reads what the file says, full attention."""
    from longattn.checkpoint.gguf_file import load_gguf
    cfg, _ = load_gguf(gguf_files["mistral-window"])
    assert cfg.family == "llama" and cfg.layer_windows == [None] * cfg.num_layers


def test_llamacpp_gpt_oss_refused(gguf_files):
    """gpt-oss GGUFs are refused with one line (architecture not read from GGUF)."""
    from longattn.checkpoint.gguf_file import load_gguf
    with pytest.raises(LongattnError, match="unsupported architecture 'gpt-oss'"):
        load_gguf(gguf_files["gpt_oss"])


def _saved(tok, d) -> dict:
    tok.save_pretrained(str(d))
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


@pytest.mark.parametrize("name", list(MATCH))
def test_named_tokenizer_class_is_the_one_autotokenizer_picks(gguf_files, name, tmp_path):
    """load_tokenizer names the class for the file's architecture (GGUF_TOKENIZER_CLASS)
    instead of letting AutoTokenizer parse the whole file: the same class, the same files."""
    from transformers import AutoTokenizer

    from longattn.checkpoint.gguf_file import _open, read_gguf_config
    from longattn.checkpoint.tokenizer import load_tokenizer
    path = gguf_files[name]
    arch = read_gguf_config(_open(path), path).family
    try:
        auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # a vocabulary transformers cannot rebuild: refused by both ways
        with pytest.raises(LongattnError, match="cannot read the tokenizer"):
            load_tokenizer(path.parent, gguf_file=path.name, gguf_arch=arch)
        assert type(e) is KeyError, e
        return
    ours = load_tokenizer(path.parent, gguf_file=path.name, gguf_arch=arch)
    assert type(ours) is type(auto)
    assert _saved(ours, tmp_path / "ours") == _saved(auto, tmp_path / "auto")
