"""Ring cache == masked dense attention at every step, chunked
prefill into a ring == one-shot windowed attention, constant memory, and StreamingLLM
position re-indexing.

Op-level checks run in float64 against ``reference_attention`` over the full history with
the same position mask: both sides sum the same terms, so 1e-10 leaves six orders of
magnitude of room over float64 rounding while any wrong or missing key moves the output
by O(1e-2) or more.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from longattn.cache import (LAYER_CACHES, GrowingLayerCache, KVCache, RingLayerCache, make_cache,
                            rerotate_error_bound, ring_slot)
from longattn.errors import LongattnError
from longattn.models.rope import rerotate, rotate_half
from longattn.ops import allowed_mask, masked_attention, reference_attention
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session
from tolerance import derived_bound

TOL = 1e-10
H, HKV, D = 4, 2, 8


def _stream(B, P, seed=0):
    """Random float64 q [B, H, P, D], k/v [B, Hkv, P, D]; index = absolute position."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, P, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, P, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, P, D, generator=g, dtype=torch.float64)
    return q, k, v


def _take(x, pos):
    """x [B, h, P, D] at positions pos [B, T] (-1 -> zeros) -> [B, h, T, D]."""
    B, h, _, Dd = x.shape
    idx = pos.clamp(min=0)[:, None, :, None].expand(B, h, pos.shape[1], Dd)
    return torch.gather(x, 2, idx) * (pos >= 0)[:, None, :, None]


def _ring_step(ring, q, k, v, pos, W, S):
    """Feed positions ``pos [B, T]``; return the op output over the ring view [B, H, T, D]."""
    k_all, v_all, k_pos = ring.update(_take(k, pos), _take(v, pos), pos)
    mask = allowed_mask(pos, k_pos, W, S)
    return masked_attention(_take(q, pos), k_all, v_all, mask, D ** -0.5)


def _dense(q, k, v, pos, W, S):
    """Reference: the query chunk against the full history, same mask rule."""
    B, _, P, _ = k.shape
    all_pos = torch.arange(P)[None].expand(B, -1)
    mask = allowed_mask(pos, all_pos, W, S)
    return reference_attention(_take(q, pos), k, v, mask, D ** -0.5)


def _expected_ring(last: int, W: int, S: int) -> dict:
    """slot -> position a ring must hold after positions 0..last were fed."""
    out = {p: p for p in range(min(S, last + 1))}
    for p in range(max(S, last - W + 1), last + 1):
        out[S + (p - S) % W] = p
    return out


def _check_contents(ring, lasts, W, S):
    for b, last in enumerate(lasts):
        want = _expected_ring(last, W, S) if last >= 0 else {}
        got = {s: int(p) for s, p in enumerate(ring.pos[b].tolist()) if p >= 0}
        assert got == want, f"row {b}: ring holds {got}, expected {want}"


def test_ring_slot_is_the_design_formula():
    for S in range(5):
        for W in range(1, 12):
            p = torch.arange(200)
            want = [x if x < S else S + (x - S) % W for x in range(200)]
            assert ring_slot(p, S, W).tolist() == want


def test_ring_registered_and_bad_arguments_raise():
    assert LAYER_CACHES["ring"] is RingLayerCache
    for kw in ({"window": 0}, {"window": -3}, {"window": 2.5}, {"window": 4, "sinks": -1}):
        with pytest.raises(LongattnError, match="ring cache"):
            RingLayerCache(1, 2, 8, **kw)
    with pytest.raises(LongattnError, match="inv_freq"):
        RingLayerCache(1, 2, 8, window=4, reindex=True)


def test_ring_equals_masked_dense_every_step_all_windows_and_sinks():
    """Windows 1..30 x sinks 0..4, two streams (the second three steps behind, padded),
    decoded one token at a time well past the wrap; checked at every step."""
    lag = 3
    for W in range(1, 31):
        for S in range(5):
            P = S + W + 8
            q, k, v = _stream(2, P, seed=W * 7 + S)
            ring = RingLayerCache(2, HKV, D, W, S, torch.float64)
            worst = 0.0
            for t in range(P):
                pos = torch.tensor([[t], [t - lag if t >= lag else -1]])  # [B, 1]
                out = _ring_step(ring, q, k, v, pos, W, S)
                ref = _dense(q, k, v, pos, W, S)
                worst = max(worst, (out - ref).abs().max().item())
                assert ring.nbytes() == 2 * 2 * HKV * (S + W) * D * 8
            _check_contents(ring, [P - 1, P - 1 - lag], W, S)
            assert worst < TOL, f"W={W} S={S}: max |ring - dense| {worst:.2e}"


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 30), S=st.integers(0, 4), lag=st.integers(0, 6),
       chunks=st.lists(st.integers(1, 70), min_size=1, max_size=6), seed=st.integers(0, 2 ** 16))
