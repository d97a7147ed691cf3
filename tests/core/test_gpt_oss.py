"""gpt-oss from a tiny random checkpoint saved by transformers: learned per-head sink logits
in every softmax denominator, the top-k routed MoE MLP, alternating windows and yarn rope;
logits within 1e-4 of transformers on the full forward, chunked prefill and step decode.
Attention sites with no term for learned sinks refuse the model with one line."""

import pytest
import torch

from conftest import three_ways, tiny_dir
from longattn.errors import LongattnError

CASES = {"windowed": ({}, [8, None, 8]), "full": ({"sliding_window": 4096}, [4096, None, 4096])}


def _pair(over):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = tiny_dir("gpt_oss", **over)
    ck = load_checkpoint(d, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return build_model(ck.config, ck.state_dict), hf


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_oss_matches_transformers(name):
    over, windows = CASES[name]
    ours, hf = _pair(over)
    cfg = ours.config
    assert cfg.layer_windows == windows and cfg.learned_sinks and cfg.num_experts == 4
    assert cfg.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(8))
    a, b = three_ways(ours, ids), three_ways(hf, ids, hf=True)
    for mode in a:
        err = (a[mode] - b[mode]).abs().max().item()
        assert err < 1e-4, f"gpt_oss {name} {mode}: max |delta logit| {err:.2e}"
    # the learned sinks matter: without them (logit -inf) the logits move
    for blk in ours.model.layers:
        blk.self_attn.sinks.data.fill_(-1e30)
    assert (ours(ids) - a["full"]).abs().max() > 1e-3


def test_gpt_oss_refused_where_sinks_have_no_term():
    from longattn.engine.static_step import StaticDecoder
    from longattn.sparse.policy import build_sparse_policy
    ours, _ = _pair({})
    ids = torch.randint(0, ours.config.vocab_size, (1, 4))
    sparse = build_sparse_policy(ours.config)
    with pytest.raises(LongattnError, match="SparseOp has no term for this model's learned sink logits"):
        ours(ids, policy=sparse)
    with pytest.raises(LongattnError, match="static decoder's step has no term for learned sink"):
        StaticDecoder(ours, compile=False)
