"""Weight formats (f32, bf16, int8): the quantizer, the int8 kernel against an exact
reference, every attention site under each format, and int8's quality cost on a real model.

Tolerances: a quantized model is compared with a float64 model built from the weights it
really multiplies by (``effective_state_dict``). With WIDEN_ROWS raised the full forward runs
the decode kernels too, so its error is the plain reference error of that arithmetic; the
cached paths must stay within twice it (as in test_windows.py).
"""

import pytest
import torch

from conftest import tiny_dir
from longattn.checkpoint import load_checkpoint
from longattn.errors import LongattnError
from longattn.models import build_model
from longattn.models import transformer
from longattn.ops import int8_kernel
from longattn.models.weights import (dequantize_int8, effective_state_dict, int8_matmul, parse_weights,
                                     quantize_int8)
from longattn.policy import AttentionPolicy
from test_windows import _ids, assert_paths_agree, assert_streams_agree, run_path

FORMATS = ["f32", "bf16", "int8"]


def tiny(family, weights):
    ck = load_checkpoint(tiny_dir(family), with_tokenizer=False)
    m = build_model(ck.config, ck.state_dict, weights=weights)
    ref = build_model(ck.config, effective_state_dict(ck.state_dict, weights), dtype=torch.float64)
    return m, ref


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
    assert parse_weights("INT8") == "int8"
    with pytest.raises(LongattnError, match="f32, bf16, int8"):
        parse_weights("fp8")
    with pytest.raises(LongattnError, match="int4"):
        parse_weights("int4")


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_aten_int8_kernel_matches_exact_reference(rows):
    """aten._weight_int8pack_mm (the fallback) rounds x to bf16, accumulates in float32, rounds
    the output to bf16: the bound is half a bf16 ulp of the output plus K float32 roundings of
    the sum of |terms|, against float64 arithmetic on the same bf16 inputs."""
    g = torch.Generator().manual_seed(rows)
    K, N = 96, 70
    x = torch.randn(rows, K, generator=g)
    q, s = quantize_int8(torch.randn(N, K, generator=g))
    sb = s.to(torch.bfloat16)
    y = int8_matmul(x, q, s, sb, kernel="aten")
    xb = x.to(torch.bfloat16).double()
    w = q.double() * sb.double()[:, None]
    ref = xb @ w.T
    bound = 2.0 ** -8 * ref.abs() + K * 2.0 ** -23 * (xb.abs() @ w.abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    assert torch.all((y.double() - ref).abs() <= bound)


def test_avx2_int8_kernel_is_built_where_the_cpu_has_avx2():
    """The fast kernel must really run on x86 CI machines, not silently fall back."""
    if torch.backends.cpu.get_cpu_capability() in int8_kernel.AVX2_CAPABILITIES:
        assert int8_kernel.available() and int8_kernel.kernel_name() == "longattn-avx2"
        lin = transformer.Linear(16, 8, False)
        lin.weight.data = torch.randn(8, 16)
        lin.to_int8()
        assert lin.kernel == "avx2"
    else:
        assert not int8_kernel.available()


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("K", [96, 100, 77, 5])  # whole 32-blocks, an 8-block tail, scalar tails
def test_avx2_int8_kernel_matches_exact_reference(rows, K):
    """float32 activations, int8 weights widened exactly, float32 accumulation in any order,
    one rounding for the row scale: within K float32 roundings of the sum of |terms| plus half
    an ulp of the output, against float64 arithmetic on the same inputs."""
    assert int8_kernel.available()
    g = torch.Generator().manual_seed(rows * 1000 + K)
    N = 70
    x = torch.randn(rows, K, generator=g)
    q, s = quantize_int8(torch.randn(N, K, generator=g))
    y = int8_matmul(x, q, s, s.to(torch.bfloat16), kernel="avx2")
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.T
    bound = 2.0 ** -24 * ref.abs() + K * 2.0 ** -24 * (x.double().abs() @ w.abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    assert torch.all((y.double() - ref).abs() <= bound)
    # a transposed (non-contiguous) activation view gives the same bits
    assert torch.equal(int8_kernel.int8_gemv(x.T.contiguous().T, q, s), y)


def test_avx2_int8_kernel_rejects_wrong_dtypes_and_shapes():
    assert int8_kernel.available()
    q, s = quantize_int8(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="float32"):
        int8_kernel.int8_gemv(torch.randn(1, 8, dtype=torch.float64), q, s)
    with pytest.raises(RuntimeError, match="shapes"):
        int8_kernel.int8_gemv(torch.randn(1, 9), q, s)


@pytest.mark.parametrize("weights", FORMATS)
def test_int8_and_bf16_build_what_they_claim(weights):
    m, _ = tiny("qwen2", weights)  # tied embeddings: table and head share one int8 copy
    lin = m.model.layers[0].self_attn.qkv
    if weights == "int8":
        assert lin.weight is None and lin.qweight.dtype == torch.int8
        assert m._tied_head.qweight is m.model.embed_tokens.table.qweight
    else:
        assert lin.weight.dtype == {"f32": torch.float32, "bf16": torch.bfloat16}[weights]
    assert m.weights == weights


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("path", ["forward", "step"])
def test_unset_and_wide_window_bit_for_bit_in_each_format(weights, path):
    m, _ = tiny("llama", weights)
    ids = _ids()
    L = m.config.num_layers
    dense = run_path(m, AttentionPolicy.build(m.config, "layers", windows=[None] * L), ids, path)
    wide = run_path(m, AttentionPolicy.build(m.config, "window", window=ids.shape[1], sinks=2), ids, path)
    assert torch.equal(dense, wide)


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("family,window,sinks", [("llama", 5, 2), ("gemma3", None, 0), ("qwen2", 4, 1)])
def test_all_paths_agree_in_each_format(monkeypatch, weights, family, window, sinks):
    monkeypatch.setattr(transformer, "WIDEN_ROWS", 1 << 30)  # forward uses the decode kernels too
    m, m64 = tiny(family, weights)
    pol = AttentionPolicy.from_config(m.config) if window is None else \
        AttentionPolicy.build(m.config, "window", window=window, sinks=sinks)
    assert_paths_agree(m, m64, pol)


def test_int8_streams_batched_equal_each_alone(monkeypatch):
    monkeypatch.setattr(transformer, "WIDEN_ROWS", 1 << 30)
    m, m64 = tiny("llama", "int8")
    pol = AttentionPolicy.build(m.config, "window", window=4, sinks=2)
    assert_streams_agree(m, m64, pol, lens=[5, 13], steps=5)


@pytest.mark.real
def test_int8_costs_under_two_hundredths_of_a_bit_on_a_book():
    """The issue's quality budget: int8 bits/token within 0.02 of f32 (SmolLM2, 1,024 book tokens)."""
    from conftest import real_checkpoint
    from longattn.data import book_body
    ck = real_checkpoint("smollm2-135m")
    ids = torch.tensor([ck.tokenizer.encode(book_body())[:1024]])
    bits = {}
    for w in ("f32", "int8"):
        m = build_model(ck.config, ck.state_dict, weights=w)
        lp = torch.log_softmax(m(ids)[0, :-1].double(), -1)
        bits[w] = -lp.gather(1, ids[0, 1:, None]).mean().item() / torch.log(torch.tensor(2.0)).item()
    print(f"bits/token f32 {bits['f32']:.4f} int8 {bits['int8']:.4f}")
    assert abs(bits["int8"] - bits["f32"]) <= 0.02


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_prefill_widening_in_blocks_matches_the_float_matrix(monkeypatch, weights):
    """Prefill-sized inputs widen bf16/int8 weights block by block; against float64 on the
    same effective weights the result is within twice the error of one float32 F.linear."""
    monkeypatch.setattr(transformer, "WIDEN_BLOCK", 16)
    g = torch.Generator().manual_seed(1)
    lin = transformer.Linear(40, 70, bias=True)  # 70 rows: 4 full blocks and a partial one
    lin.weight.data = torch.randn(70, 40, generator=g)
    lin.bias.data = torch.randn(70, generator=g)
    if weights == "int8":
        lin.to_int8()
    else:
        lin.weight.data = lin.weight.data.to(torch.bfloat16)
    x = torch.randn(transformer.WIDEN_ROWS + 3, 40, generator=g)
    w = lin.effective_weight()
    ref = x.double() @ w.double().T + lin.bias.double()
    plain = torch.nn.functional.linear(x, w, lin.bias)
    tol = 2 * (plain.double() - ref).abs().max().item() + 1e-12
    assert (lin(x).double() - ref).abs().max().item() <= tol