def test_chunked_prefill_into_ring_equals_one_shot_windowed_attention(W, S, lag, chunks, seed):
    """Chunks of any size (also larger than the window) into the ring, concatenated, equal
    one pass of windowed attention over every position."""
    P = sum(chunks)
    q, k, v = _stream(2, P, seed)
    ring = RingLayerCache(2, HKV, D, W, S, torch.float64)
    outs, t0 = [], 0
    for T in chunks:
        p0 = torch.arange(t0, t0 + T)
        p1 = torch.where(p0 >= lag, p0 - lag, torch.full_like(p0, -1))  # second stream lags
        pos = torch.stack((p0, p1))  # [2, T]
        outs.append(_ring_step(ring, q, k, v, pos, W, S))
        t0 += T
    got = torch.cat(outs, dim=2)  # [B, H, P, D]
    p0 = torch.arange(P)
    all_q = torch.stack((p0, torch.where(p0 >= lag, p0 - lag, torch.full_like(p0, -1))))
    ref = _dense(q, k, v, all_q, W, S)  # one shot
    err = (got - ref).abs().max().item()
    assert err < TOL, f"W={W} S={S} chunks={chunks}: {err:.2e}"
    _check_contents(ring, [P - 1, P - 1 - lag], W, S)


def test_ring_memory_constant_after_it_fills():
    W, S = 6, 2
    q, k, v = _stream(1, 40)
    ring = RingLayerCache(1, HKV, D, W, S, torch.float64)
    sizes = {}
    for t in range(40):
        _ring_step(ring, q, k, v, torch.tensor([[t]]), W, S)
        if t + 1 in (8, 40):
            sizes[t + 1] = (ring.nbytes(), ring.tokens(), ring.k.data_ptr())
    assert sizes[8] == sizes[40]
    assert sizes[40][0] == ring.k.numel() * 8 * 2 and sizes[40][1] == S + W
    # a growing cache in the same run keeps growing: the comparison is not vacuous
    grow = GrowingLayerCache(1, HKV, D, torch.float64, initial=4)
    grow.update(k[:, :, :8], v[:, :, :8], torch.arange(8)[None])
    n8 = grow.nbytes()
    grow.update(k[:, :, 8:], v[:, :, 8:], torch.arange(8, 40)[None])
    assert grow.nbytes() > n8


# ---------------------------------------------------------------- model level

@pytest.fixture(scope="module")
def llama64():
    return tiny_model("llama", dtype=torch.float64)


@pytest.mark.parametrize("chunk", [1, 3, 7, 0])
def test_model_ring_session_equals_full_windowed_forward(llama64, chunk):
    """Chunked prefill (chunk 7 > window 5) + decode through a bounded ring == one full
    windowed forward without a cache (float64)."""
    m = llama64
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=5, sinks=2)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    full = m(ids, policy=pol)  # [1, 40, V]
    cache = make_cache(cfg, pol, kind="bounded", dtype=torch.float64)
    s = Session(m, pol, cache)
    pre = s.prefill([ids[0, :25].tolist()], chunk=chunk, logits="all")
    steps = torch.stack([s.step(ids[:, t]) for t in range(25, 40)], dim=1)
    got = torch.cat((pre, steps), dim=1)
    assert (got - full).abs().max().item() < TOL
    assert all(isinstance(l, RingLayerCache) and l.tokens() == 7 for l in cache.layers)


def test_model_ring_batched_streams_equal_each_alone(llama64):
    m = llama64
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=4, sinks=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (19, 6)]
    nxt = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    s = Session(m, pol, make_cache(cfg, pol, batch=2, kind="bounded", dtype=torch.float64))
    last = s.prefill(prompts, chunk=5)[:, 0]
    both = [last] + [s.step(nxt[:, t]) for t in range(12)]
    for b in range(2):
        ids = torch.tensor([prompts[b] + nxt[b].tolist()])
        alone = m(ids, policy=pol)[0, len(prompts[b]) - 1:]  # [13, V]
        got = torch.stack([x[b] for x in both])
        assert (got - alone).abs().max().item() < TOL


# ---------------------------------------------------------------- re-indexing (StreamingLLM)

def _turn(k, eps):
    """Rotate every frequency pair of k by the same small angle eps (float64 trig)."""
    e = torch.tensor(eps, dtype=k.dtype)
    return k * torch.cos(e) + rotate_half(k) * torch.sin(e)


