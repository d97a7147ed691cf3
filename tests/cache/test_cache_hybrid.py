"""Hybrid local/global cache (rings on windowed layers, growing on global ones): layout,
exactness, byte accounting, and the comparison with transformers' cache.

transformers (cache_utils.DynamicSlidingWindowLayer) keeps ``sliding_window - 1`` past
tokens on a sliding layer; our ring keeps ``window`` slots (plus sinks), one more, so a
single-token decode step can write before it reads and hand the ring to the op as is.
Measured and asserted exactly below for tiny Gemma 3 (through transformers' own model)
and real Gemma-3-270M (transformers' cache fed the same keys through a tee).
"""

from __future__ import annotations

import pytest
import torch

from conftest import real_model, tiny_model, tiny_pair
from longattn.cache import (GrowingLayerCache, KVCache, RingLayerCache, layer_report, make_cache,
                            plan_layers)
from longattn.errors import LongattnError
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _hf_bytes(layer) -> tuple:
    """(logical bytes = numel * itemsize, allocated storage bytes) of one transformers layer."""
    logical = layer.keys.nbytes + layer.values.nbytes
    return logical, _storage_bytes(layer.keys) + _storage_bytes(layer.values)


# ---------------------------------------------------------------- layout and errors

def test_make_cache_layout_for_gemma3_checkpoint_policy():
    m = tiny_model("gemma3")
    cfg = m.config
    pol = AttentionPolicy.from_config(cfg)
    assert cfg.layer_windows == [8, 8, None, 8, 8, None]
    cache = make_cache(cfg, pol)
    assert plan_layers(pol) == ["ring", "ring", "growing", "ring", "ring", "growing"]
    for layer, w in zip(cache.layers, cfg.layer_windows):
        if w is None:
            assert type(layer) is GrowingLayerCache
        else:
            assert type(layer) is RingLayerCache and (layer.window, layer.sinks) == (w, 0)
    withsinks = make_cache(cfg, AttentionPolicy.build(cfg, "checkpoint", sinks=2), slack=3)
    assert [(l.window, l.sinks) for l in withsinks.layers if isinstance(l, RingLayerCache)] == [(11, 2)] * 4
    assert all(type(l) is GrowingLayerCache for l in make_cache(cfg, pol, kind="growing").layers)
    assert all(type(l) is RingLayerCache
               for l in make_cache(cfg, AttentionPolicy.build(cfg, "window", window=4), kind="bounded").layers)


@pytest.mark.parametrize("kw, match", [
    ({"kind": "bounded"}, "layer\\(s\\) 2, 5 attend globally"),
    ({"kind": "ring-ish"}, "unknown cache kind"),
    ({"slack": -1}, "slack"),
    ({"batch": 0}, "batch"),
    ({"reindex": True}, "model's RoPE"),
    ({"reindex": True, "kind": "growing"}, "reindex needs ring layers"),
])
def test_make_cache_bad_settings_raise_one_line(kw, match):
    cfg = tiny_model("gemma3").config
    with pytest.raises(LongattnError, match=match) as e:
        make_cache(cfg, AttentionPolicy.from_config(cfg), **kw)
    assert "\n" not in str(e.value)


def test_make_cache_rejects_policy_of_another_model():
    cfg = tiny_model("gemma3").config
    other = tiny_model("llama").config
    with pytest.raises(LongattnError, match="policy has 3 layers; the model has 6"):
        make_cache(cfg, AttentionPolicy.from_config(other))


# ---------------------------------------------------------------- exactness and bounds

