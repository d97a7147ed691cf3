"""Weight formats (f32, bf16, int8, int4, int5): the quantizers, the int8, int4, int5 and float
kernels against exact references, every attention site under each format, and int8's and
int4's quality cost on a real model.

Tolerances: a quantized model is compared with a float64 model built from the weights it
really multiplies by (``effective_state_dict``). The full forward runs the quantized kernels at
every row count (bf16 with WIDEN_ROWS raised), so its error is the plain reference error of that
arithmetic; the cached paths must stay within twice it (as in test_windows.py).
"""

import pytest
import torch

from conftest import tiny_formats
from longattn.errors import LongattnError
from longattn.models import build_model
from longattn.models import transformer
from longattn.ops import linear, native
from longattn.models.weights import (int4_as_int5, pack_fifth_bits, parse_weights, quantize_int4, quantize_int5,
                                    quantize_int8)
from longattn.ops.linear import (INT4_GROUP, dequantize_int4, dequantize_int5, dequantize_int8, int4_matmul,
                                 int5_matmul, int8_matmul, quantize_activations)
from longattn.policy import AttentionPolicy
from model_paths import assert_paths_agree, assert_streams_agree, ids_for, run_path
from tolerance import TIE_FLOOR, assert_within_derived

FORMATS = ["f32", "bf16", "int8", "int4", "int5"]
tiny = tiny_formats


def test_quantize_int8_roundtrip_error_is_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    assert int(q.abs().max()) <= 127
    err = (dequantize_int8(q, s) - w).abs()
    assert torch.all(err <= s[:, None] / 2 * (1 + 1e-6))
    assert torch.equal(dequantize_int8(q, s)[5], torch.zeros(50))
    # the largest entry of each non-zero row is represented exactly at +-127
    assert torch.equal(q.abs().amax(1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))


def test_parse_weights_names_and_errors():
    assert parse_weights("bfloat16") == "bf16" and parse_weights(torch.float32) == "f32"
    assert parse_weights("INT8") == "int8" and parse_weights("q4") == "int4"
    assert parse_weights("q5") == "int5"
    with pytest.raises(LongattnError, match="f32, bf16, int8, int4, int5"):
        parse_weights("fp8")


def test_avx2_int8_kernel_is_built_where_the_cpu_has_avx2():
    """The fast kernel must really run on x86 CI machines, not silently fall back."""
    if torch.backends.cpu.get_cpu_capability() in native.AVX2_CAPABILITIES:
        assert native.available() and linear.kernel_name() == "longattn-avx2"
        lin = transformer.Linear(16, 8, False)
        lin.weight.data = torch.randn(8, 16)
        lin.to_int8()
        assert lin.kernel == "avx2"
    else:
        assert not native.available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 70])  # one tile of 4, tiles and each remainder