def _literal_step(m, cache, a, tok, W, S, pol, eps=0.0):
    """The decode step at absolute position ``a`` run with positions literally renumbered
    within the cache: sinks at 0..S-1, the query's window at S..S+W-1 (query at S+W-1).

    Built from the ring's contents (keys re-rotated to their renumbered positions,
    optionally all turned by ``eps`` radians), in a plain growing cache."""
    gap = a - W + 1 - S
    layers = []
    for i, layer in enumerate(cache.layers):
        k, v, p = layer.view()
        sel = (p[0] >= 0) & ((p[0] < S) | (p[0] > a - W))
        order = torch.argsort(p[0][sel])
        k, v, p = k[:, :, sel][:, :, order], v[:, :, sel][:, :, order], p[:, sel][:, order]
        newp = torch.where(p < S, p, p - gap)
        k = _turn(rerotate(k, newp - p, m.model.layers[i].self_attn.inv_freq), eps)
        g = GrowingLayerCache(1, layer.H, layer.D, k.dtype)
        g.update(k, v, newp)
        layers.append(g)
    lit = KVCache(m.config, 1, layers=layers, dtype=k.dtype)
    return m(tok.view(1, 1), torch.tensor([[S + W - 1]]), cache=lit, policy=pol)[:, 0]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reindex_equals_literally_renumbered_positions(family):
    """(a) Past the wrap, each decode step with ``reindex=True`` gives the logits of the
    same step run with positions renumbered inside the cache.

    Tolerance (derived): the only differences are float32 RoPE trig roundings (rope_cos_sin
    forms angles and cos/sin in float32 even for a float64 model). ``rerotate_error_bound``
    bounds the angle error of one key; we measure what turning every key by that angle does
    to the logits of the literal run and allow twice that.
    """
    m = tiny_model(family, dtype=torch.float64)
    cfg = m.config
    W, S, P = 6, 2, 36
    pol = AttentionPolicy.build(cfg, "window", window=W, sinks=S)
    toks = torch.randint(0, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(5))
    cache = make_cache(cfg, pol, kind="bounded", dtype=torch.float64, model=m, reindex=True)
    plain = make_cache(cfg, pol, kind="bounded", dtype=torch.float64)
    s, sp = Session(m, pol, cache), Session(m, pol, plain)
    s.prefill([toks[:18].tolist()], chunk=7)
    sp.prefill([toks[:18].tolist()], chunk=7)
    eps = rerotate_error_bound(float(P) * max(float(b.self_attn.inv_freq.max()) for b in m.model.layers))
    err = sens = moved = 0.0
    for a in range(18, P):
        lit = _literal_step(m, cache, a, toks[a], W, S, pol)
        turned = _literal_step(m, cache, a, toks[a], W, S, pol, eps)
        out, out_plain = s.step(toks[a:a + 1]), sp.step(toks[a:a + 1])
        err = max(err, (out - lit).abs().max().item())
        sens = max(sens, (turned - lit).abs().max().item())
        moved = max(moved, (out - out_plain).abs().max().item())
    assert err <= derived_bound(sens), f"reindex vs literal {err:.2e} > 2 x sensitivity {sens:.2e}"
    assert moved > 100 * derived_bound(sens), "re-indexing did not change anything: the test would be vacuous"
    # the mask still works by absolute positions, and the stored keys are the model's own
    assert cache.layers[0].pos[0].max().item() == P - 1


def test_reindex_without_wrap_is_identical(llama64):
    """(b) Until position S + W the window never leaves the sinks: bit-identical logits."""
    m = llama64
    cfg = m.config
    W, S = 6, 2
    pol = AttentionPolicy.build(cfg, "window", window=W, sinks=S)
    toks = torch.randint(0, cfg.vocab_size, (S + W,), generator=torch.Generator().manual_seed(6))
    outs = []
    for reindex in (False, True):
        c = make_cache(cfg, pol, kind="bounded", dtype=torch.float64, model=m, reindex=reindex)
        s = Session(m, pol, c)
        first = s.prefill([toks[:5].tolist()], chunk=3, logits="all")
        rest = torch.stack([s.step(toks[t:t + 1]) for t in range(5, S + W)], dim=1)
        outs.append(torch.cat((first, rest), dim=1))
    assert torch.equal(outs[0], outs[1])


def test_reindex_sink_gap():
    ring = RingLayerCache(2, 1, 4, window=5, sinks=2, inv_freq=torch.ones(2), reindex=True)
    # first query 3 (window 0..3 reaches the sinks) -> 0; first query 20 -> 20-5+1-2 = 14;
    # an all-padding row -> 0
    assert ring.sink_gap(torch.tensor([[3, 4], [20, 21]])).tolist() == [0, 14]
    assert ring.sink_gap(torch.tensor([[-1, -1], [7, -1]])).tolist() == [0, 1]