def test_gemma3_hybrid_cache_is_exact_and_local_layers_stay_bounded():
    """Tiny Gemma 3 (float64): hybrid cache == growing cache == full forward, with local
    layers holding at most W slots and global layers holding every token."""
    m = tiny_model("gemma3", dtype=torch.float64)
    cfg = m.config
    pol = AttentionPolicy.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(0))
    full = m(ids, policy=pol)
    hybrid = make_cache(cfg, pol, dtype=torch.float64)
    grow = make_cache(cfg, pol, kind="growing", dtype=torch.float64)
    outs = {}
    sizes = []
    for name, cache in (("hybrid", hybrid), ("growing", grow)):
        s = Session(m, pol, cache)
        got = [s.prefill([ids[0, :30].tolist()], chunk=7, logits="all")]
        for t in range(30, 50):
            got.append(s.step(ids[:, t])[:, None])
            if name == "hybrid":
                sizes.append((t + 1, hybrid.tokens(), hybrid.layer_bytes()))
        outs[name] = torch.cat(got, dim=1)
    for name, out in outs.items():
        assert (out - full).abs().max().item() < 1e-10, name
    local = [i for i, w in enumerate(cfg.layer_windows) if w]
    glob = [i for i, w in enumerate(cfg.layer_windows) if w is None]
    for n, toks, nbytes in sizes:
        assert all(toks[i] == 8 for i in local)
        assert all(toks[i] == n for i in glob)
        assert all(nbytes[i] == sizes[0][2][i] for i in local)  # constant
    assert grow.tokens() == [50] * cfg.num_layers


def test_nbytes_are_the_real_bytes():
    m = tiny_model("gemma3")
    cfg = m.config
    pol = AttentionPolicy.from_config(cfg)
    for exact in (False, True):
        cache = make_cache(cfg, pol, batch=2, exact_capacity=exact)
        Session(m, pol, cache).prefill([list(range(1, 21)), list(range(1, 14))], chunk=6)
        for layer in cache.layers:
            assert layer.nbytes() == _storage_bytes(layer.k) + _storage_bytes(layer.v)
        assert cache.nbytes() == sum(cache.layer_bytes())
        if exact:
            per_token = 2 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K+V, 2 streams, float32
            assert cache.layer_bytes() == [per_token * (8 if w else 20) for w in cfg.layer_windows]
        rep = layer_report(cache)
        assert [r.nbytes for r in rep] == cache.layer_bytes()
        assert [r.tokens for r in rep] == cache.tokens()


# ---------------------------------------------------------------- against transformers

def test_tiny_gemma3_cache_sizes_against_transformers(capsys):
    """Same weights in both libraries: after a 40-token prefill and each of 3 decode steps,
    transformers' sliding layers hold W-1 = 7 tokens, our rings W = 8; global layers hold
    every token in both. Keys match (both float32, summation-order gap as in the tiny
    oracle test: 1e-4)."""
    ours, hf = tiny_pair("gemma3")
    cfg = ours.config
    W = 8
    ids = torch.randint(0, cfg.vocab_size, (1, 43), generator=torch.Generator().manual_seed(1))
    cache = make_cache(cfg, AttentionPolicy.from_config(cfg), exact_capacity=True)
    s = Session(ours, None, cache)
    a = s.prefill([ids[0, :40].tolist()], chunk=0)[:, 0]
    with torch.no_grad():
        out = hf(ids[:, :40], use_cache=True)
    pkv = out.past_key_values
    slot = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K+V bytes of one token, one layer
    local = [i for i, w in enumerate(cfg.layer_windows) if w]
    for step in range(4):
        T = 40 + step
        assert (a - out.logits[:, -1]).abs().max().item() < 1e-4
        hf_logical = [_hf_bytes(l)[0] for l in pkv.layers]
        hf_storage = [_hf_bytes(l)[1] for l in pkv.layers]
        ours_b = cache.layer_bytes()
        for i, w in enumerate(cfg.layer_windows):
            assert pkv.layers[i].keys.shape[2] == (W - 1 if w else T)
            assert cache.layers[i].tokens() == (W if w else T)
            assert ours_b[i] == hf_logical[i] + (slot if w else 0)
        assert sum(ours_b) - sum(hf_logical) == len(local) * slot
        for i in local:  # transformers' W-1 tokens are our last W-1 positions
            k, _, p = cache.layers[i].view()
            order = torch.argsort(p[0])[1:]  # drop the oldest of our W
            assert p[0, order].tolist() == list(range(T - W + 1, T))
            assert (k[:, :, order] - pkv.layers[i].keys).abs().max().item() < 1e-4
        with capsys.disabled():
            print(f"\n[tiny gemma3, T={T}] ours {sum(ours_b)} B; transformers {sum(hf_logical)} B logical, "
                  f"{sum(hf_storage)} B allocated storage")
        if step == 3:
            break
        a = s.step(ids[:, T])
        with torch.no_grad():
            out = hf(ids[:, T:T + 1], past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values


class _Tee(KVCache):
    """Our cache, also feeding every layer's keys/values to a transformers cache."""

    def __init__(self, ours: KVCache, theirs):
        super().__init__(ours.cfg, ours.batch, layers=ours.layers)
        self.theirs = theirs

    def update(self, layer, k, v, pos):
        self.theirs.update(k, v, layer)
        return super().update(layer, k, v, pos)


def _hf_config_like(cfg):
    from transformers import Gemma3TextConfig
    ws = [w for w in cfg.layer_windows if w]
    return Gemma3TextConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            sliding_window=ws[0],
                            layer_types=["sliding_attention" if w else "full_attention"
                                         for w in cfg.layer_windows])


