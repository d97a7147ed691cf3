"""The paged pool's storage formats (cache/kv_format.py) and the native kernels that store and
read them: ``paged_store`` writes the bytes ``encode`` makes, and ``decode_attention`` on an int8
(q8) pool is the float32 kernel on the widened pool, bit for bit, on both loop forms."""

import pytest
import torch

from longattn.cache.kv_format import KV_FORMATS, Q8_BLOCK, encode, row_bytes, row_width, widen
from longattn.ops import native

native_only = pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")


def _rows(M, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, D, generator=g) * torch.rand(M, H, 1, generator=g) * 8
    x[0, 0] = 0.0                     # an all-zero row: scale 0, codes 0
    x[1, 0, : min(D, Q8_BLOCK)] = 0.0  # one all-zero block beside a non-zero one
    x[2, 0, 3] = 1e4                  # an outlier owns its block's scale
    return x


@pytest.mark.parametrize("D", [64, 80, 13, 128])
def test_q8_rows_round_trip_within_half_a_step_of_their_block(D):
    x = _rows(6, 3, D, seed=D)
    rows = encode(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == (6, 3, row_width(torch.int8, D))
    back = widen(rows, D)
    nb = -(-D // Q8_BLOCK)
    scale = rows[..., D:].contiguous().view(torch.float32)                 # [M, H, nb]
    assert scale.shape[-1] == nb
    step = scale.repeat_interleave(Q8_BLOCK, -1)[..., :D]
    # round to nearest: at most half a step, plus the product's own rounding
    assert ((back - x).abs() <= step / 2 * (1 + 2 ** -20) + 1e-30).all()
    assert torch.equal(back[0, 0], torch.zeros(D)) and torch.equal(rows[0, 0], torch.zeros_like(rows[0, 0]))
    assert (rows[..., :D].abs() <= 127).all()


def test_float_formats_are_the_plain_casts():
    x = _rows(4, 2, 64, seed=1)
    assert torch.equal(encode(x, torch.float32), x)
    assert torch.equal(encode(x, torch.bfloat16), x.bfloat16())
    assert torch.equal(widen(x.bfloat16(), 64), x.bfloat16().float())
    assert [row_bytes(KV_FORMATS[f], 64) for f in ("f32", "bf16", "int8")] == [256, 128, 72]


@native_only
@pytest.mark.parametrize("kv", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("D", [64, 80, 13])
def test_the_native_store_writes_the_reference_bytes(kv, D):
    """``paged_store`` (the compiled step's writer) and ``encode`` (the eager cache's) store the
    same bytes at the given slots and leave every other slot alone; -1 skips a row."""
    dtype, H, R = KV_FORMATS[kv], 3, 40
    x = _rows(9, H, D, seed=7)
    slots = torch.tensor([5, 0, 17, -1, 39, 8, 9, 22, 31])
    pools = [torch.full((H, R, row_width(dtype, D)), 3, dtype=dtype) for _ in range(2)]
    want = [p.clone() for p in pools]
    torch.ops.longattn_cpu.paged_store(pools[0], pools[1], slots, x, -x)
    keep = slots >= 0
    want[0][:, slots[keep]] = encode(x[keep], dtype).transpose(0, 1)
    want[1][:, slots[keep]] = encode(-x[keep], dtype).transpose(0, 1)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])


@native_only
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("window,sinks", [(None, 0), (40, 4)])
@pytest.mark.parametrize("D", [64, 80])
def test_an_int8_pool_reads_as_the_float32_kernel_on_the_widened_pool(isa, window, sinks, D):
    """Decode rows and prefill rows over a q8 pool read in place give the float32 kernel's bits
    on the widened pool (each loop form), and the gathered path (kernels off) widens the same."""
    if isa == "avx512" and not native.has_avx512():
        pytest.skip("no AVX-512 on this CPU")
    from longattn.ops.attention import PagedRows, attend
    g = torch.Generator().manual_seed(D)
    H, Hkv, bs, nb = 6, 2, 16, 20
    pool_k, pool_v = (encode(torch.randn(1, Hkv, nb * bs, D, generator=g) * 3, torch.int8) for _ in range(2))
    wide_k, wide_v = widen(pool_k, D), widen(pool_v, D)
    table = torch.randperm(nb, generator=g)[:18][None]
    n = 18 * bs - 5
    k_pos = torch.arange(n)[None]
    code = native.isa_code(isa)
    for start in (n - 1, n - 40):
        T = n - start
        q = torch.randn(1, H, T, D, generator=g)
        q_pos = torch.arange(start, n)[None]
        rows = q.transpose(1, 2).reshape(T, H, 1, D)
        none = q.new_empty(T, Hkv, 0, D)
        outs = [torch.ops.longattn_cpu.decode_attention(
            rows, pk, pv, k_pos.expand(T, -1), q_pos.reshape(T, 1), none, none, window or 0, sinks, D ** -0.5,
            block_table=table.expand(T, -1), block_size=bs, isa=code) for pk, pv in ((pool_k, pool_v), (wide_k, wide_v))]
        assert torch.equal(outs[0], outs[1]), (isa, start)
        gathered = attend(q, q_pos, PagedRows(pool_k, table, bs, n), PagedRows(pool_v, table, bs, n), k_pos,
                          window, sinks, D ** -0.5, fused=False)
        plain = attend(q, q_pos, PagedRows(wide_k, table, bs, n), PagedRows(wide_v, table, bs, n), k_pos,
                       window, sinks, D ** -0.5, fused=False)
        assert torch.equal(gathered, plain)


@native_only
def test_the_kernels_refuse_an_int8_row_of_the_wrong_width():
    x = torch.randn(2, 1, 64)
    bad = torch.zeros(1, 8, 64, dtype=torch.int8)  # no room for the scales
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.longattn_cpu.paged_store(bad, bad.clone(), torch.tensor([0, 1]), x, x)
    q = torch.randn(1, 2, 1, 64)
    none = q.new_empty(1, 1, 0, 64)
    with pytest.raises(RuntimeError, match="k/v shapes"):
        torch.ops.longattn_cpu.decode_attention(q, bad[None], bad[None], torch.zeros(1, 8, dtype=torch.long),
                                                torch.tensor([[8]]), none, none, 0, 0, 0.125)


@pytest.mark.parametrize("D", [64, 256, 80])
def test_keys_turn_by_an_orthogonal_matrix_that_keeps_every_score_and_spreads_outliers(D):
    """int8 pools store keys rotated (queries turn with them): q R . k R = q . k, and a key whose
    few channels dwarf the rest (Qwen2.5's) loses far less to its block scales once rotated."""
    from longattn.cache.kv_format import key_rotation
    assert key_rotation(torch.float32, D) is None and key_rotation(torch.bfloat16, D) is None
    R = key_rotation(torch.int8, D).double()
    assert torch.allclose(R @ R.T, torch.eye(D, dtype=torch.float64), atol=1e-6)
    g = torch.Generator().manual_seed(D)
    q, k = torch.randn(8, D, generator=g, dtype=torch.float64), torch.randn(50, D, generator=g, dtype=torch.float64)
    k[:, [3, 17]] *= 300  # outlier channels
    # R is float32: orthogonal to its rounding (exactly, for the Hadamard matrices of powers of two)
    bound = D * 2 ** -23 * q.norm(dim=1)[:, None] * k.norm(dim=1)[None]
    assert (((q @ R) @ (k @ R).T - q @ k.T).abs() <= bound).all()
    plain = (widen(encode(k.float(), torch.int8), D).double() - k) @ q.T
    turned = (widen(encode((k @ R).float(), torch.int8), D).double() - k @ R) @ (q @ R).T
    assert turned.abs().mean() < plain.abs().mean() / 2