@pytest.mark.parametrize("K", [96, 288, 100, 77, 5])  # whole blocks, short last blocks, one short block
@pytest.mark.parametrize("wide", [False, True], ids=["avx2", "avx512"])
def test_int8_kernel_matches_exact_reference(rows, K, wide):
    """Activations rounded per block of 32 as quantize_activations does (a short last block on
    its own), integer dots exact, one rounding per block step into float32 lanes and one for the
    row scale: within (G + 10) float32 roundings of the sum of |terms| plus half an ulp, against
    float64 arithmetic on the same rounded inputs; PyTorch's evaluation (the fallback) within K.
    Every row gets the same bits alone as in the batch, whatever its neighbours. For the AVX2
    form and (where the CPU has AVX-512 VNNI; elsewhere the AVX2 form is checked twice) the
    AVX-512 one, whose odd last group is a masked two-group step."""
    assert native.available()
    isa = "avx512" if wide and native.has_avx512() else "avx2"
    g = torch.Generator().manual_seed(rows * 1000 + K)
    N = 70  # split over threads
    x = torch.randn(rows, K, generator=g) * torch.logspace(-2, 1, K)
    x[0, :min(K, 32)] = 0.0  # an all-zero activation block
    q, s = quantize_int8(torch.randn(N, K, generator=g))
    y = int8_matmul(x, q, s, kernel="avx2", isa=isa)
    xe = quantize_activations(x).double()
    w = q.double() * s.double()[:, None]
    ref = xe @ w.T
    terms = xe.abs() @ w.abs().T
    G = -(-K // INT4_GROUP)
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    assert torch.all((y.double() - ref).abs() <= 2.0 ** -24 * ref.abs() + (G + 10) * 2.0 ** -23 * terms + 1e-30)
    y_torch = int8_matmul(x, q, s, kernel="torch")
    assert torch.all((y_torch.double() - ref).abs() <= 2.0 ** -24 * ref.abs() + K * 2.0 ** -23 * terms + 1e-30)
    _check_row_invariance(
        lambda x_, rows_=slice(None): torch.ops.longattn_cpu.int8_gemm(x_, q[rows_], s[rows_], native.isa_code(isa)), x, y)


def _check_row_invariance(op, x, y):
    """``op(x)`` (``y``) is the same, bit for bit, for every row alone, for every split of the
    rows into batches, for a transposed view of x, and for every weight row whatever rows share
    its tile or thread: the invariance a batched, chunked or reused request rests on."""
    assert torch.equal(op(x.T.contiguous().T), y)
    assert all(torch.equal(op(x[i:i + 1]), y[i:i + 1]) for i in range(x.shape[0]))
    g = torch.Generator().manual_seed(x.shape[0])
    cuts = sorted(torch.randint(0, x.shape[0] + 1, (3,), generator=g).tolist())
    parts = [op(x[a:b]) for a, b in zip([0] + cuts, cuts + [x.shape[0]]) if b > a]
    assert torch.equal(torch.cat(parts), y)
    assert torch.equal(op(x, slice(3, None)), y[:, 3:])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 70])  # each tile shape and its remainders
@pytest.mark.parametrize("K", [96, 100, 7])  # whole lanes, a tail, a tail alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_kernel_is_a_float32_gemm_with_one_order_per_element(rows, K, dtype):
    """The float formats' kernel: within twice F.linear's float32 error of float64 on the same
    weights, a bf16 matrix giving the bits its float32 widening gives (read as stored), and
    every row the same bits alone as in any batch."""
    assert native.available()
    g = torch.Generator().manual_seed(rows * 100 + K)
    N = 37  # weight tiles of 8, 4, 3 and 2 with remainders, split over threads
    x = torch.randn(rows, K, generator=g) * torch.logspace(-2, 1, K)
    w = torch.randn(N, K, generator=g).to(dtype)
    y = torch.ops.longattn_cpu.float_gemm(x, w)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    assert_within_derived(y, torch.nn.functional.linear(x, w.float()), ref, floor=TIE_FLOOR)
    if dtype == torch.bfloat16:
        assert torch.equal(torch.ops.longattn_cpu.float_gemm(x, w.float()), y)
    _check_row_invariance(lambda x_, rows_=slice(None): torch.ops.longattn_cpu.float_gemm(x_, w[rows_]), x, y)


def test_float_models_run_the_float_kernel_on_every_matrix():
    """build_model gives each float32 and bf16 matrix, the tied head included, the native kernel
    (a float64 model, the reference, keeps PyTorch's matmul)."""
    from conftest import tiny_dir
    from longattn.checkpoint import load_checkpoint
    ck = load_checkpoint(tiny_dir("llama"), with_tokenizer=False)
    for weights in ("f32", "bf16"):
        m = build_model(ck.config, ck.state_dict, weights=weights)
        lins = [mod for mod in m.modules() if isinstance(mod, transformer.Linear)]
        assert lins and all(mod.kernel == "avx2" for mod in lins) and m.head_kernel == "avx2"
    m = build_model(ck.config, ck.state_dict, dtype=torch.float64)
    assert all(mod.kernel == "torch" for mod in m.modules() if isinstance(mod, transformer.Linear))


