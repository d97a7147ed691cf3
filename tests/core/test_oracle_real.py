"""Real bundled checkpoints against transformers loading the same GGUF (the oracle).

A ~1,000-token prompt from a shipped book (longer than Gemma 3's 512 window): float32
logits within 1e-3 max abs at every position, and identical greedy 32-token continuations.
"""

import pytest
import torch

from conftest import book_text, oracle_model, real_checkpoint, real_model
from longattn.engine.sampling import SamplingConfig
from longattn.engine.session import Session, generate

pytestmark = pytest.mark.real

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]


@pytest.mark.parametrize("name", MODELS)
def test_real_logits_and_greedy_match_transformers(name):
    ck = real_checkpoint(name)
    ours = real_model(name)
    hf = oracle_model(name)
    ids = ck.tokenizer(book_text(6000))["input_ids"][:1000]
    assert len(ids) == 1000
    x = torch.tensor([ids])
    with torch.no_grad():
        b = hf(x).logits
    a = ours(x)
    err = (a - b).abs().max().item()
    del a, b
    assert err <= 1e-3, f"{name}: max |delta logit| {err:.3e}"
    res = generate(Session(ours), [ids], 32, SamplingConfig(0.0), stop_ids=set())
    with torch.no_grad():
        out = hf.generate(x, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert res.tokens[0] == out[0, len(ids):].tolist()


def test_gemma3_config_filled_from_family_matches_transformers():
    """The gaps the GGUF leaves (layer pattern, local rope base) match transformers' config."""
    ck = real_checkpoint("gemma3-270m")
    hf = oracle_model("gemma3-270m").config
    cfg = ck.config
    assert cfg.layer_windows == [hf.sliding_window if t == "sliding_attention" else None
                                 for t in hf.layer_types]
    assert sum(w is not None for w in cfg.layer_windows) == 15
    theta = {t: hf.rope_parameters[t]["rope_theta"] for t in ("full_attention", "sliding_attention")}
    assert cfg.layer_rope_theta == [theta[t] for t in hf.layer_types]
    assert cfg.attn_scale == hf.query_pre_attn_scalar ** -0.5
