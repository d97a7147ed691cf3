"""Weight formats for the projection matrices: f32, bf16 and int8 (per output channel).

``int8`` stores every 2-D weight (projections, embedding table, output head) as int8 rows with
one float32 scale per row (symmetric, scale = max|row| / 127). Decode-sized matmuls (< WIDEN_ROWS
rows) run PyTorch's CPU kernel ``aten._weight_int8pack_mm`` on bf16 activations: a step reads a
quarter of the float32 bytes. Prefill-sized matmuls dequantize the weight to float32 once per
call (this CPU has no fast int8 or bf16 GEMM for many rows; see WIDEN_ROWS in transformer.py).

Per-row quantization commutes with concatenating rows, so the fused q/k/v and gate/up matrices
hold exactly the values that quantizing each part would give: ``effective_state_dict`` uses that
to build the float reference model that tests compare the int8 paths against.

int4 is not offered: in a quick microbenchmark on this machine (one decode row, 2 threads,
taken while other work ran, so indicative only) PyTorch's ``_weight_int4pack_mm_for_cpu`` was
slower than bf16 ``F.linear`` on the 576x1536 and 49152x576 shapes and only ~15% faster on
896x4864; a fused 4-bit kernel would be needed for int4 to pay.
"""

from __future__ import annotations

import torch

from ..errors import LongattnError
from ..ops.int8_kernel import int8_gemv

WEIGHT_FORMATS = ("f32", "bf16", "int8")
# names accepted on the command line and in the API (the old --dtype spellings included)
_ALIASES = {"f32": "f32", "float32": "f32", "fp32": "f32", "bf16": "bf16", "bfloat16": "bf16",
            "int8": "int8", "q8": "int8"}


def parse_weights(name: str) -> str:
    """Canonical weight-format name (``f32``, ``bf16`` or ``int8``); one-line error otherwise."""
    if isinstance(name, torch.dtype):
        name = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(name, str(name))
    key = _ALIASES.get(str(name).lower())
    if key is None:
        hint = " (int4: PyTorch's CPU int4 kernel is slower than bf16 here)" if "4" in str(name) else ""
        raise LongattnError(f"unknown weight format {name!r}{hint}; use one of {', '.join(WEIGHT_FORMATS)}")
    return key


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8. ``w [N, K]`` float -> (q ``[N, K]`` int8, scales ``[N]`` float32).

    Rows that are all zero get scale 1 (q = 0), so dequantizing never divides by zero.
    """
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q [N, K]`` int8, ``scales [N]`` -> ``[N, K]`` in ``dtype`` (the weight int8 stands for)."""
    return (q.to(dtype) * scales.to(dtype)[:, None])


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, scales_bf16: torch.Tensor,
                kernel: str = "aten") -> torch.Tensor:
    """``x [..., K]`` -> ``x @ (q * scales)^T`` as ``[..., N]`` in x's dtype.

    kernel "avx2" (float32 x only): longattn's kernel, float32 arithmetic on unrounded
    activations (ops/int8_kernel.py). kernel "aten": ``aten._weight_int8pack_mm``, fast only
    with bf16 activations (float32 ones ran 5-9x slower), so x and the scales are rounded to
    bf16 exactly as the bf16 weight path does.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if kernel == "avx2" and x.dtype == torch.float32:
        y = int8_gemv(x2, q, scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), q, scales_bf16)
    return y.reshape(*shape[:-1], q.shape[0]).to(x.dtype)


def effective_state_dict(state_dict: dict, weights: str) -> dict:
    """The float32 weights a model built with ``weights`` really multiplies by.

    For ``int8`` every 2-D tensor is quantized and dequantized per row; bf16 rounds the 2-D
    tensors to bf16; f32 returns the dict unchanged. Build a float64 model from the result to get
    an exact reference for the quantized paths.
    """
    fmt = parse_weights(weights)
    out = {}
    for k, t in state_dict.items():
        if t.dim() != 2 or fmt == "f32":
            out[k] = t
        elif fmt == "bf16":
            out[k] = t.to(torch.bfloat16).float()
        else:
            out[k] = dequantize_int8(*quantize_int8(t))
    return out