def test_avx2_int8_kernel_rejects_wrong_dtypes_and_shapes():
    assert native.available()
    q, s = quantize_int8(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.longattn_cpu.int8_gemm(torch.randn(1, 8, dtype=torch.float64), q, s)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.longattn_cpu.int8_gemm(torch.randn(1, 9), q, s)


def test_quantize_int4_layout_and_error_bound():
    g = torch.Generator().manual_seed(0)
    # groups spanning codes 0..15 with step 1 and offset 0 are stored exactly: check the layout
    u = torch.randint(0, 16, (3, 64), generator=g)
    u[:, ::32], u[:, 1::32] = 0, 15
    codes, d, m = quantize_int4(u.float())
    assert codes.dtype == torch.uint8 and codes.shape == (3, 32) and d.dtype == m.dtype == torch.float16
    assert torch.equal(d, torch.ones(3, 2, dtype=torch.float16)) and torch.equal(m, torch.zeros(3, 2, dtype=torch.float16))
    assert torch.equal(codes[:, :16], (u[:, :16] | (u[:, 16:32] << 4)).to(torch.uint8))  # j low, j + 16 high
    assert torch.equal(dequantize_int4(codes, d, m), u.float())
    # rows over four decades, a zero row, a constant group: within half a step plus what the
    # float16 rounding of the offset and step moves the ends of the grid
    w = torch.randn(37, 96, generator=g) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    w[7, 32:64] = 0.3
    codes, d, m = quantize_int4(w)
    wg = w.double().reshape(37, 3, 32)
    lo, hi, dd, mm = wg.amin(-1), wg.amax(-1), d.double(), m.double()
    bound = dd / 2 + (mm - lo).abs() + 15 * (dd - (hi - lo) / 15).abs()
    err = (dequantize_int4(codes, d, m, torch.float64).reshape(37, 3, 32) - wg).abs()
    assert torch.all(err <= bound[..., None] * (1 + 1e-9))
    assert torch.equal(dequantize_int4(codes, d, m)[5], torch.zeros(96))
    assert float(err[5].max()) == 0.0 and float(err[7, 1].max()) <= float((mm[7, 1] - 0.3).abs()) + 1e-12
    with pytest.raises(LongattnError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 40))


def test_quantize_int5_layout_and_error_bound():
    """int5 is int4's layout plus a fifth bit per code (GGML's Q5 order: bit k of a group's
    little-endian word is value k's); 32 levels give at most half a step of error (plus the
    float16 rounding of the offset and step), and int4's groups are int5 groups exactly."""
    g = torch.Generator().manual_seed(1)
    u = torch.randint(0, 32, (3, 64), generator=g)
    u[:, ::32], u[:, 1::32] = 0, 31
    codes, hbits, d, m = quantize_int5(u.float())
    assert codes.shape == (3, 32) and hbits.shape == (3, 8) and hbits.dtype == torch.uint8
    assert torch.equal(d, torch.ones(3, 2, dtype=torch.float16)) and torch.equal(m, torch.zeros(3, 2, dtype=torch.float16))
    low = u & 15
    assert torch.equal(codes[:, :16], (low[:, :16] | (low[:, 16:32] << 4)).to(torch.uint8))
    word = sum(int((u[0, k] >> 4) & 1) << k for k in range(32))  # group 0 of row 0
    assert int.from_bytes(bytes(hbits[0, :4].tolist()), "little") == word
    assert torch.equal(dequantize_int5(codes, hbits, d, m), u.float())
    assert torch.equal(pack_fifth_bits((u.reshape(3, 2, 32) >> 4) & 1), hbits)
    w = torch.randn(37, 96, generator=g) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    codes, hbits, d, m = quantize_int5(w)
    wg = w.double().reshape(37, 3, 32)
    lo, hi, dd, mm = wg.amin(-1), wg.amax(-1), d.double(), m.double()
    bound = dd / 2 + (mm - lo).abs() + 31 * (dd - (hi - lo) / 31).abs()
    err = (dequantize_int5(codes, hbits, d, m, torch.float64).reshape(37, 3, 32) - wg).abs()
    assert torch.all(err <= bound[..., None] * (1 + 1e-9)) and float(err[5].max()) == 0.0
    # half int4's step: the worst error over the matrix is about half int4's
    err4 = (dequantize_int4(*quantize_int4(w), dtype=torch.float64).reshape(37, 3, 32) - wg).abs()
    assert float((err / err4.amax(-1, keepdim=True).clamp(min=1e-30)).max()) < 0.6
    c4, d4, m4 = quantize_int4(w)
    assert torch.equal(dequantize_int5(*int4_as_int5(c4, d4, m4)), dequantize_int4(c4, d4, m4))
    with pytest.raises(LongattnError, match="multiple of 32"):
        quantize_int5(torch.randn(4, 40))


