"""Gemma 3's rope per layer type, from GGUF files and HF directories.

Gemma 3 has two ropes: the global (full-attention) layers' base and scaling (Gemma 3 4B-27B
ship linear x8 there) and the local (sliding) layers' own base without scaling. A GGUF holds
the global ones as ``rope.freq_base`` / ``rope.scaling.*`` and the local base as
``rope.freq_base_swa`` (llama.cpp's converter writes it). The files here are written with
gguf's writer in the layout llama.cpp's converter gives (norms stored as ``1 + w``), from a tiny
random transformers checkpoint whose logits are the oracle (float32, eager): a full forward,
a chunked prefill and step decode, 48 tokens past a window of 8 and a global layer scaled x8.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import three_ways, tiny_dir
from longattn.errors import LongattnError

L = 6
PATTERN6 = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(L)]
LINEAR = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}


def _hf(**over):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir("gemma3", **over), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _write_gemma3_gguf(path, hf, keys):
    """A gemma3 GGUF of transformers model ``hf``; ``keys(writer)`` writes the rope and window keys."""
    import gguf
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    keys(w)
    sd = {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}

    def add(name, t, norm=False):
        w.add_tensor(name, np.ascontiguousarray(t + 1.0 if norm else t))
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"], norm=True)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    norms = {"input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            add(f"blk.{i}.{g}.weight", sd[f"model.layers.{i}.{hf_name}.weight"])
        for hf_name, g in norms.items():
            add(f"blk.{i}.{g}.weight", sd[f"model.layers.{i}.{hf_name}.weight"], norm=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _linear_x8(w):
    import gguf
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)


def _assert_same(ours, hf, what):
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))
    a, b = three_ways(ours, ids), three_ways(hf, ids, hf=True)
    for mode in a:
        err = (a[mode] - b[mode]).abs().max().item()
        assert err < 1e-4, f"{what} {mode}: max |delta logit| {err:.2e}"


# name: (HF fields, GGUF keys, expected global layers)
GGUF_CASES = {
    # llama.cpp's converter: scaling and base for the global layers, freq_base_swa for the local ones
    "scaled-global-swa-base": (dict(rope_parameters=LINEAR, layer_types=PATTERN6),
                               [lambda w: w.add_rope_freq_base(1e6), lambda w: w.add_rope_freq_base_swa(2e4),
                                _linear_x8, lambda w: w.add_sliding_window(8)], PATTERN6),
    # no freq_base_swa: the local base is Gemma3TextConfig's rope_local_base_freq (1e4)
    "default-swa-base": (dict(rope_parameters={**LINEAR, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}},
                              layer_types=PATTERN6),
                         [lambda w: w.add_rope_freq_base(1e6), _linear_x8, lambda w: w.add_sliding_window(8)],
                         PATTERN6),
    # the file's own layer pattern, as a period and as a per-layer list (true = local)
    "pattern-period": (dict(rope_parameters=LINEAR),
                       [lambda w: w.add_rope_freq_base(1e6), lambda w: w.add_rope_freq_base_swa(2e4), _linear_x8,
                        lambda w: w.add_sliding_window(8), lambda w: w.add_sliding_window_pattern(3)],
                       ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(L)]),
    "pattern-list": (dict(rope_parameters=LINEAR, layer_types=["full_attention", "sliding_attention"] * 3),
                     [lambda w: w.add_rope_freq_base(1e6), lambda w: w.add_rope_freq_base_swa(2e4), _linear_x8,
                      lambda w: w.add_sliding_window(8),
                      lambda w: w.add_sliding_window_pattern([False, True] * 3)],
                     ["full_attention", "sliding_attention"] * 3),
    # no sliding window: every layer global, with the global rope (llama.cpp runs it so)
    "no-window": (dict(rope_parameters={**LINEAR, "sliding_attention": LINEAR["full_attention"]},
                       layer_types=["full_attention"] * L),
                  [lambda w: w.add_rope_freq_base(1e6), _linear_x8], ["full_attention"] * L),
}


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gemma3_gguf_rope_per_layer_type(tmp_path, name):
    from longattn.checkpoint.gguf_file import load_gguf
    from longattn.models import build_model
    over, keys, types = GGUF_CASES[name]
    hf = _hf(**over)
    path = tmp_path / f"{name}.gguf"
    _write_gemma3_gguf(path, hf, lambda w: [k(w) for k in keys])
    cfg, sd = load_gguf(path)
    glob = [t == "full_attention" for t in types]
    assert [w is None for w in cfg.layer_windows] == glob
    assert [s is not None for s in cfg.layer_rope_scaling] == glob
    _assert_same(build_model(cfg, sd), hf, name)


def test_gemma3_gguf_scaling_and_local_base_matter(tmp_path):
    """The fixture is one where rope per layer type changes the function: scaling every layer,
    or giving the local layers the global base, moves transformers' logits."""
    ids = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(5))
    ref = _hf(rope_parameters=LINEAR, layer_types=PATTERN6)(ids).logits
    everywhere = {t: LINEAR["full_attention"] for t in LINEAR}
    for other in (everywhere, {**LINEAR, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}):
        moved = (_hf(rope_parameters=other, layer_types=PATTERN6)(ids).logits - ref).abs().max().item()
        assert moved > 1e-2, other


def test_gemma3_gguf_27b_query_scale():
    """A 62-layer Gemma 3 GGUF (gemma-3-27b) scales queries by hidden / heads, as its published
    config's query_pre_attn_scalar (168) and llama.cpp do; other sizes by head_dim."""
    from longattn.checkpoint.family_gaps import gemma3_query_pre_attn_scalar
    assert gemma3_query_pre_attn_scalar(62, 5376, 32, 128) == 168.0
    assert gemma3_query_pre_attn_scalar(34, 2560, 8, 256) == 256.0


# ---------------------------------------------------------------- HF directories

def _edited(tmp_path, edit, **over) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(tiny_dir("gemma3", **over), d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _older(c, **keys):
    """The pre-5 Gemma 3 fields: one rope_scaling for the global layers, rope_theta,
    rope_local_base_freq."""
    c.pop("rope_parameters")
    c.update({"rope_scaling": {"rope_type": "linear", "factor": 8.0}, **keys})


HF_CASES = {
    "older-fields": lambda c: _older(c, rope_theta=1e6, rope_local_base_freq=2e4),
    # rope_theta and rope_local_base_freq default to Gemma3TextConfig's 1e6 and 1e4
    "older-fields-default-bases": lambda c: _older(c),
    "nested-without-bases": lambda c: c.update(
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0},
                         "sliding_attention": {"rope_type": "default"}}, rope_theta=5e5, rope_local_base_freq=3e3),
    "nested-global-only": lambda c: c.update(
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_gemma3_hf_rope_per_layer_type(tmp_path, name):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = _edited(tmp_path, HF_CASES[name], rope_parameters=LINEAR)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ck = load_checkpoint(str(d), with_tokenizer=False)
    assert [s is not None for s in ck.config.layer_rope_scaling] == \
        [t == "full_attention" for t in hf.config.layer_types]
    _assert_same(build_model(ck.config, ck.state_dict), hf, name)


def test_gemma3_flat_rope_parameters_refused(tmp_path):
    """transformers' Gemma 3 ignores rope keys outside full_attention / sliding_attention."""
    from longattn.checkpoint import load_checkpoint
    d = _edited(tmp_path, lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 8.0,
                                                              "rope_theta": 1e6}))
    with pytest.raises(LongattnError, match="must be nested per layer type"):
        load_checkpoint(str(d), with_tokenizer=False)
