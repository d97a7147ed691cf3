"""Every family from a tiny random checkpoint made and saved by transformers: longattn's logits
within 1e-4 of transformers' (float32, eager attention) on the full forward, a chunked prefill
and step decode, with the checkpoint's windows (small enough that 48 tokens cross them) and
without; and the window pattern each family's config implies, read from its checkpoint."""

import pytest
import torch

from conftest import three_ways, tiny_dir

W = 8
CASES = {
    # name: (family, config fields, expected layer_windows for 3 layers)
    "mistral": ("mistral", {}, [W, W, W]),
    "mistral-nowindow": ("mistral", {"sliding_window": None}, [None] * 3),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
                     [None, W, W]),
    "qwen2-layer-types": ("qwen2", {"use_sliding_window": True, "sliding_window": W,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                          [W, None, W]),
    "qwen2-window-off": ("qwen2", {"use_sliding_window": False, "sliding_window": W, "max_window_layers": 0},
                         [None] * 3),
    "phi3": ("phi3", {}, [W, W, W]),
    "phi3-nowindow": ("phi3", {"sliding_window": None}, [None] * 3),
    "gemma2": ("gemma2", {}, [W, None, W]),
    "gemma2-wide": ("gemma2", {"sliding_window": 4096}, [4096, None, 4096]),
}


def _pair(family, over):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = tiny_dir(family, **over)
    ck = load_checkpoint(d, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return build_model(ck.config, ck.state_dict), hf


@pytest.mark.parametrize("name", list(CASES))
def test_family_matches_transformers(name):
    family, over, windows = CASES[name]
    ours, hf = _pair(family, over)
    assert ours.config.family == family and ours.config.layer_windows == windows
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))
    a, b = three_ways(ours, ids), three_ways(hf, ids, hf=True)
    for mode in a:
        err = (a[mode] - b[mode]).abs().max().item()
        assert err < 1e-4, f"{name} {mode}: max |delta logit| {err:.2e}"
    if any(w == W for w in windows):  # the window changes the function on this input
        from longattn.policy import AttentionPolicy
        with pytest.warns(UserWarning, match="different function"):
            dense = ours(ids, policy=AttentionPolicy.build(ours.config, "dense"))
        assert torch.equal(dense[:, :W], a["full"][:, :W])
        assert (dense[:, W:] - a["full"][:, W:]).abs().max() > 1e-3


def test_gemma2_hybrid_cache_bounds_local_layers():
    """Gemma 2's local layers get rings of the window; its global layers grow."""
    from longattn.cache import GrowingLayerCache, RingLayerCache, make_cache
    ours, _ = _pair("gemma2", {})
    cache = make_cache(ours.config, model=ours)
    assert [type(c) for c in cache.layers] == [RingLayerCache, GrowingLayerCache, RingLayerCache]
    ids = torch.randint(0, ours.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
    ours(ids, cache=cache)
    assert cache.layers[0].window == W and cache.layers[1].k.shape[2] >= 40


def test_gemma2_cache_command_formula_to_the_byte():
    """The lab's cache measurement (real cache objects) equals the hybrid-cache formula for
    Gemma 2's alternation: window slots on local layers, every token on global ones."""
    from longattn.checkpoint import load_checkpoint
    from longattn.lab.cachebytes import measure_cache
    from longattn.policy import AttentionPolicy
    cfg = load_checkpoint(tiny_dir("gemma2"), with_tokenizer=False).config
    pol = AttentionPolicy.build(cfg, "checkpoint")
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    for T in (3, W, 40):
        r = measure_cache(cfg, pol, T)
        assert r["held_bytes"] == r["formula_bytes"] == per_token * (2 * min(T, W) + T)
        if T >= W:
            assert r["allocated_bytes"] == r["formula_bytes"]
