"""The one place that picks a matmul kernel for each weight format.

Formats (``models.weights`` makes them): float32 and bf16 matrices, int8 rows with one float32
scale each, int4 and int5 groups of 32 with a float16 step and offset. The quantized formats
have one arithmetic for every number of rows: activations rounded to int8 per block of 32
(``quantize_activations``), exact integer dots with the stored codes, float32 sums in an order
fixed per output element. So a token's result is the same bits whether it is one of a
prefill's hundreds of rows, a decode step's one row or one of many streams batched together
(docs/design.md, invariant 3), and prefill runs on the weights as stored.

| format | kernel "avx2" (the native build, float32 activations) | fallback ("torch") |
|---|---|---|
| int8, int4, int5 | ``csrc/quant_gemm.cpp``: integer dots, rows tiled to share each unpacked weight group | the same product in PyTorch: ``quantize_activations(x) @ W_eff^T`` |
| f32, bf16 | ``csrc/float_gemm.cpp``: float32 fma dots in one order per output, bf16 widened in registers | ``F.linear`` (bf16: in bf16 for few rows, widened to float32 for many) |

``quantized_kernel`` makes the choice once, when a layer is converted or a float model built (a plain string is a constant
to torch.compile, and a first-call build must not happen inside a trace). The int4 and int5
kernels have an AVX2 and an AVX-512 form; ``isa`` picks one (``ops.native.isa_code``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native

INT4_GROUP = 32  # weights per int4 group (and activations per int8 block in its kernel)


# With this many rows or more, a bf16 weight is widened to float32 for the matmul: CPUs without
# bf16 GEMM units run bf16 prefill far slower than float32, while widening costs one pass over
# the weight. Decode (few rows) stays in bf16, where reading half the bytes is the gain.
WIDEN_ROWS = 32


# Widening happens WIDEN_BLOCK output rows at a time: a whole widened matrix would be a fresh
# allocation of up to hundreds of MB per call, whose page faults cost more than the matmul; a
# block-sized temporary is reused.
WIDEN_BLOCK = 1024


def widened_linear(x: torch.Tensor, n_out: int, widen, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T + b`` in x's dtype, where ``widen(i, j)`` returns rows ``i:j`` of W
    as a ``[j - i, K]`` tensor in x's dtype (a slice converted from bf16 or int8)."""
    if n_out <= WIDEN_BLOCK:
        return F.linear(x, widen(0, n_out), None if b is None else b.to(x.dtype))
    parts = [F.linear(x, widen(i, min(n_out, i + WIDEN_BLOCK)))
             for i in range(0, n_out, WIDEN_BLOCK)]
    y = torch.cat(parts, dim=-1)
    return y if b is None else y + b.to(x.dtype)


def prefill_sized(x: torch.Tensor) -> bool:
    """``x [..., K]`` has WIDEN_ROWS rows or more: widen the weight, run a float GEMM."""
    return x.numel() // x.shape[-1] >= WIDEN_ROWS


