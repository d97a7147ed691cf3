"""KV formats (cache/kv_format.py) on the growing, ring and evicting caches.

- Storage: a layer cache of any format holds exactly the rows ``encode`` makes of what it is
  given (a ring's chunk view included), so every later read sees the same values.
- Reads: every attention path (the fused decode kernel reading the rows in place, causal,
  banded and masked prefill over their widened copy) gives the float32 path's bits on the
  widened rows.
- Invariant 2 holds per format: before a ring wraps, a model decoding through rings gives the
  growing cache's logits bit for bit.
- Eviction moves int8 keys through the storage rotation and back: rows that do not move are
  kept bit for bit, values are never re-quantized, and a moved layer-0 key lies within a
  derived bound of the key a run that never saw the span stores.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from longattn.cache import evict, make_cache, rerotate_error_bound
from longattn.cache.base import GrowingLayerCache
from longattn.cache.kv_format import Q8_BLOCK, encode, key_rotation, rerotate_rows, row_bytes, widen
from longattn.cache.ring import RingLayerCache
from longattn.engine.session import Session
from longattn.ops.attention import attend
from longattn.policy import AttentionPolicy

FORMATS = [torch.bfloat16, torch.int8]


def _kv(B, Hkv, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, Hkv, T, D, generator=g) * 3, torch.randn(B, Hkv, T, D, generator=g)


@pytest.mark.parametrize("dtype", FORMATS)
def test_growing_and_ring_caches_store_what_encode_makes(dtype):
    B, H, D, W, S = 2, 2, 40, 6, 2
    grow = GrowingLayerCache(B, H, D, dtype, initial=4)
    ring = RingLayerCache(B, H, D, W, S, dtype)
    k, v = _kv(B, H, 17, D, seed=1)
    pos = torch.arange(17).expand(B, 17)
    for s, e in ((0, 5), (5, 6), (6, 17)):  # a chunk, a decode step, a chunk longer than the ring
        gk, gv, _ = grow.update(k[:, :, s:e], v[:, :, s:e], pos[:, s:e])
        before = ring.k[:, :, :ring.hi].clone()
        rk, _, rpos = ring.update(k[:, :, s:e], v[:, :, s:e], pos[:, s:e])
        if e - s > 1:  # the chunk's view: what the ring held, then the chunk as stored
            assert torch.equal(rk, torch.cat((before, encode(k[:, :, s:e], dtype)), 2))
    assert gk.dtype == dtype and torch.equal(gk, encode(k, dtype)) and torch.equal(gv, encode(v, dtype))
    held = ring.pos[0]
    assert torch.equal(ring.k[:, :, held >= 0], encode(k[:, :, held[held >= 0]], dtype))
    assert grow.nbytes() == 2 * B * H * grow.k.shape[2] * row_bytes(dtype, D)


@pytest.mark.parametrize("dtype", [torch.float32] + FORMATS)
@pytest.mark.parametrize("Tq,window,sinks", [(1, None, 0), (1, 8, 2), (24, None, 0), (24, 8, 2), (40, 16, 4),
                                             (40, None, 0)])
def test_stored_rows_read_as_their_widened_copy(dtype, Tq, window, sinks):
    """The fused decode kernel (rows read in place), causal, banded and masked prefill read a
    cache of any format as the float32 cache holding the values its rows widen to."""
    g = torch.Generator().manual_seed(Tq)
    B, H, Hkv, S, D = 1, 6, 2, 40, 32
    k, v = (encode(torch.randn(B, Hkv, S, D, generator=g) * 2, dtype) for _ in range(2))
    q = torch.randn(B, H, Tq, D, generator=g)
    k_pos, q_pos = torch.arange(S)[None], torch.arange(S - Tq, S)[None]
    got = attend(q, q_pos, k, v, k_pos, window, sinks, D ** -0.5, banded_min_tokens=16)
    want = attend(q, q_pos, widen(k, D), widen(v, D), k_pos, window, sinks, D ** -0.5, banded_min_tokens=16)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("family,sinks", [("llama", 2), ("gemma3", 0)])
def test_rings_equal_growing_caches_before_they_wrap(dtype, family, sinks):
    """Design invariant 2 in every format: rings (window 40, never wrapped here) and growing
    caches give the same logits, chunked prefill and decode alike."""
    m = tiny_model(family)
    pol = AttentionPolicy.build(m.config, "window", window=40, sinks=sinks)
    prompt = torch.randint(0, m.config.vocab_size, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for kind in ("auto", "growing"):
        s = Session(m, pol, make_cache(m.config, pol, kind=kind, dtype=dtype, model=m))
        rows = [s.prefill([prompt], chunk=7)[:, 0]]
        for _ in range(12):
            rows.append(s.step(rows[-1].argmax(-1)))
        runs[kind] = torch.cat(rows)
        if kind == "auto":
            assert any(isinstance(l, RingLayerCache) for l in s.cache.layers)
            assert s.cache.key_rotation is (key_rotation(dtype, m.config.head_dim))
    assert torch.equal(runs["auto"], runs["growing"])


def test_the_native_readers_take_every_format_as_stored():
    from longattn.cache.kv_format import KV_FORMATS
    from longattn.ops.attention import STORED_DTYPES
    assert set(STORED_DTYPES) == set(KV_FORMATS.values())


def test_only_int8_caches_rotate_keys():
    """The cache turns keys (and the attention queries) by an orthogonal matrix only where its
    format needs it (kv_format.key_rotation)."""
    m = tiny_model("llama")
    pol = AttentionPolicy.build(m.config, "dense")
    assert make_cache(m.config, pol, dtype=torch.float32).key_rotation is None
    assert make_cache(m.config, pol, dtype=torch.bfloat16).key_rotation is None
    rot = make_cache(m.config, pol, dtype=torch.int8).key_rotation
    assert torch.allclose(rot @ rot.T, torch.eye(m.config.head_dim), atol=1e-6)


def test_rerotate_rows_keeps_unmoved_rows_bit_for_bit():
    B, H, N, D = 1, 2, 9, 64
    k, _ = _kv(B, H, N, D, seed=3)
    rows = encode(k, torch.int8)
    delta = torch.tensor([[0, 0, 0, -4, -4, 0, -4, -4, -4]])
    inv_f = 10000.0 ** (-torch.arange(0, D, 2).float() / D)
    out = rerotate_rows(rows, delta, inv_f, D)
    keep = delta[0] == 0
    assert torch.equal(out[:, :, keep], rows[:, :, keep])
    assert not torch.equal(out[:, :, ~keep], rows[:, :, ~keep])


@pytest.mark.parametrize("kind", ["growing", "bounded"])
def test_int8_eviction_moves_keys_within_one_quantization_step_of_a_never_seen_run(kind):
    """Evict X from A + X + B (window 6 everywhere, as in test_cache_evict) on an int8 cache.

    Layer 0's keys do not depend on context, so a moved key there differs from the never-seen
    run's key only by re-quantization and re-rotation. Bound per value: half a step of each
    stored row's block (both runs round to nearest), plus the bound on the 2-norm of the
    original row's rounding error (un-rotating, re-rotating and rotating are orthogonal, so
    that error reaches any one value at most whole), plus the re-rotation's angle error.
    Values are moved, never re-quantized; rows before the span are not touched."""
    m = tiny_model("llama")
    cfg = m.config
    W, S0, E0 = 6, 5, 12
    pol = AttentionPolicy.build(cfg, "window", window=W)
    g = torch.Generator().manual_seed(0)
    A, X, B = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 7, 20))

    def run(prompt, span=None):
        cache = make_cache(cfg, pol, kind=kind, dtype=torch.int8, model=m)
        Session(m, pol, cache).prefill([prompt], chunk=5)
        before = [(l.k.clone(), l.v.clone(), l.pos.clone()) for l in cache.layers]
        if span is not None:
            evict(cache, span[0], span[1], m)
        return cache, before

    ev, before = run(A + X + B, (S0, E0))
    nv, _ = run(A + B)
    D = cfg.head_dim
    for i, (le, ln, (kb, vb, pb)) in enumerate(zip(ev.layers, nv.layers, before)):
        assert torch.equal(le.pos, ln.pos)
        for p in le.pos[0][le.pos[0] >= 0].tolist():
            se = int((le.pos[0] == p).nonzero())
            old = p if p < S0 else p + (E0 - S0)
            sb = int((pb[0] == old).nonzero())
            assert torch.equal(le.v[0, :, se], vb[0, :, sb])  # values move as they are
            if p < S0:
                assert torch.equal(le.k[0, :, se], kb[0, :, sb])
            elif i == 0:
                sn = int((ln.pos[0] == p).nonzero())
                got, want, orig = le.k[0, :, se], ln.k[0, :, sn], kb[0, :, sb]   # [Hkv, W]

                def step(r):
                    return r[..., D:].contiguous().view(torch.float32).repeat_interleave(Q8_BLOCK, -1)[..., :D]
                x_orig = widen(orig, D)
                inv_f = m.model.layers[0].self_attn.inv_freq
                angle = rerotate_error_bound(len(A + X + B) * float(inv_f.max())) * x_orig.norm(dim=-1, keepdim=True)
                bound = step(got) / 2 + step(want) / 2 + (step(orig) / 2).norm(dim=-1, keepdim=True) + angle
                diff = (widen(got, D) - widen(want, D)).abs()
                assert (diff <= bound * (1 + 1e-5)).all(), f"layer 0 position {p}: {(diff - bound).max():.3e}"