def test_int4_rows_that_are_not_whole_groups_stay_int8():
    lin = transformer.Linear(40, 8, False)
    lin.weight.data = torch.randn(8, 40)
    lin.to_int4()
    assert lin.codes is None and lin.qweight.dtype == torch.int8
    lin = transformer.Linear(40, 8, False)
    lin.weight.data = torch.randn(8, 40)
    lin.to_int5()
    assert lin.codes is None and lin.hbits is None and lin.qweight.dtype == torch.int8


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 14])  # tiles of 8 (int5) or 4 and each remainder
@pytest.mark.parametrize("K", [32, 96, 160, 288, 544, 896])  # G % 8 and G % 4 tails, 8-group blocks
@pytest.mark.parametrize("wide", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("bits", [4, 5])
def test_group_kernels_match_exact_reference(rows, K, wide, bits):
    """Activations rounded per block of 32 exactly as quantize_activations does (a different
    rounding moves a result by a whole step, ~1e4 times this bound), integer dots exact, one
    rounding per group scale and per group term into float32 lanes: within (G + 10) float32
    roundings of the sum of |terms| (G = K / 32) plus half an ulp, against float64 arithmetic on
    the same rounded inputs, for the AVX2 form and (where the CPU has AVX-512 VNNI; elsewhere
    the AVX2 form is checked twice) the AVX-512 one, for int4 and int5 (whose codes reach 31:
    the integer dots stay exact). PyTorch's evaluation of the same product (the fallback) sums
    in another order: within K roundings."""
    assert native.available()
    _check_group_kernel(rows, K, "avx512" if wide and native.has_avx512() else "avx2", bits)


def _check_group_kernel(rows, K, isa, bits):
    g = torch.Generator().manual_seed(rows * 1000 + K)
    N = 70
    x = torch.randn(rows, K, generator=g) * torch.logspace(-2, 1, K)
    x[0, :32] = 0.0  # an all-zero activation block
    w = torch.randn(N, K, generator=g)
    w[3, :32] = 0.5  # a constant weight group (step 0)
    if bits == 4:
        codes, d, m = quantize_int4(w)
        fifth, matmul, deq, op = (), int4_matmul, dequantize_int4, torch.ops.longattn_cpu.int4_gemm
    else:
        codes, hbits, d, m = quantize_int5(w)
        fifth, matmul, deq, op = (hbits,), int5_matmul, dequantize_int5, torch.ops.longattn_cpu.int5_gemm
    y = matmul(x, codes, *fifth, d, m, kernel="avx2", isa=isa)
    xe = quantize_activations(x).double()
    ref = xe @ deq(codes, *fifth, d, m, torch.float64).T
    terms = xe.abs() @ deq(codes, *fifth, d.abs(), m.abs(), torch.float64).T
    G = K // INT4_GROUP
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    assert torch.all((y.double() - ref).abs() <= 2.0 ** -24 * ref.abs() + (G + 10) * 2.0 ** -23 * terms + 1e-30)
    y_torch = matmul(x, codes, *fifth, d, m, kernel="torch")
    assert torch.all((y_torch.double() - ref).abs() <= 2.0 ** -24 * ref.abs() + K * 2.0 ** -23 * terms + 1e-30)
    parts = (codes, *fifth, d, m)
    _check_row_invariance(lambda x_, rows_=slice(None): op(x_, *(p[rows_] for p in parts), native.isa_code(isa)), x, y)


def test_int4_avx512_form_is_refused_without_the_cpu_features():
    """Forcing the AVX-512 form works exactly where the CPU has AVX-512 VNNI (the exact-reference
    test above then checks both forms), and is refused with a clear error elsewhere; a bad
    ``isa`` is refused before any kernel runs."""
    codes, d, m = quantize_int4(torch.randn(8, 64))
    x = torch.randn(1, 64)
    if native.has_avx512():
        assert int4_matmul(x, codes, d, m, kernel="avx2", isa="avx512").shape == (1, 8)
    else:
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            int4_matmul(x, codes, d, m, kernel="avx2", isa="avx512")
    with pytest.raises(ValueError, match="isa"):
        int4_matmul(x, codes, d, m, kernel="avx2", isa="sse")


def test_group_native_dequantize_is_the_correctly_rounded_weight():
    """The prefill path's weight rows (one fma per value) equal float64's d * u + m rounded to
    float32, bit for bit, for every group of a matrix with constant and zero groups, int4 and
    int5."""
    assert native.available()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 160, generator=g) * torch.logspace(-4, 1, 300)[:, None]
    w[7] = 0.0
    w[9, 64:96] = -0.25
    codes, d, m = quantize_int4(w)
    exact = dequantize_int4(codes, d, m, torch.float64)
    assert torch.equal(torch.ops.longattn_cpu.int4_dequantize(codes, d, m), exact.float())
    assert torch.equal(dequantize_int4(codes, d, m), exact.float())
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.longattn_cpu.int4_dequantize(codes, d[:, :2], m)
    codes, hbits, d, m = quantize_int5(w)
    exact = dequantize_int5(codes, hbits, d, m, torch.float64)
    assert torch.equal(torch.ops.longattn_cpu.int5_dequantize(codes, hbits, d, m), exact.float())
    assert torch.equal(dequantize_int5(codes, hbits, d, m), exact.float())
    with pytest.raises(RuntimeError, match="hbits"):
        torch.ops.longattn_cpu.int5_dequantize(codes, hbits[:, :4], d, m)