def float_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 kernel: str = "torch") -> torch.Tensor:
    """``x [..., K] @ w^T + b`` for a float32 or bf16 ``w [N, K]``, result ``[..., N]`` in x's dtype.

    kernel "avx2" (float32 x): ``csrc/float_gemm.cpp``, one summation order per output element
    for any number of rows (bf16 weights widened in registers, read as stored). Otherwise
    ``F.linear``: in the weight's dtype for few rows (bf16 weights read half the bytes),
    widened for many -- a library GEMM whose row's bits may depend on the rows beside it.
    """
    if kernel == "avx2" and x.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16):
        shape = x.shape
        y = torch.ops.longattn_cpu.float_gemm(x.reshape(-1, shape[-1]), w).reshape(*shape[:-1], w.shape[0])
        return y if b is None else y + b.to(y.dtype)
    if w.dtype != x.dtype:
        if prefill_sized(x):
            return widened_linear(x, w.shape[0], lambda i, j: w[i:j].to(x.dtype), b)
        y = F.linear(x.to(w.dtype), w, None if b is None else b.to(w.dtype))
        return y.to(x.dtype)
    return F.linear(x, w, b)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q [N, K]`` int8, ``scales [N]`` -> ``[N, K]`` in ``dtype`` (the weight int8 stands for)."""
    return (q.to(dtype) * scales.to(dtype)[:, None])


def dequantize_int4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``codes [N, K/2]``, ``d, m [N, K/32]`` -> ``[N, K]`` in ``dtype``: ``d * u + m`` rounded once
    (float64 holds it exactly). float32 runs the native kernel where it is built (one fma per
    value, the same bits, in one pass instead of several PyTorch ops)."""
    if dtype == torch.float32 and native.available():
        return torch.ops.longattn_cpu.int4_dequantize(codes, d, m)
    N = codes.shape[0]
    c = codes.reshape(N, -1, INT4_GROUP // 2)
    u = torch.cat([c & 15, c >> 4], dim=-1).double()
    return (u * d.double()[..., None] + m.double()[..., None]).reshape(N, -1).to(dtype)


def unpack_fifth_bits(hbits: torch.Tensor) -> torch.Tensor:
    """hbits ``[N, G*4]`` uint8 -> ``[N, G, 32]`` uint8 of 0s and 1s: bit k of each group's
    little-endian 32-bit word (models.weights.pack_fifth_bits's inverse)."""
    N = hbits.shape[0]
    bits = (hbits[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(N, -1, INT4_GROUP)


def dequantize_int5(codes: torch.Tensor, hbits: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    dtype=torch.float32) -> torch.Tensor:
    """``codes [N, K/2]``, ``hbits [N, K/8]``, ``d, m [N, K/32]`` -> ``[N, K]`` in ``dtype``:
    ``d * u + m`` with u the 5-bit code, rounded once (as dequantize_int4; the native kernel
    for float32 where it is built)."""
    if dtype == torch.float32 and native.available():
        return torch.ops.longattn_cpu.int5_dequantize(codes, hbits, d, m)
    N = codes.shape[0]
    c = codes.reshape(N, -1, INT4_GROUP // 2)
    u = (torch.cat([c & 15, c >> 4], dim=-1) | (unpack_fifth_bits(hbits) << 4)).double()
    return (u * d.double()[..., None] + m.double()[..., None]).reshape(N, -1).to(dtype)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the quantized kernels multiply by: ``x [..., K]`` rounded to int8 per block of 32
    (a last block of ``K % 32`` values on its own) with one step ``max|x| / 127`` per block,
    returned dequantized in x's dtype (for float32 x these are the kernels' own values, bit for
    bit)."""
    K = x.shape[-1]
    whole = K - K % INT4_GROUP
    if whole < K:
        return torch.cat([quantize_activations(x[..., :whole]), _quantize_block(x[..., whole:])], dim=-1)
    xb = x.reshape(*x.shape[:-1], -1, INT4_GROUP)
    return _quantize_block(xb).reshape(x.shape)


def _quantize_block(xb: torch.Tensor) -> torch.Tensor:
    """``xb [..., B]`` rounded to int8 along the last dimension with one step, dequantized."""
    step = xb.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(xb / safe).clamp_(-127, 127)
    return xq * step


def _quantized_matmul(x: torch.Tensor, n_out: int, kernel: str, native_op, weight) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., n_out]``: ``native_op(x2)`` on ``x2 [M, K]`` where kernel is
    "avx2" and x float32, else ``quantize_activations(x2) @ weight(x.dtype)^T`` in PyTorch."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if kernel == "avx2" and x.dtype == torch.float32:
        y = native_op(x2)
    else:
        y = quantize_activations(x2) @ weight(x.dtype).T
    return y.reshape(*shape[:-1], n_out)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, kernel: str = "torch",
                isa: str | None = None) -> torch.Tensor:
    """``x [..., K]`` -> ``quantize_activations(x) @ (q * scales)^T`` as ``[..., N]``.

    kernel "avx2" (float32 x only): longattn's kernel (``csrc/quant_gemm.cpp``; ``isa`` picks its
    AVX2 or AVX-512 form, ``ops.native.isa_code``). Otherwise PyTorch evaluates the same product
    in x's dtype (the fallback where the kernel cannot run).
    """
    return _quantized_matmul(
        x, q.shape[0], kernel, lambda x2: torch.ops.longattn_cpu.int8_gemm(x2, q, scales, native.isa_code(isa)),
        lambda dtype: dequantize_int8(q, scales, dtype))


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                kernel: str = "torch", isa: str | None = None) -> torch.Tensor:
    """``x [..., K]`` -> ``quantize_activations(x) @ dequantize_int4(codes, d, m)^T`` as ``[..., N]``:
    int8_matmul for 4-bit groups (``isa`` picks the kernel's form, ``ops.native.isa_code``)."""
    return _quantized_matmul(
        x, codes.shape[0], kernel, lambda x2: torch.ops.longattn_cpu.int4_gemm(x2, codes, d, m, native.isa_code(isa)),
        lambda dtype: dequantize_int4(codes, d, m, dtype))


def int5_matmul(x: torch.Tensor, codes: torch.Tensor, hbits: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                kernel: str = "torch", isa: str | None = None) -> torch.Tensor:
    """``x [..., K]`` -> ``quantize_activations(x) @ dequantize_int5(codes, hbits, d, m)^T`` as
    ``[..., N]``: int4_matmul for 5-bit codes (the same kernels and fallback)."""
    return _quantized_matmul(
        x, codes.shape[0], kernel,
        lambda x2: torch.ops.longattn_cpu.int5_gemm(x2, codes, hbits, d, m, native.isa_code(isa)),
        lambda dtype: dequantize_int5(codes, hbits, d, m, dtype))


def quantized_kernel() -> str:
    """The kernel an int8, int4 or int5 layer runs: "avx2" where the native kernels are built
    (building them on the first call), else "torch"."""
    return "avx2" if native.available() else "torch"


def kernel_name() -> str:
    """The quantized matmul kernel in use, as benchmarks record it."""
    return "longattn-avx2" if quantized_kernel() == "avx2" else "torch"
