"""A GGUF's RoPE scaling: a Llama 3 file's ``rope_freqs.weight`` (per-frequency divisors, as
llama.cpp's converter writes them) is honoured, to transformers' logits on the HF directory
the file was written from; scaling keys longattn does not implement are refused."""

import numpy as np
import pytest
import torch

from conftest import three_ways, tiny_dir
from longattn.checkpoint.gguf_file import load_gguf
from longattn.errors import LongattnError

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (rotation pairs made adjacent)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_llama_gguf(path, hf, rope_freqs=None, extra=None):
    """A GGUF of transformers model ``hf`` (llama layout, float32 tensors)."""
    import gguf
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for fn in (extra or []):
        fn(w)
    sd = {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g == "attn_q":
                t = _llamacpp_permute(t, c.num_attention_heads)
            elif g == "attn_k":
                t = _llamacpp_permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama3_hf():
    from transformers import AutoModelForCausalLM
    d = tiny_dir("llama", rope_parameters=LLAMA3, max_position_embeddings=64)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()


def _divisors(hf) -> np.ndarray:
    """transformers' own llama3 frequencies as divisors of the plain ones (what rope_freqs holds)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config)
    d = hf.config.head_dim
    plain = 1.0 / (LLAMA3["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return (plain / scaled).numpy().astype(np.float32)


def test_gguf_rope_freqs_honoured(tmp_path):
    from longattn.models import build_model
    hf = _llama3_hf()
    path = tmp_path / "llama3.gguf"
    _write_llama_gguf(path, hf, rope_freqs=_divisors(hf))
    cfg, sd = load_gguf(path)
    assert cfg.rope_scaling["rope_type"] == "freq_factors"
    ours = build_model(cfg, sd)
    ids = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(4))
    a, b = three_ways(ours, ids), three_ways(hf, ids, hf=True)
    for mode in a:
        err = (a[mode] - b[mode]).abs().max().item()
        assert err < 1e-4, f"{mode}: max |delta logit| {err:.2e}"


@pytest.mark.parametrize("extra, match", [
    ([lambda w: w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN),
      lambda w: w.add_rope_scaling_factor(4.0)], "scaling type 'yarn' in a GGUF is not implemented"),
    ([lambda w: w.add_rope_scaling_yarn_log_mul(0.1)], "yarn_log_multiplier is not implemented"),
    ([lambda w: w.add_rope_scaling_factor(4.0)], "factor 4.0 without a scaling type"),
])
def test_gguf_rope_scaling_refused(tmp_path, extra, match):
    hf = _llama3_hf()
    path = tmp_path / "x.gguf"
    _write_llama_gguf(path, hf, extra=extra)
    with pytest.raises(LongattnError, match=match):
        load_gguf(path)


def test_gguf_linear_scaling_read(tmp_path):
    import gguf
    hf = _llama3_hf()
    path = tmp_path / "lin.gguf"
    _write_llama_gguf(path, hf, extra=[lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                       lambda w: w.add_rope_scaling_factor(4.0)])
    cfg, _ = load_gguf(path)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