def test_int4_kernel_rejects_wrong_dtypes_and_shapes():
    assert native.available()
    codes, d, m = quantize_int4(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.longattn_cpu.int4_gemm(torch.randn(1, 64, dtype=torch.float64), codes, d, m)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.longattn_cpu.int4_gemm(torch.randn(1, 40), codes, d, m)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.longattn_cpu.int4_gemm(torch.randn(1, 96), codes, d, m)
    codes, hbits, d, m = quantize_int5(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="hbits"):
        torch.ops.longattn_cpu.int5_gemm(torch.randn(1, 64), codes, hbits.to(torch.int8), d, m)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.longattn_cpu.int5_gemm(torch.randn(1, 64).double(), codes, hbits, d, m)


@pytest.mark.parametrize("weights", FORMATS)
def test_each_format_builds_what_it_claims(weights):
    m, _ = tiny("qwen2", weights)  # tied embeddings: table and head share one quantized copy
    lin = m.model.layers[0].self_attn.qkv
    if weights == "int8":
        assert lin.weight is None and lin.qweight.dtype == torch.int8
        assert m._tied_head.qweight is m.model.embed_tokens.table.qweight
    elif weights in ("int4", "int5"):
        assert lin.weight is None and lin.qweight is None and lin.codes.dtype == torch.uint8
        assert lin.codes.shape == (lin.steps.shape[0], lin.steps.shape[1] * INT4_GROUP // 2)
        assert m._tied_head.codes is m.model.embed_tokens.table.codes
        assert (lin.hbits is not None) == (weights == "int5")
    else:
        assert lin.weight.dtype == {"f32": torch.float32, "bf16": torch.bfloat16}[weights]
    assert m.weights == weights


def test_a_recipe_gives_each_named_kind_its_format():
    from longattn.checkpoint import load_checkpoint
    from conftest import tiny_dir
    from longattn.models.weights import parse_recipe, recipe_name
    assert parse_recipe("int4+int8:qkv,embed") == ("int4", (("qkv", "int8"), ("embed", "int8")))
    assert parse_recipe("q8") == ("int8", ())
    spec = "int5+int8:qkv,lm_head+int4:gate_up"
    assert parse_recipe(spec) == ("int5", (("qkv", "int8"), ("lm_head", "int8"), ("gate_up", "int4")))
    assert recipe_name(*parse_recipe(spec)) == spec and recipe_name("int4", ("qkv",)) == "int4+int8:qkv"
    for bad in ("f32+int8:qkv", "int4+bf16:qkv", "int4+int8", "int4+int8:", "int4+int9:qkv"):
        with pytest.raises(LongattnError):
            parse_recipe(bad)
    ck = load_checkpoint(tiny_dir("qwen2"), with_tokenizer=False)
    m = build_model(ck.config, ck.state_dict, weights="int4", kinds=(("qkv", "int8"), ("embed", "int8")))
    layer = m.model.layers[0]
    assert layer.self_attn.qkv.qweight is not None and layer.self_attn.qkv.codes is None
    assert layer.mlp.gate_up.codes is not None and layer.self_attn.o_proj.codes is not None
    assert m.model.embed_tokens.table.qweight is not None and m._tied_head is m.model.embed_tokens.table
    assert m.weights == "int4+int8:qkv,embed"
    m = build_model(ck.config, ck.state_dict, weights="int5", kinds=(("gate_up", "int4"), ("embed", "int8")))
    layer = m.model.layers[0]
    assert layer.self_attn.qkv.hbits is not None and layer.mlp.gate_up.hbits is None
    assert layer.mlp.gate_up.codes is not None and m.model.embed_tokens.table.qweight is not None
    assert m.weights == "int5+int8:embed+int4:gate_up"


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("path", ["forward", "step"])
def test_unset_and_wide_window_bit_for_bit_in_each_format(weights, path):
    m, _ = tiny("llama", weights)
    ids = ids_for()
    L = m.config.num_layers
    dense = run_path(m, AttentionPolicy.build(m.config, "layers", windows=[None] * L), ids, path)
    wide = run_path(m, AttentionPolicy.build(m.config, "window", window=ids.shape[1], sinks=2), ids, path)
    assert torch.equal(dense, wide)


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("family,window,sinks", [("llama", 5, 2), ("gemma3", None, 0), ("qwen2", 4, 1)])
def test_all_paths_agree_in_each_format(monkeypatch, weights, family, window, sinks):
    monkeypatch.setattr(linear, "WIDEN_ROWS", 1 << 30)  # bf16's forward runs its decode arithmetic too
    m, m64 = tiny(family, weights)
    pol = AttentionPolicy.from_config(m.config) if window is None else \
        AttentionPolicy.build(m.config, "window", window=window, sinks=sinks)
    assert_paths_agree(m, m64, pol)


@pytest.mark.parametrize("weights", ["int8", "int4", "int5"])
def test_quantized_streams_batched_equal_each_alone(weights):
    m, m64 = tiny("llama", weights)
    pol = AttentionPolicy.build(m.config, "window", window=4, sinks=2)
    assert_streams_agree(m, m64, pol, lens=[5, 13], steps=5)


@pytest.mark.real
def test_quantized_weights_cost_what_the_readme_says_on_a_book():
    """int8 bits/token within 0.02 of f32 and int4 within 0.15 (measured 0.11 on three book
    passages, benchmarks/weights_quality.py) on 1,024 SmolLM2 book tokens, both with activations
    rounded to int8 per block of 32 as every quantized product does."""
    from conftest import real_checkpoint
    from longattn.data import book_body
    from longattn.lab.stream import nll_bits
    ck = real_checkpoint("smollm2-135m")
    ids = torch.tensor([ck.tokenizer.encode(book_body())[:1024]])

    def bits(m):
        return nll_bits(m(ids)[0, :-1], ids[0, 1:]).mean().item()

    b = {w: bits(build_model(ck.config, ck.state_dict, weights=w)) for w in ("f32", "int8", "int4")}
    print("bits/token " + ", ".join(f"{k} {v:.4f}" for k, v in b.items()))
    assert abs(b["int8"] - b["f32"]) <= 0.02
    assert 0 < b["int4"] - b["f32"] <= 0.15  # int4 does cost something: the test can fail both ways


def test_prefill_widening_in_blocks_matches_the_float_matrix(monkeypatch):
    """Prefill-sized inputs widen bf16 weights block by block; against float64 on the same
    effective weights the result is within twice the error of one float32 F.linear."""
    monkeypatch.setattr(linear, "WIDEN_BLOCK", 16)
    g = torch.Generator().manual_seed(1)
    lin = transformer.Linear(64, 70, bias=True)  # 70 rows: 4 full blocks and a partial one
    lin.weight.data = torch.randn(70, 64, generator=g)
    lin.bias.data = torch.randn(70, generator=g)
    lin.weight.data = lin.weight.data.to(torch.bfloat16)
    x = torch.randn(linear.WIDEN_ROWS + 3, 64, generator=g)
    w = lin.effective_weight()
    ref = x.double() @ w.double().T + lin.bias.double()
    plain = torch.nn.functional.linear(x, w, lin.bias)
    assert_within_derived(lin(x), plain, ref, floor=TIE_FLOOR)


@pytest.mark.parametrize("weights", ["int8", "int4", "int5", "f32", "bf16"])
def test_quantized_linear_runs_one_arithmetic_at_every_row_count(weights):
    """A prefill's hundreds of rows and a decode step's one run the same kernel: each row of a
    prefill-sized call is, bit for bit, what it gets alone (the bias included)."""
    g = torch.Generator().manual_seed(2)
    lin = transformer.Linear(96, 70, bias=True)
    lin.weight.data = torch.randn(70, 96, generator=g)
    lin.bias.data = torch.randn(70, generator=g)
    if weights in ("f32", "bf16"):
        lin.weight.data = lin.weight.data.to(torch.bfloat16 if weights == "bf16" else torch.float32)
        lin.kernel = linear.quantized_kernel()  # as build_model chooses it
    else:
        getattr(lin, f"to_{weights}")()
    x = torch.randn(2, linear.WIDEN_ROWS + 7, 96, generator=g)
    y = lin(x)
    assert all(torch.equal(lin(x[b, t]), y[b, t]) for b in range(2) for t in range(x.shape[1]))


def test_quantizing_by_slices_of_rows_is_the_whole_matrix_result(monkeypatch):
    """Large matrices are quantized a slice of rows at a time (bounded temporaries); rows are
    independent, so every slicing gives the whole-matrix codes and scales bit for bit."""
    from longattn.models import weights
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g) * torch.rand(300, 1, generator=g)
    w[7] = 0
    whole = (*quantize_int8(w), *quantize_int4(w))
    for values in (96, 96 * 7 + 5, 96 * 299):  # one row, an uneven slice, a ragged last slice
        monkeypatch.setattr(weights, "QUANTIZE_SLICE", values)
        sliced = (*quantize_int8(w), *quantize_int4(w))
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(whole, sliced))
