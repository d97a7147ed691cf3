"""q8_0 packing: round-trip within half a step, scoring error within the derived bound."""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from longattn.sparse.packing import (QUERY_MAX, dequantize_q8, make_store, q8_block, q8_dot, q8_dot_bound,
                                    quantize_q8, quantize_query)


def test_block_size_follows_head_dim():
    assert [q8_block(d) for d in (8, 16, 24, 40, 64, 96, 128, 256)] == [8, 16, 8, 8, 32, 32, 32, 32]


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from([8, 24, 64, 128]), log_mag=st.floats(-6, 6), offset=st.floats(-10, 10),
       seed=st.integers(0, 2**31 - 1))
@example(d=8, log_mag=0.0, offset=6.042549671577039, seed=95968271)  # once failed a bound without fp32 rounding
def test_round_trip_within_half_a_step(d, log_mag, offset, seed):
    """|x - s * round(x / s)| <= s / 2 in exact arithmetic. In float32, x / s is rounded once
    (|x / s| <= 127, so by at most 127 * 2**-24 steps) and so is the product s * i (|i| <= 127):
    together at most 254 * s * 2**-24 more."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, d, generator=g) + offset) * 10.0 ** log_mag
    ints, scales = quantize_q8(x, q8_block(d))
    step = scales.repeat_interleave(q8_block(d), dim=-1)
    assert ints.dtype == torch.int8 and int(ints.abs().max()) <= 127
    err = (dequantize_q8(ints, scales).double() - x.double()).abs()
    bound = step.double() * (0.5 + 254 * 2.0 ** -24)
    assert bool((err <= bound * (1 + 1e-12) + 1e-30).all())


@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from([8, 24, 64, 128]), log_mag=st.floats(-6, 6), seed=st.integers(0, 2**31 - 1))
def test_query_blocks_are_12_bit(d, log_mag, seed):
    """Queries round to 12-bit ints (int16, |i| <= 2047) within half a step (plus the float32
    rounding of x / s and s * i, as above), and a block dot with int8 keys stays below 2**24,
    so the float32 matmuls of the PyTorch path add it exactly (as int32 does natively)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, d, generator=g) * 10.0 ** log_mag
    qb = q8_block(d)
    ints, scales = quantize_query(x, qb)
    assert ints.dtype == torch.int16 and int(ints.abs().max()) == QUERY_MAX == 2047
    step = scales.repeat_interleave(qb, dim=-1).double()
    err = (dequantize_q8(ints, scales).double() - x.double()).abs()
    assert bool((err <= step * (0.5 + 2 * QUERY_MAX * 2.0 ** -24) * (1 + 1e-12) + 1e-30).all())
    assert qb * QUERY_MAX * 127 < 2 ** 24


@settings(max_examples=80, deadline=None)
@given(d=st.sampled_from([8, 32, 64, 96]), qmag=st.floats(-3, 3), kmag=st.floats(-3, 3),
       offset=st.floats(-5, 5), seed=st.integers(0, 2**31 - 1))
def test_q8_dot_error_within_block_bound(d, qmag, kmag, offset, seed):
    """|q.k - q8dot| <= sum_b (||q_b||_1 sk_b / 2 + sq_b / 2 ||k^_b||_1), plus fp32 rounding."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 1, d, generator=g) * 10.0 ** qmag
    k = (torch.randn(1, 7, d, generator=g) + offset) * 10.0 ** kmag
    qb = q8_block(d)
    exact = (q.double() * k.double()).sum(-1)
    approx = q8_dot(q, k, qb).double()
    bound = q8_dot_bound(q, k, qb).double()
    rounding = 1e-5 * (q.double().abs() * k.double().abs()).sum(-1)  # fp32 sums of scaled terms
    assert bool(((exact - approx).abs() <= bound + rounding).all())


@pytest.mark.parametrize("centred", [False, True])
def test_packed_store_scores_are_q8_dots(centred):
    """The fast store's block-diagonal bmm gives the same numbers as the plain q8 dot; with
    cluster centres, keys are stored relative to them and a score is q.c + q8dot(q, k - c)."""
    g = torch.Generator().manual_seed(0)
    hkv, cs, d, C = 2, 8, 64, 5
    keys = torch.randn(hkv, C, cs, d, generator=g) + 2.0
    vals = torch.randn(hkv, C, cs, d, generator=g)
    centers = keys.mean(2) if centred else torch.zeros(hkv, C, d)
    store = make_store("q8_0", hkv, cs, d)
    store.write(0, keys, vals, centers if centred else None)
    qg = torch.randn(hkv, 3, d, generator=g)
    idx = torch.tensor([[0, 2, 4], [1, 3, 4]])
    scores = store.scores(store.prepare_query(qg), idx)  # [Hkv, 3, 3*cs]
    pick = (torch.arange(hkv).unsqueeze(1), idx)
    rows = keys[pick].reshape(hkv, 1, -1, d)  # [Hkv, 1, 3*cs, D]
    cen = centers[pick].repeat_interleave(cs, 1).reshape(hkv, 1, -1, d)  # each row's centre
    ref = (qg.unsqueeze(2) * cen).sum(-1) + q8_dot(qg.unsqueeze(2), rows - cen, store.qblock)
    assert torch.allclose(scores, ref, rtol=1e-5, atol=1e-4)
    bound = q8_dot_bound(qg.unsqueeze(2), rows - cen, store.qblock)
    exact = (qg.unsqueeze(2) * rows).sum(-1)
    assert bool(((scores - exact).abs() <= bound * (1 + 1e-5) + 1e-4).all())
    for h in range(hkv):
        for c in idx[h].tolist():
            assert torch.equal(store.key_center(h, c), centers[h, c].double())
    vals_back = store.values(idx).view(hkv, 3, cs, d)
    assert (vals_back - vals[torch.arange(hkv).unsqueeze(1), idx]).abs().max() <= store.vs.max() / 2 + 1e-7


@pytest.mark.parametrize("cs,d", [(8, 64), (20, 40), (5, 16)])
def test_tiled_keys_hold_the_quantized_rows(cs, d):
    """kt is a pure relayout: untiling gives back exactly the row-major int8 keys, rows beyond
    the cluster size (padding up to a multiple of 8) stay zero, and tile t holds dimensions
    (2p, 2p+1) of rows 8t..8t+7 at [t, p, row, 0:2] (the native scorer's reading order)."""
    g = torch.Generator().manual_seed(1)
    hkv, C = 2, 3
    keys = torch.randn(hkv, C, cs, d, generator=g)
    store = make_store("q8_0", hkv, cs, d)
    store.write(0, keys, torch.randn(hkv, C, cs, d, generator=g))
    ki, _ = quantize_q8(keys, store.qblock)
    assert torch.equal(store.ki[:, :C], ki)
    kt = store.kt[:, :C]
    assert kt.shape == (hkv, C, -(-cs // 8), d // 2, 8, 2)
    for t in range(kt.shape[2]):
        for r in range(8):
            row = 8 * t + r
            want = ki[:, :, row] if row < cs else torch.zeros_like(ki[:, :, 0])
            assert torch.equal(kt[:, :, t, :, r, :].reshape(hkv, C, d), want)
