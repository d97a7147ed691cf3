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


@pytest.mark.parametrize("B,H,Hkv,S,D", [(2, 14, 2, 300, 64), (1, 4, 1, 513, 256)])
@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 4)])
def test_soft_capped_scores_match_reference(B, H, Hkv, S, D, window, sinks):
    """Gemma 2's soft-capping (cap * tanh(s / cap) on every score, the own key's included).
    Floor beyond the exp polynomial's: the kernel's tanhf and PyTorch's differ by a few float32
    ulps of the cap per score, which moves each weight by that much relatively and the output,
    a convex combination of value rows, by twice it times max|v| (``ulps(4 * cap, vmax)``)."""
    cap = 5.0
    for seed in range(2):
        q, k, v, k_pos, q_pos, k_new, v_new = case(B, H, Hkv, S, D, seed)
        q = q * 4  # scores well into tanh's curve
        scale = D ** -0.5
        mask = allowed_mask(q_pos, k_pos, window, sinks)
        ref = attend_buffer_and_self(*[t.double() for t in (q, k, v)], mask, k_new.double(), v_new.double(),
                                     q_pos >= 0, scale, cap)
        plain = attend_buffer_and_self(q, k, v, mask, k_new, v_new, q_pos >= 0, scale, cap)
        out = torch.ops.longattn_cpu.decode_attention(q, k, v, k_pos, q_pos, k_new, v_new, window or 0, sinks,
                                                      scale, softcap=cap)
        vmax = max(v.abs().max().item(), v_new.abs().max().item())
        assert_within_derived(out, plain, ref, floor=ulps(2, vmax) + ulps(4 * cap, vmax))
        assert not torch.equal(out, torch.ops.longattn_cpu.decode_attention(
            q, k, v, k_pos, q_pos, k_new, v_new, window or 0, sinks, scale))  # the cap does act


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


@pytest.mark.parametrize("B,H,Hkv,S,D", [(2, 14, 2, 1029, 64), (1, 9, 3, 300, 64)])
@pytest.mark.parametrize("window,sinks", [(None, 0), (64, 0), (16, 4)])
def test_position_aligned_chunks_match_the_reference(B, H, Hkv, S, D, window, sinks):
    """Slots holding increasing positions (a growing or paged view, gaps and empty slots
    included) are chunked by position range; the result is still the reference's."""
    q, k, v, _, _, k_new, v_new = case(B, H, Hkv, S, D, seed=S + 7)
    g = torch.Generator().manual_seed(S)
    k_pos = torch.stack([torch.arange(S) * 3 + 500 for _ in range(B)])  # starts mid-chunk, gaps of 2
    k_pos[torch.rand(B, S, generator=g) < 0.2] = -1
    q_pos = torch.full((B, 1), 3 * S + 500)
    check(q, k, v, k_pos, q_pos, k_new, v_new, window * 3 if window else None, sinks)