@pytest.mark.real
def test_real_gemma3_270m_cache_sizes_against_transformers(capsys):
    """Real Gemma-3-270M (window 512 on 15 of 18 layers), 600-token prefill + 2 steps:
    local rings stay at 512 slots, global layers grow; transformers' DynamicCache, fed the
    very same keys, keeps 511 on sliding layers -- and they are bit-identical to ours."""
    from transformers import DynamicCache
    m = real_model("gemma3-270m")
    cfg = m.config
    W, T = 512, 600
    assert sum(w == W for w in cfg.layer_windows) == 15
    ours = make_cache(cfg, AttentionPolicy.from_config(cfg), exact_capacity=True)
    theirs = DynamicCache(config=_hf_config_like(cfg))
    tee = _Tee(ours, theirs)
    ids = torch.randint(0, 4096, (T + 2,), generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a real model: big matmuls, two threads pay
    try:
        # hidden states only: the 262K-entry head over 600 positions would dominate the run
        m(ids[None, :T], cache=tee, logits="none")
        slot = 2 * cfg.num_kv_heads * cfg.head_dim * 4
        for step in range(3):
            n = T + step
            logical = [_hf_bytes(l)[0] for l in theirs.layers]
            storage = [_hf_bytes(l)[1] for l in theirs.layers]
            mine = tee.layer_bytes()
            for i, w in enumerate(cfg.layer_windows):
                assert tee.layers[i].tokens() == (W if w else n)
                assert theirs.layers[i].keys.shape[2] == (W - 1 if w else n)
                assert mine[i] == logical[i] + (slot if w else 0)
                if w:
                    k, _, p = tee.layers[i].view()
                    order = torch.argsort(p[0])[1:]
                    assert torch.equal(k[:, :, order], theirs.layers[i].keys)
            # the lab's formula, to the byte, against both caches
            from longattn.lab import hybrid_cache_bytes
            assert hybrid_cache_bytes(cfg, n) == sum(mine)
            assert hybrid_cache_bytes(cfg, n, convention="transformers") == sum(logical)
            with capsys.disabled():
                print(f"\n[gemma3-270m, T={n}] ours {sum(mine)} B; transformers {sum(logical)} B logical, "
                      f"{sum(storage)} B allocated storage; difference = 15 layers x {slot} B")
            if step < 2:
                m(ids[None, n:n + 1], cache=tee, logits="none")
    finally:
        torch.set_num_threads(before)
