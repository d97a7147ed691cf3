"""Banded O(T*W) prefill against the float64 reference, with a derived tolerance.

Tolerance (flash-attention's habit): banded fp32 may be at most twice as far from a float64
reference as a plain fp32 masked SDPA over the full mask is, plus one fp32 ulp at 1.0.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longattn.errors import LongattnError
from longattn.ops import allowed_mask, masked_attention, reference_attention
from longattn.ops.banded import banded_attention, default_block_size, plan_blocks
from tolerance import derived_bound, max_err, ulps

ONE_ULP = ulps(1, 1.0)  # the docstring's one fp32 ulp at 1.0


def _inputs(B, H, Hkv, Tq, Tk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Tk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Tk, D, generator=g, dtype=torch.float64)
    return q, k, v


def _errors(B, H, Hkv, Tq, Tk, D, window, sinks, block_size=None, seed=0):
    """(banded error, plain fp32 SDPA error), both max-abs against a float64 reference."""
    q, k, v = _inputs(B, H, Hkv, Tq, Tk, D, seed)
    q_pos = torch.arange(Tk - Tq, Tk)[None].expand(B, -1)  # queries are the last Tq positions
    k_pos = torch.arange(Tk)[None].expand(B, -1)
    mask = allowed_mask(q_pos, k_pos, window, sinks)  # [B, 1, Tq, Tk]
    scale = D ** -0.5
    ref = reference_attention(q, k, v, mask, scale)
    q32, k32, v32 = q.float(), k.float(), v.float()
    plain = masked_attention(q32, k32, v32, mask, scale)
    out = banded_attention(q32, k32, v32, window, sinks, block_size=block_size)
    assert out.shape == (B, H, Tq, D) and out.dtype == torch.float32
    return max_err(out, ref), max_err(plain, ref)


CASES = [
    # B, H, Hkv, Tq, Tk, D, window, sinks, block_size
    (1, 2, 2, 64, 64, 16, 8, 0, None),          # plain prefill, small window
    (2, 4, 2, 100, 100, 16, 8, 1, None),        # GQA 2:1, one sink, ragged last block
    (1, 6, 2, 90, 90, 8, 16, 4, 32),            # GQA 3:1, four sinks
    (1, 4, 1, 37, 100, 8, 16, 4, 8),            # chunked prefill (Tq < Tk), MQA
    (1, 2, 2, 1, 70, 8, 16, 4, None),           # a single query at the end (decode shape)
    (1, 2, 2, 50, 50, 8, 1, 0, 16),             # window 1: each query reads itself
    (1, 2, 2, 50, 50, 8, 1, 4, 16),             # window 1 + sinks
    (1, 2, 2, 48, 48, 8, 48, 0, 16),            # window == T
    (1, 2, 2, 48, 48, 8, 47, 1, 16),            # window just below T, sink
    (1, 2, 2, 48, 48, 8, 200, 4, 16),           # window > T
    (1, 2, 2, 48, 48, 8, None, 0, None),        # no window
    (1, 4, 2, 30, 80, 8, None, 2, 8),           # no window, chunked, GQA
    (1, 2, 2, 40, 40, 8, 0, 0, None),           # window 0 == full causal
    (1, 8, 2, 300, 300, 32, 40, 4, None),       # several full blocks + sinks
    (1, 2, 2, 64, 64, 16, 5, 9, 4),             # more sinks than window, tiny blocks
]


@pytest.mark.parametrize("B,H,Hkv,Tq,Tk,D,window,sinks,block_size", CASES)
def test_banded_matches_reference_within_twice_fp32_error(B, H, Hkv, Tq, Tk, D, window, sinks,
                                                          block_size):
    err, err_plain = _errors(B, H, Hkv, Tq, Tk, D, window, sinks, block_size)
    assert err <= derived_bound(err_plain, floor=ONE_ULP), (err, err_plain)


@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 64, 1000])
def test_any_block_size_gives_the_same_answer(block_size):
    err, err_plain = _errors(1, 4, 2, 45, 60, 8, 12, 3, block_size, seed=3)
    assert err <= derived_bound(err_plain, floor=ONE_ULP)


def test_unset_window_is_bitwise_full_causal():
    q, k, v = (t.float() for t in _inputs(1, 4, 2, 70, 70, 16))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for w in (None, 0, 70, 10_000):
        assert torch.equal(banded_attention(q, k, v, w), dense)
    # Chunked prefill: an unset window and one wider than the cache take the same path.
    qc = q[:, :, -20:]
    assert torch.equal(banded_attention(qc, k, v, None, sinks=3), banded_attention(qc, k, v, 70))


def test_real_window_changes_the_output():
    q, k, v = (t.float() for t in _inputs(1, 2, 2, 64, 64, 16))
    assert not torch.allclose(banded_attention(q, k, v, 8), banded_attention(q, k, v, None))


def test_float64_matches_reference_tightly():
    q, k, v = _inputs(1, 4, 2, 60, 90, 16, seed=5)
    q_pos, k_pos = torch.arange(30, 90)[None], torch.arange(90)[None]
    ref = reference_attention(q, k, v, allowed_mask(q_pos, k_pos, 10, 2), 16 ** -0.5)
    out = banded_attention(q, k, v, 10, 2, block_size=16)
    assert out.dtype == torch.float64
    assert (out - ref).abs().max().item() < 1e-12


def test_bfloat16_runs_and_stays_close():
    q, k, v = (t.float() for t in _inputs(1, 4, 2, 80, 80, 16))
    out = banded_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 12, 2)
    ref = banded_attention(q, k, v, 12, 2)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 0.05


# ------------------------------------------------------------------------ O(T*W) work

@pytest.mark.parametrize("tq,tk,window,sinks", [
    (4096, 4096, 256, 0), (4096, 4096, 1024, 4), (1000, 5000, 100, 2), (333, 333, 7, 1),
])
def test_plan_gathers_only_the_band(tq, tk, window, sinks):
    bs = default_block_size(window)
    blocks = plan_blocks(tq, tk, window, sinks)
    n = len(blocks)
    assert n == -(-tq // bs)
    # Rows are covered exactly once, in order.
    assert [b.q0 for b in blocks] == list(range(0, tq, bs)) and blocks[-1].q1 == tq
    for b in blocks:
        first = tk - tq + b.q0  # absolute position of the block's first query
        assert b.k0 == max(0, first - window + 1) and b.k1 == tk - tq + b.q1
        assert b.sink_cols == min(sinks, b.k0)
    assert sum(b.keys for b in blocks) <= n * (bs + window - 1) + sinks * n
    assert sum(b.scores for b in blocks) <= tq * (bs + window - 1 + sinks)
    if tq == tk and window <= tk // 4:
        # far fewer scores than full causal attention
        assert sum(b.scores for b in blocks) < 0.7 * tq * (tq + 1) / 2


def test_plan_of_full_causal_chunk_covers_all_earlier_keys():
    blocks = plan_blocks(10, 50, None, sinks=5, block_size=4)
    assert [(b.k0, b.k1, b.sink_cols) for b in blocks] == [(0, 44, 0), (0, 48, 0), (0, 50, 0)]


def test_default_block_size_follows_the_measured_rule():
    assert [default_block_size(w) for w in (1, 64, 256, 512, 1024, 4096)] == [32, 32, 64, 128, 256, 256]


# ------------------------------------------------------------------------ input errors

@pytest.mark.parametrize("kwargs,msg", [
    (dict(window=-1), "window"),
    (dict(window=4, sinks=-2), "sinks"),
    (dict(window=2.5), "window"),
    (dict(window=4, block_size=0), "block_size"),
])
def test_bad_settings_raise_one_clear_error(kwargs, msg):
    q, k, v = (t.float() for t in _inputs(1, 2, 2, 8, 8, 4))
    with pytest.raises(LongattnError, match=msg):
        banded_attention(q, k, v, **kwargs)


def test_bad_shapes_raise_one_clear_error():
    q, k, v = (t.float() for t in _inputs(1, 3, 2, 8, 8, 4))
    with pytest.raises(LongattnError, match="multiple"):
        banded_attention(q, k, v, 4)
    q, k, v = (t.float() for t in _inputs(1, 2, 2, 9, 8, 4))
    with pytest.raises(LongattnError, match="at least as many keys"):
        banded_attention(q, k, v, 4)
    q, k, v = (t.float() for t in _inputs(1, 2, 2, 8, 8, 4))
    with pytest.raises(LongattnError, match="differ"):
        banded_attention(q, k, v[:, :, :4], 4)
    with pytest.raises(LongattnError, match="4-D"):
        banded_attention(q[0], k[0], v[0], 4)


@pytest.mark.parametrize("H,Hkv,Tq,Tk,D,window,sinks", [(4, 2, 30, 80, 8, None, 0), (14, 2, 64, 300, 64, None, 0),
                                                      (6, 3, 17, 18, 16, 18, 4), (8, 8, 100, 500, 32, 10_000, 2)])
@pytest.mark.parametrize("learned", [False, True])
def test_a_chunk_over_every_earlier_key_reads_them_whole_and_itself_causally(H, Hkv, Tq, Tk, D, window, sinks,
                                                                             learned):
    """attend's prefix path (a chunk at the end of keys 0..Tk-1, no window within reach): within
    twice the plain masked fp32 path's error against float64, learned sinks included, and what
    attend runs for such a chunk."""
    from longattn.ops.attention import attend
    from longattn.ops.dense import prefix_causal_attention
    q, k, v = _inputs(1, H, Hkv, Tq, Tk, D, seed=Tq)
    sinks_l = torch.linspace(-1, 2, H, dtype=torch.float64) if learned else None
    q_pos, k_pos = torch.arange(Tk - Tq, Tk)[None], torch.arange(Tk)[None]
    mask = allowed_mask(q_pos, k_pos, window, sinks)
    scale = D ** -0.5
    ref = reference_attention(q, k, v, mask, scale, sink_logits=sinks_l)
    q32, k32, v32 = q.float(), k.float(), v.float()
    s32 = None if sinks_l is None else sinks_l.float()
    plain = masked_attention(q32, k32, v32, mask, scale, sink_logits=s32)
    out = prefix_causal_attention(q32, k32, v32, scale, s32)
    assert max_err(out, ref) <= derived_bound(max_err(plain, ref), floor=ONE_ULP)
    assert torch.equal(attend(q32, q_pos, k32, v32, k_pos, window, sinks, scale, sink_logits=s32), out)
