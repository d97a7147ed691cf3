"""Tiny random models of each family, made and saved by transformers, loaded by longattn:
logits within 1e-4 of transformers (both float32; the gap is summation order only)."""

import pytest
import torch

from conftest import tiny_pair

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_logits_match_transformers(family):
    ours, hf = tiny_pair(family)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=g)  # 40 > gemma's window 8
    a = ours(ids)
    with torch.no_grad():
        b = hf(ids).logits
    err = (a - b).abs().max().item()
    assert err < 1e-4, f"{family}: max |delta logit| {err:.2e}"
    if family == "gemma3":
        assert ours.config.layer_windows == [8, 8, None, 8, 8, None]
        assert ours.config.layer_rope_theta == [1e4, 1e4, 1e6, 1e4, 1e4, 1e6]


def test_gemma3_window_matters_in_tiny():
    """If our model ignored the checkpoint's window, the logits past position 8 would differ."""
    from longattn.policy import AttentionPolicy
    ours, hf = tiny_pair("gemma3")
    ids = torch.randint(0, ours.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    windowed = ours(ids)
    with pytest.warns(UserWarning, match="different function"):
        dense_policy = AttentionPolicy.build(ours.config, "dense")
    dense = ours(ids, policy=dense_policy)
    assert torch.equal(windowed[:, :8], dense[:, :8])
    assert (windowed[:, 8:] - dense[:, 8:]).abs().max() > 1e-3
