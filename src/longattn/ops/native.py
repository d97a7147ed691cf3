"""longattn's own CPU kernels (``csrc/*.cpp``): built once with the machine's compiler, loaded,
or reported missing so callers fall back to PyTorch ops.

All sources build into one extension (torch.utils.cpp_extension + ninja, about half a minute
the first time; see build.py for how a killed or stuck build is survived) under
``$LONGATTN_CACHE/kernels/native-torch<version>-<hash of csrc/>``, loaded directly after;
editing a source or header makes a new build directory, so a stale build never loads.
Where it cannot be used (no AVX2, no compiler, or ``LONGATTN_NATIVE=off``) ``available()`` is
False and every caller has a PyTorch path (see linear.py, attention.py).

Ops (namespace ``longattn_cpu``): ``int8_gemv`` (csrc/int8_gemv.cpp), ``int4_gemv``
(csrc/int4_gemv.cpp),
``decode_attention`` (csrc/decode_attention.cpp) and ``scsa_decode`` (csrc/scsa_decode.cpp, the
sparse decode call of longattn.sparse; eager only, so it needs no fake). The build targets
AVX2; the AVX-512 functions are compiled for that target alone (``#pragma GCC target`` regions)
and run only where the CPU reports the features. The kernels that have both forms take an
``isa`` argument (``isa_code`` below); nothing about it is process-wide.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from .build import BuildError, ExtensionSpec, ensure_built

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))  # included by the sources: part of the build key
# torch.backends.cpu.get_cpu_capability() values whose CPUs run AVX2 + FMA code.
AVX2_CAPABILITIES = ("AVX2", "AVX512", "AVX512_BF16", "AMX")
_state: dict = {}


def _disabled() -> bool:
    """``LONGATTN_NATIVE=off``: the one process-wide switch to the PyTorch reference ops."""
    return os.environ.get("LONGATTN_NATIVE", "").lower() == "off"


def use_reference() -> None:
    """Run PyTorch's reference ops instead of the native kernels for the rest of this process
    and the processes it starts (sets ``LONGATTN_NATIVE=off``; the CLI's ``--reference``). Call
    it before a model is built: a layer picks its kernel when it is made."""
    os.environ["LONGATTN_NATIVE"] = "off"
    _state["ok"] = False


def kernel_spec() -> ExtensionSpec:
    """The one extension all of csrc/ builds into."""
    return ExtensionSpec("longattn_native", tuple(str(p) for p in SOURCES),
                         cflags=("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"), ldflags=("-fopenmp",),
                         announce="building native kernels (first run, ~30 s)")


def _digest() -> str:
    """The sources' and headers' content hash: names one build of the kernels."""
    if "digest" not in _state:
        _state["digest"] = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:12]
    return _state["digest"]


def build_tag() -> str:
    """Names the kernels in use (``native-<digest>``, or ``native-off`` where they are not):
    compiled graphs that call them must be keyed by it. Inductor's on-disk cache keys a graph
    by its code, not by the schema or ABI of the custom ops it calls, so without this a graph
    compiled against an older build of the kernels would be loaded and call them wrongly."""
    return f"native-{_digest()}" if available() else "native-off"


def _build() -> bool:
    if _disabled() or torch.backends.cpu.get_cpu_capability() not in AVX2_CAPABILITIES:
        return False
    from ..checkpoint.paths import cache_root
    build = cache_root() / "kernels" / f"native-torch{torch.__version__}-{_digest()}"
    try:
        torch.ops.load_library(str(ensure_built(kernel_spec(), build)))
    except (BuildError, OSError) as e:  # no compiler, no ninja, out of time: PyTorch paths still work
        warnings.warn(f"the native CPU kernels are not available ({str(e).splitlines()[0]}); "
                      "using PyTorch ops", stacklevel=2)
        return False

    # shapes for torch.compile's tracing (the kernels run only on real tensors)
    @torch.library.register_fake("longattn_cpu::int8_gemv")
    def _(x, q, s, isa=-1):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("longattn_cpu::int4_gemv")
    def _(x, codes, d, m, isa=-1):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("longattn_cpu::int4_dequantize")
    def _(codes, d, m):
        return codes.new_empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)

    @torch.library.register_fake("longattn_cpu::decode_attention")
    def _(q, k, v, k_pos, q_pos, k_new, v_new, window, sinks, scale, sink_logits=None, block_table=None,
          block_size=0, isa=-1):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return True


def available() -> bool:
    """True when the kernels are built and loaded (builds them on the first call)."""
    if "ok" not in _state:
        _state["ok"] = _build()
    return _state["ok"]


ISAS = {None: -1, "auto": -1, "avx2": 0, "avx512": 1}


def isa_code(isa: str | None = None) -> int:
    """The ``isa`` argument of the kernels with an AVX2 and an AVX-512 form (SCSA's opened-row
    phase, the dense fused decode attention's row loops, the int8 and int4 GEMVs): None or
    "auto" = -1 (each kernel's automatic choice), "avx2" = 0, "avx512" = 1 (the kernel raises
    RuntimeError on a CPU without AVX-512 F/BW/VL/DQ/VNNI).

    Automatic: SCSA and the int4 GEMV take their AVX-512 forms where the CPU has them; the int8
    GEMV for batches of two rows or more (one row is bound by memory, where the AVX2 form is as
    fast); the dense attention too, except on AMD CPUs, whose 512-bit units split each operation
    in two, so the AVX2 loops are faster there. SCSA's, the dense attention's and the int8 GEMV's
    two forms give bit-identical outputs; the int4 GEMV's differ in the last bits (other float
    lanes), both within the bound the tests derive. Forcing a form is for tests and benchmarks."""
    if isa not in ISAS:
        raise ValueError(f"isa is one of {', '.join(k for k in ISAS if k)} or None, got {isa!r}")
    return ISAS[isa]


def has_avx512() -> bool:
    """True when the kernels are built and the CPU runs their AVX-512 forms."""
    return available() and bool(torch.ops.longattn_cpu.cpu_avx512())


def dense_attention_avx512(isa: str | None = None) -> bool:
    """True when the dense fused decode attention takes its AVX-512 loops under ``isa``."""
    return available() and bool(torch.ops.longattn_cpu.avx512_dense_attention(isa_code(isa)))