@pytest.mark.parametrize("window,sinks,bs,softcap", [(None, 0, 16, None), (40, 4, 4, None), (130, 0, 16, None),
                                                     (9, 2, 4, None), (None, 0, 16, 5.0), (9, 2, 4, 5.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_query_gets_the_same_bits_decoded_or_in_any_prefill_chunk(window, sinks, bs, softcap, threads):
    """A position's attention over a paged cache is the same bits computed as a decode row
    (whose view a window has already trimmed) and as any row of a prefill chunk (whose view
    still holds older blocks), batched beside another stream or not: what makes a continued
    conversation equal the conversation prefilled whole. Soft-capped scores (Gemma 2) too."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _same_bits_decoded_or_prefilled(window, sinks, bs, softcap)
    finally:
        torch.set_num_threads(old)


def _same_bits_decoded_or_prefilled(window, sinks, bs, softcap):
    from longattn.ops.attention import PagedRows, attend
    H, Hkv, D, N = 6, 2, 64, 300
    g = torch.Generator().manual_seed(bs + (window or 0))
    nb = -(-N // bs)
    pool_k, pool_v = (torch.randn(1, Hkv, (2 * nb + 3) * bs, D, generator=g) for _ in range(2))
    table = torch.randperm(2 * nb + 3, generator=g)[:nb]  # logical block -> physical, scattered
    q_all = torch.randn(1, H, N, D, generator=g)
    sink_blocks = -(-sinks // bs)

    def view(end, first):
        """The stream's view up to position ``end`` holding sink blocks and blocks from the one
        with position ``first`` on."""
        logical = [j for j in range(nb) if j * bs < end and (j < sink_blocks or (j + 1) * bs > first)]
        kpos = torch.tensor([[j * bs + o if j * bs + o < end else -1 for j in logical for o in range(bs)]])
        rows = lambda pool: PagedRows(pool, table[logical][None], bs, kpos.shape[1])  # noqa: E731
        return rows(pool_k), rows(pool_v), kpos

    def decode(p):  # the view a window has trimmed to what position p reads
        k, v, kpos = view(p + 1, 0 if window is None else p - window + 1)
        return attend(q_all[:, :, p:p + 1], torch.tensor([[p]]), k, v, kpos, window, sinks, D ** -0.5, softcap)

    alone = torch.cat([decode(p) for p in range(N)], dim=2)
    for start, stop in ((0, N), (5, 77), (150, 151), (160, 300), (290, 300)):
        k, v, kpos = view(stop, 0 if window is None else max(0, start - window - 37))  # older blocks held
        got = attend(q_all[:, :, start:stop], torch.arange(start, stop)[None], k, v, kpos, window, sinks, D ** -0.5,
                     softcap)
        assert torch.equal(got, alone[:, :, start:stop]), (start, stop)
    # batched beside another stream's decode row (padded tables)
    k1, v1, kp1 = view(200, 0)
    k2, v2, kp2 = view(N, 0 if window is None else N - 1 - window + 1)
    width = max(k1.table.shape[1], k2.table.shape[1])
    pad = lambda t: torch.cat([t, t.new_zeros(1, width - t.shape[1])], 1)  # noqa: E731
    S = max(kp1.shape[1], kp2.shape[1])
    padk = lambda t: torch.cat([t, t.new_full((1, S - t.shape[1]), -1)], 1)  # noqa: E731
    table2 = torch.cat([pad(k1.table), pad(k2.table)])
    kpos2 = torch.cat([padk(kp1), padk(kp2)])
    q2 = torch.cat([q_all[:, :, 199:200], q_all[:, :, N - 1:N]])
    got = attend(q2, torch.tensor([[199], [N - 1]]), PagedRows(pool_k, table2, bs, S), PagedRows(pool_v, table2, bs, S),
                 kpos2, window, sinks, D ** -0.5, softcap)
    assert torch.equal(got[0:1], alone[:, :, 199:200]) and torch.equal(got[1:2], alone[:, :, N - 1:N])


@pytest.mark.parametrize("window,sinks", [(None, 0), (40, 4)])
def test_a_bfloat16_pool_reads_as_the_float32_kernel_on_the_widened_pool(window, sinks):
    """A bfloat16 cache widens exactly as each row is read: the output is the float32 kernel's
    on the widened pool, bit for bit, in decode rows and prefill rows alike."""
    from longattn.ops.attention import PagedRows, attend
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, bs, nb = 6, 2, 64, 16, 20
    pool_k, pool_v = (torch.randn(1, Hkv, nb * bs, D, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(nb, generator=g)[:18][None]
    n = 18 * bs - 5
    k_pos = torch.where(torch.arange(18 * bs) < n, torch.arange(18 * bs), -1)[None]
    for start in (n - 1, n - 40):
        q = torch.randn(1, H, n - start, D, generator=g)
        q_pos = torch.arange(start, n)[None]
        got = attend(q, q_pos, PagedRows(pool_k, table, bs, n), PagedRows(pool_v, table, bs, n), k_pos,
                     window, sinks, D ** -0.5)
        want = attend(q, q_pos, PagedRows(pool_k.float(), table, bs, n), PagedRows(pool_v.float(), table, bs, n),
                      k_pos, window, sinks, D ** -0.5)
        assert got.dtype == torch.float32 and torch.equal(got, want)
