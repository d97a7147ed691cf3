"""longattn's fused decode-attention kernel (ops/csrc/decode_attention.cpp) against the float64
reference of the same computation (ops.attention.attend_buffer_and_self): shapes, grouped
heads, windows with sinks, empty slots, padding streams, slots split across threads.

Tolerance, derived: twice the plain float32 matmul form's error, plus what the kernel's exp
polynomial may add (2 ulp relative on each weight -> at most 2 * 2**-23 * max|v| on an output
that is a convex combination of value rows)."""

import pytest
import torch

from longattn.ops import native
from longattn.ops.masks import allowed_mask
from longattn.ops.attention import attend_buffer_and_self
from tolerance import assert_within_derived, ulps

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")


def case(B, H, Hkv, S, D, seed, empty=0.2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, *s, D, generator=g) * 2 for s in ((H, 1), (Hkv, S), (Hkv, S)))
    k_new, v_new = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
    # slots hold positions in scrambled (ring-like) order; some are empty (-1)
    k_pos = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
    k_pos[torch.rand(B, S, generator=g) < empty] = -1
    q_pos = torch.full((B, 1), S)
    return q, k, v, k_pos, q_pos, k_new, v_new


def check(q, k, v, k_pos, q_pos, k_new, v_new, window, sinks, isa=None):
    D = q.shape[-1]
    scale = D ** -0.5
    mask = allowed_mask(q_pos, k_pos, window, sinks)
    args64 = [t.double() for t in (q, k, v)] + [mask, k_new.double(), v_new.double(), q_pos >= 0, scale]
    ref = attend_buffer_and_self(*args64)
    plain = attend_buffer_and_self(q, k, v, mask, k_new, v_new, q_pos >= 0, scale)
    out = torch.ops.longattn_cpu.decode_attention(q, k, v, k_pos, q_pos, k_new, v_new, window or 0, sinks, scale,
                                                  isa=native.isa_code(isa))
    assert out.shape == q.shape and out.dtype == torch.float32
    vmax = max(v.abs().max().item(), v_new.abs().max().item())
    assert_within_derived(out, plain, ref, floor=ulps(2, vmax))  # the exp polynomial's 2 ulp
    return out


@pytest.mark.parametrize("B,H,Hkv,S,D", [(1, 4, 1, 513, 256), (2, 14, 2, 1029, 64), (1, 9, 3, 100, 64),
                                         (3, 4, 2, 37, 24), (1, 2, 2, 5, 13), (2, 8, 8, 300, 128)])
@pytest.mark.parametrize("window,sinks", [(None, 0), (64, 0), (16, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_reference(B, H, Hkv, S, D, window, sinks, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(3):
            check(*case(B, H, Hkv, S, D, seed), window, sinks)
    finally:
        torch.set_num_threads(old)


def test_padding_stream_reads_nothing_and_outputs_zeros():
    q, k, v, k_pos, q_pos, k_new, v_new = case(2, 4, 2, 50, 32, 0)
    q_pos[1] = -1
    out = check(q, k, v, k_pos, q_pos, k_new, v_new, 16, 2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def test_empty_buffer_reads_only_the_own_key():
    """Nothing readable in the buffer: the output is the step's own value, exactly."""
    q, k, v, k_pos, q_pos, k_new, v_new = case(1, 6, 2, 70, 16, 1)
    k_pos.fill_(-1)
    out = check(q, k, v, k_pos, q_pos, k_new, v_new, None, 0)
    assert torch.equal(out, v_new.repeat_interleave(3, dim=1))


def test_sinks_stay_readable_outside_the_window():
    """A value planted on a sink slot far outside the window moves the output; the same value
    on a non-sink slot as far away does not (the kernel decides the mask from positions)."""
    q, k, v, k_pos, q_pos, k_new, v_new = case(1, 2, 1, 200, 16, 2, empty=0.0)
    k_pos[0] = torch.arange(200)
    q_pos.fill_(200)
    base = check(q, k, v, k_pos, q_pos, k_new, v_new, 32, 2)
    for slot, moves in ((1, True), (2, False)):
        v2 = v.clone()
        v2[0, 0, slot] += 100.0
        out = check(q, k, v2, k_pos, q_pos, k_new, v_new, 32, 2)
        assert (not torch.equal(out, base)) == moves


def test_rejects_bad_shapes_and_dtypes():
    q, k, v, k_pos, q_pos, k_new, v_new = case(1, 4, 2, 10, 8, 0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.longattn_cpu.decode_attention(q.double(), k, v, k_pos, q_pos, k_new, v_new, 0, 0, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.longattn_cpu.decode_attention(q[:, :3], k, v, k_pos, q_pos, k_new, v_new, 0, 0, 1.0)
    with pytest.raises(RuntimeError, match="k_pos"):
        torch.ops.longattn_cpu.decode_attention(q, k, v, k_pos[:, :5], q_pos, k_new, v_new, 0, 0, 1.0)


@pytest.mark.parametrize("B,H,Hkv,S,D", [(1, 4, 1, 513, 256), (2, 14, 2, 1029, 64), (1, 9, 3, 100, 64),
                                         (1, 9, 1, 77, 32), (2, 8, 1, 300, 128), (1, 13, 1, 40, 16)])
@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 4)])
def test_avx512_form_equals_the_avx2_form(B, H, Hkv, S, D, window, sinks):
    """The AVX-512 row loops do dot8/hsum8's and weighted_rows' float operations in the same
    order per element, so both forms give the same bits (grouped heads 1..13 per KV head: passes
    of up to six heads, 9 -> 4 + 5, 13 -> 4 + 4 + 5; row counts off a multiple of 8 and of 32;
    threads splitting the slots). A CPU without AVX-512 refuses the forced form instead."""
    if not native.has_avx512():
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            check(*case(B, H, Hkv, S, D, 0), window, sinks, isa="avx512")
        return
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(2):
            args = case(B, H, Hkv, S, D, seed)
            outs = [check(*args, window, sinks, isa=isa) for isa in ("avx2", "avx512")]
            assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(old)


def test_automatic_form_keeps_the_avx2_loops_on_amd():
    """A forced form applies to the dense attention too; left automatic it takes the AVX-512
    loops only on an AVX-512 CPU that is not AMD (they are slower on Zen 4; docs/benchmarks.md).
    The form is an argument of each call: asking for one changes no other call's."""
    has = native.has_avx512()
    vendor = next((ln.split(":")[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("vendor_id")), "")
    assert native.dense_attention_avx512() is (has and vendor != "AuthenticAMD")
    assert native.dense_attention_avx512("avx2") is False
    if has:
        assert native.dense_attention_avx512("avx512") is True
    else:
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            native.dense_attention_avx512("avx512")
    assert native.dense_attention_avx512() is (has and vendor != "AuthenticAMD")
