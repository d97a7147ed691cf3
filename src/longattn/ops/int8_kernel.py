"""The AVX2 int8 decode kernel (``csrc/int8_gemv.cpp``; built by ops/native.py).

``int8_gemv(x, q, s)`` computes ``x @ (q * s[:, None]).T`` with float32 activations and
int8 weights widened in registers. Where the native kernels cannot be used (no AVX2, no
compiler, or ``LONGATTN_NATIVE=off``) the caller falls back to
PyTorch's ``aten._weight_int8pack_mm``; ``kernel_name()`` says which one runs, and benchmarks
record it.
"""

from __future__ import annotations

import torch

from .native import AVX2_CAPABILITIES, available  # noqa: F401  (re-exported)


def kernel_name() -> str:
    return "longattn-avx2" if available() else "aten-int8pack"


def int8_gemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` float32, ``q [N, K]`` int8, ``s [N]`` float32 -> ``[M, N]`` float32."""
    return torch.ops.longattn_cpu.int8_gemv(x, q, s)
