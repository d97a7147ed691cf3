"""Shared fixtures: tiny random models of each family (made and saved with transformers)
and real bundled checkpoints with transformers' own copy as the oracle.

Both sides are cached (longattn's conversion in $LONGATTN_CACHE/converted, the oracle's
float32 copy in $LONGATTN_CACHE/oracle) so only the first run pays for dequantizing.
"""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(int(os.environ.get("LONGATTN_TEST_THREADS", "2")))
warnings.filterwarnings("ignore")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def tiny_hf_config(family: str, **over):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)
    kw = {**TINY, **({"num_hidden_layers": 6} if family == "gemma3" else {}), **over}
    if family == "llama":
        return LlamaConfig(**{"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **kw})
    if family == "qwen2":
        return Qwen2Config(**{"rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, **kw})
    if family == "qwen3":
        return Qwen3Config(**{"rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, **kw})
    if family == "mistral":
        return MistralConfig(**{"sliding_window": 8, "rope_theta": 1e4, "rms_norm_eps": 1e-5, **kw})
    if family == "phi3":
        kw.pop("head_dim")  # Phi-3 derives head_dim from hidden_size / heads (64 / 4 = 16)
        return Phi3Config(**{"sliding_window": 8, "rms_norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 1,
                             "eos_token_id": 2, **kw})
    if family == "gemma2":
        return Gemma2Config(**{"sliding_window": 8, "query_pre_attn_scalar": 12, "rms_norm_eps": 1e-6,
                               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, **kw})
    if family == "gpt_oss":
        from transformers import GptOssConfig
        return GptOssConfig(**{"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "intermediate_size": 32, "rms_norm_eps": 1e-5, **kw})
    if family == "gemma3":
        L = kw["num_hidden_layers"]
        return Gemma3TextConfig(
            sliding_window=kw.pop("sliding_window", 8), query_pre_attn_scalar=kw.pop("query_pre_attn_scalar", 16),
            rms_norm_eps=kw.pop("rms_norm_eps", 1e-6),
            layer_types=kw.pop("layer_types", ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                               for i in range(L)]),
            rope_parameters=kw.pop("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 1e4}}),
            **kw)
    raise ValueError(family)


def randomize(model, seed: int = 0) -> None:
    """Random values in every parameter, norms and biases included, so nothing hides."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            scale = 0.3 if "norm" in name else (0.5 if "embed" in name else 0.15)
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def tiny_dir(family: str, seed: int = 0, **over) -> str:
    """Save a random transformers model of ``family`` (config fields ``over``) and return its
    directory; one per distinct (family, seed, over)."""
    import json
    return _tiny_dir(family, seed, json.dumps(over, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _tiny_dir(family: str, seed: int, over_json: str) -> str:
    import json
    import tempfile
    from transformers import AutoModelForCausalLM
    cfg = tiny_hf_config(family, **json.loads(over_json))
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(m, seed)
    d = tempfile.mkdtemp(prefix=f"longattn-tiny-{family}-")
    m.save_pretrained(d)
    return d


def tiny_pair(family: str, **over):
    """(longattn model, transformers model) for a tiny random config."""
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = tiny_dir(family, **over)
    ck = load_checkpoint(d, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return build_model(ck.config, ck.state_dict), hf


def tiny_model(family: str = "llama", dtype=torch.float32, **over):
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    ck = load_checkpoint(tiny_dir(family, **over), with_tokenizer=False)
    return build_model(ck.config, ck.state_dict, dtype=dtype)


def tiny_formats(family: str, weights: str):
    """(model in ``weights``, float64 reference) for the tiny config of ``family``.

    The reference is a float64 model of ``effective_state_dict``: the weights the model really
    multiplies by. int4 decode also rounds activations to int8 per block of 32, so there the
    model's error against it is that rounding's (tolerances derived from the full forward's
    error include it); the rounding itself is checked exactly in test_weights.py. An exact
    float64 emulation of the rounding is no steadier a reference: float32 and float64 inputs
    land on different sides of a rounding boundary often enough (tens of activations a model
    run) that both the emulation and any two float32 paths differ by whole quantization steps.
    """
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    from longattn.models.weights import effective_state_dict
    ck = load_checkpoint(tiny_dir(family), with_tokenizer=False)
    m = build_model(ck.config, ck.state_dict, weights=weights)
    return m, build_model(ck.config, effective_state_dict(ck.state_dict, weights), dtype=torch.float64)


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
    # Tests share the user's conversion cache (so real models are converted once per machine)
    # unless LONGATTN_CACHE is already set.
    yield


# ---------------------------------------------------------------- real checkpoints

@functools.lru_cache(maxsize=None)
def real_checkpoint(name: str):
    from longattn.checkpoint import load_checkpoint
    return load_checkpoint(name, progress=False)


@functools.lru_cache(maxsize=None)
def real_model(name: str, dtype=torch.float32):
    from longattn.models import build_model
    ck = real_checkpoint(name)
    return build_model(ck.config, ck.state_dict, dtype=dtype)


def oracle_dir(name: str) -> str:
    from longattn.checkpoint.oracle import oracle_dir as _od
    return _od(name)


@functools.lru_cache(maxsize=1)
def oracle_model(name: str):
    from longattn.checkpoint.oracle import oracle_model as _om
    return _om(name)


def book_text(chars: int = 20000, name: str = "nltk_melville-moby_dick.txt") -> str:
    from longattn.data import book_path
    text = book_path(name).read_text(errors="ignore")
    return text[5000: 5000 + chars]


# ---------------------------------------------------------------- three ways to run a model

def three_ways(model, ids: torch.Tensor, chunk: int = 16, prefill: int = 32, hf: bool = False) -> dict:
    """Logits ``[B, T, V]`` of ``ids [B, T]`` run as one full forward, as a prefill in chunks of
    ``chunk`` tokens through a cache, and as a ``prefill``-token prefill then one-token steps.

    ``model`` is a longattn Transformer (with its checkpoint's cache from ``make_cache``) or,
    with ``hf=True``, a transformers model (with its own DynamicCache), so the same three runs
    can be compared side by side.
    """
    T = ids.shape[1]

    def reset():
        if hf:  # a 1-token call resets transformers' dynamic-rope state (it keeps the longest seen)
            with torch.no_grad():
                model(ids[:, :1])

    def run(pieces):
        reset()
        cache, outs = None, []
        if not hf:
            from longattn.cache import make_cache
            cache = make_cache(model.config, batch=ids.shape[0], model=model)
        for a, b in pieces:
            if hf:
                with torch.no_grad():
                    o = model(ids[:, a:b], past_key_values=cache, use_cache=cache is not None or b < T)
                cache = o.past_key_values
                outs.append(o.logits)
            else:
                outs.append(model(ids[:, a:b], cache=cache))
        return torch.cat(outs, dim=1)

    reset()
    with torch.no_grad():
        full = model(ids).logits if hf else model(ids)
    chunked = run([(a, min(T, a + chunk)) for a in range(0, T, chunk)])
    steps = run([(0, prefill)] + [(t, t + 1) for t in range(prefill, T)])
    return {"full": full, "chunked": chunked, "step": steps}


# ---------------------------------------------------------------- per-directory settings

# Folders whose tests run tiny ops: one intra-op thread there (on a small shared box a second
# thread only adds OpenMP wake-ups and barrier stalls).
ONE_THREAD_DIRS = ("sparse", "cache")


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_ops(request):
    """One intra-op thread for tests under ``ONE_THREAD_DIRS``. Keyed by folder here rather
    than in a conftest.py per folder: a second conftest.py outside a package takes over the
    module name ``conftest`` and breaks ``from conftest import ...`` in every test module
    collected after it."""
    if request.node.path.parent.name not in ONE_THREAD_DIRS:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
