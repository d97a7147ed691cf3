"""RoPE scaling against transformers: each rope_type of transformers' modeling_rope_utils on a
tiny random Llama whose original context (16) a 48-token input passes three times over, run
as a full forward, a chunked prefill and step decode; and refusals of what is not implemented."""

import pytest
import torch

from conftest import three_ways, tiny_dir
from longattn.checkpoint.hf_dir import read_hf_config
from longattn.errors import LongattnError

ORIG = 16
D2 = 8  # head_dim 16 -> 8 frequencies
SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, ORIG),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIG}, 64),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}, 64),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
                     "mscale": 0.9, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}, 64),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                               "original_max_position_embeddings": ORIG, "truncate": False}, 64),
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": ORIG,
                  "short_factor": [1.0 + 0.1 * i for i in range(D2)],
                  "long_factor": [1.5 + 0.7 * i for i in range(D2)]}, 64),
}


def _pair(name):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    scaling, max_pos = SCALINGS[name]
    d = tiny_dir("llama", rope_parameters={**scaling, "rope_theta": 10000.0}, max_position_embeddings=max_pos)
    ck = load_checkpoint(d, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return build_model(ck.config, ck.state_dict), hf


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_scaling_matches_transformers(name):
    ours, hf = _pair(name)
    assert ours.config.rope_scaling["rope_type"] == SCALINGS[name][0]["rope_type"]
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    a, b = three_ways(ours, ids), three_ways(hf, ids, hf=True)
    for mode in a:
        err = (a[mode] - b[mode]).abs().max().item()
        assert err < 1e-4, f"{name} {mode}: max |delta logit| {err:.2e}"
    # the scaling is not a no-op here: plain rope gives other logits past the original context
    from longattn.config import ModelConfig
    from longattn.models import build_model
    plain = ModelConfig.from_dict({**ours.config.to_dict(), "rope_scaling": None, "layer_rope_scaling": []})
    sd = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    unscaled = build_model(plain, sd, fuse=False)(ids)
    assert (unscaled[:, ORIG:] - a["full"][:, ORIG:]).abs().max() > 1e-3


def _cfg(**over):
    d = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    d.update(over)
    return d


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "su", "factor": 2.0}, "rope_type 'su' is not implemented"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "does not use beta_fast"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs high_freq_factor, low_freq_factor"),
    ({"rope_type": "default", "factor": 2.0}, "not used by plain rope"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, "short_factor has 3"),
])
def test_unimplemented_rope_is_refused(params, match):
    with pytest.raises(LongattnError, match=match):
        read_hf_config(_cfg(rope_parameters={**params, "rope_theta": 1e4}))


def test_old_style_rope_scaling_is_read():
    cfg = read_hf_config(_cfg(rope_parameters=None, rope_theta=5e5,
                              rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.layer_rope_scaling == [cfg.rope_scaling] * 2


def test_length_dependent_rope_refuses_rerotation():
    from longattn.cache import make_cache
    from longattn.policy import AttentionPolicy
    ours, _ = _pair("dynamic")
    pol = AttentionPolicy.build(ours.config, "window", window=8, sinks=2)
    with pytest.raises(LongattnError, match="re-rotates keys"):
        make_cache(ours.config, pol, model=ours, reindex=True)
