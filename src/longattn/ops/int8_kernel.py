"""The AVX2 int8 decode kernel (``csrc/int8_gemv.cpp``): build once, load, fall back.

``int8_gemv(x, q, s)`` computes ``x @ (q * s[:, None]).T`` with float32 activations and
int8 weights widened in registers. It is built on first use with the machine's C++ compiler
(torch.utils.cpp_extension + ninja, about 10 s) into ``$LONGATTN_CACHE/kernels`` and reused
after. Where it cannot be used (no AVX2, no compiler, or ``LONGATTN_INT8_KERNEL=aten``) the
caller falls back to PyTorch's ``aten._weight_int8pack_mm``; ``kernel_name()`` says which
one runs, and benchmarks record it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "int8_gemv.cpp"
# torch.backends.cpu.get_cpu_capability() values whose CPUs run AVX2 + FMA code.
AVX2_CAPABILITIES = ("AVX2", "AVX512", "AVX512_BF16", "AMX")
_state: dict = {}


def _build() -> bool:
    if os.environ.get("LONGATTN_INT8_KERNEL", "").lower() == "aten":
        return False
    if torch.backends.cpu.get_cpu_capability() not in AVX2_CAPABILITIES:
        return False
    from torch.utils.cpp_extension import load

    from ..checkpoint.paths import cache_root
    build = cache_root() / "kernels" / f"int8_gemv-torch{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        load(name="longattn_int8_gemv", sources=[str(_SOURCE)], build_directory=str(build),
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja: the aten kernel still works
        warnings.warn(f"longattn: the AVX2 int8 kernel did not build ({str(e).splitlines()[0]}); "
                      "using aten._weight_int8pack_mm")
        return False

    @torch.library.register_fake("longattn_cpu::int8_gemv")
    def _(x, q, s):
        return x.new_empty(x.shape[0], q.shape[0])
    return True


def available() -> bool:
    """True when the AVX2 kernel is built and loaded (builds it on the first call)."""
    if "ok" not in _state:
        _state["ok"] = _build()
    return _state["ok"]


def kernel_name() -> str:
    return "longattn-avx2" if available() else "aten-int8pack"


def int8_gemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` float32, ``q [N, K]`` int8, ``s [N]`` float32 -> ``[M, N]`` float32."""
    return torch.ops.longattn_cpu.int8_gemv(x, q, s)
