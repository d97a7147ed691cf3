"""Closed-form window arithmetic against explicit masks and hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longattn.errors import LongattnError
from longattn.lab import (PUBLISHED_CONFIGS, attention_pairs, bounded_cache_tokens,
                          hybrid_cache_bytes, reach, window_mask)
from longattn.ops import allowed_mask


def test_design_example_16_tokens_window_4():
    assert attention_pairs(16, 4) == 58
    assert attention_pairs(16, None) == 136
    assert int(window_mask(16, 4).sum()) == 58


def test_32k_causal_reads_16_3_times_the_pairs_of_a_1024_window():
    causal, windowed = attention_pairs(32768, None), attention_pairs(32768, 1024)
    assert causal == 32768 * 32769 // 2
    assert windowed == 1024 * 1025 // 2 + (32768 - 1024) * 1024
    assert round(causal / windowed, 1) == 16.3


@pytest.mark.parametrize("T", [0, 1, 2, 5, 16, 33])
@pytest.mark.parametrize("W", [None, 0, -3, 1, 2, 4, 16, 40])
@pytest.mark.parametrize("S", [0, 1, 4, 50])
def test_pairs_equal_mask_count_grid(T, W, S):
    assert attention_pairs(T, W, S) == int(window_mask(T, W, S).sum())


@settings(max_examples=200, deadline=None)
@given(T=st.integers(0, 48), W=st.one_of(st.none(), st.integers(-2, 60)), S=st.integers(0, 10))
def test_pairs_equal_mask_count_property(T, W, S):
    assert attention_pairs(T, W, S) == int(window_mask(T, W, S).sum())


@settings(max_examples=50, deadline=None)
@given(T=st.integers(1, 40), W=st.one_of(st.none(), st.integers(0, 45)), S=st.integers(0, 6))
def test_window_mask_agrees_with_the_ops_mask(T, W, S):
    pos = torch.arange(T)[None]
    assert torch.equal(window_mask(T, W, S), allowed_mask(pos, pos, W, S)[0, 0])


def test_window_mask_definition_small():
    m = window_mask(5, 2, sinks=1)
    expect = torch.tensor([[1, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0],
                           [1, 1, 1, 0, 0],   # key 0 is a sink, key 1 left the window
                           [1, 0, 1, 1, 0],
                           [1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expect)


def test_reach():
    assert reach(18, 512) == 18 * 511
    assert reach(3, 1) == 0
    assert reach(4, None) == math.inf and reach(4, 0) == math.inf


def test_bounded_cache_tokens_longattn_ring():
    assert bounded_cache_tokens(100, 512) == 100           # not yet full
    assert bounded_cache_tokens(10_000, 512) == 512        # W rotating slots
    assert bounded_cache_tokens(10_000, 512, sinks=4) == 516
    assert bounded_cache_tokens(10_000, 512, sinks=4, slack=64) == 580
    assert bounded_cache_tokens(515, 512, sinks=4) == 515
    assert bounded_cache_tokens(10_000, None) == 10_000    # global layer


def test_bounded_cache_tokens_transformers_matches_its_dynamic_sliding_layer():
    # transformers/cache_utils.py DynamicSlidingWindowLayer keeps the last W-1 tokens.
    from transformers.cache_utils import DynamicSlidingWindowLayer
    for W in (1, 2, 4, 8):
        for prefill in (1, 3, 4, 5, 10):
            layer = DynamicSlidingWindowLayer(sliding_window=W)
            x = torch.zeros(1, 1, prefill, 2)
            layer.update(x, x)
            T = prefill
            assert layer.keys.shape[-2] == bounded_cache_tokens(T, W, convention="transformers")
            for _ in range(3):  # then decode steps
                x = torch.zeros(1, 1, 1, 2)
                layer.update(x, x)
                T += 1
                assert layer.keys.shape[-2] == bounded_cache_tokens(T, W, convention="transformers")
    assert bounded_cache_tokens(10_000, 512, convention="transformers") == 511


def test_bounded_cache_tokens_errors():
    with pytest.raises(LongattnError, match="convention"):
        bounded_cache_tokens(10, 4, convention="vllm")
    with pytest.raises(LongattnError, match="sink"):
        bounded_cache_tokens(10, 4, sinks=1, convention="transformers")
    with pytest.raises(LongattnError, match="T"):
        bounded_cache_tokens(-1, 4)


def test_hybrid_bytes_gemma3_270m_by_hand():
    cfg = PUBLISHED_CONFIGS["gemma-3-270m"]
    assert cfg.num_layers == 18 and cfg.num_kv_heads == 1 and cfg.head_dim == 256
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17]
    assert set(w for w in cfg.layer_windows if w is not None) == {512}
    per_token_layer = 2 * 1 * 256 * 4  # K and V, one KV head, head_dim 256, fp32 = 2048 bytes
    T = 32768
    expect = 15 * 512 * per_token_layer + 3 * T * per_token_layer  # 15 MiB + 192 MiB
    assert expect == 217_055_232
    assert hybrid_cache_bytes(cfg, T) == expect
    per = hybrid_cache_bytes(cfg, T, per_layer=True)
    assert len(per) == 18 and per[5] == T * per_token_layer and per[0] == 512 * per_token_layer
    # transformers keeps W-1 = 511 tokens on sliding layers; bf16 halves everything
    assert hybrid_cache_bytes(cfg, T, convention="transformers") == 15 * 511 * 2048 + 3 * T * 2048
    assert hybrid_cache_bytes(cfg, T, dtype=torch.bfloat16) == expect // 2
    # 4 sinks add 4 slots per windowed layer
    assert hybrid_cache_bytes(cfg, T, sinks=4) == expect + 15 * 4 * 2048
    # short prompt: nothing is bounded yet
    assert hybrid_cache_bytes(cfg, 100) == 18 * 100 * 2048


def test_hybrid_bytes_accepts_any_config_like_object():
    from types import SimpleNamespace
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, layer_windows=[4, None])
    assert hybrid_cache_bytes(cfg, 10, dtype=torch.float16) == 2 * 2 * 8 * 2 * (4 + 10)
    bad = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8, layer_windows=[4, None])
    with pytest.raises(LongattnError, match="layer windows"):
        hybrid_cache_bytes(bad, 10)


def test_published_configs_are_consistent():
    expected = {"gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-270m", "gemma-3-1b",
                "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "mistral-7b-v0.1", "qwen2.5-0.5b",
                "smollm2-135m", "llama-3.2-1b"}
    assert expected <= set(PUBLISHED_CONFIGS)
    for name, c in PUBLISHED_CONFIGS.items():
        assert c.name == name and c.source
        assert len(c.layer_windows) == c.num_layers
        assert c.num_heads % c.num_kv_heads == 0
    g2 = PUBLISHED_CONFIGS["gemma-2-9b"]
    assert g2.layer_windows[:4] == (4096, None, 4096, None)  # alternating, local first
    g3 = PUBLISHED_CONFIGS["gemma-3-27b"]
    assert [i for i, w in enumerate(g3.layer_windows) if w is None] == list(range(5, 62, 6))
    assert PUBLISHED_CONFIGS["gemma-3-1b"].windowed_layers == 22
    assert PUBLISHED_CONFIGS["mistral-7b-v0.1"].layer_windows == (4096,) * 32
    assert PUBLISHED_CONFIGS["mistral-7b-v0.1"].head_dim == 128
    assert PUBLISHED_CONFIGS["smollm2-135m"].windowed_layers == 0
