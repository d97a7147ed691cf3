"""longattn's own CPU kernels (``csrc/*.cpp``): built once with the machine's compiler, loaded,
or reported missing so callers fall back to PyTorch ops.

All sources build into one extension (torch.utils.cpp_extension + ninja, about half a minute;
see build.py for how a killed or stuck build is survived) in a directory named
``native-torch<version>-<hash of csrc/>``, so editing a source or header makes a new build and
a stale one never loads. ``make setup`` builds it at install time (``python -m
longattn.ops.native``) into the environment, ``<sys.prefix>/share/longattn/kernels/``, where
every cache of that environment finds it; an install without it builds it on first use under
``$LONGATTN_CACHE/kernels/``. The flags target AVX2, not the build machine, so an environment
copied to another AVX2 machine loads the same library.
Where it cannot be used (no AVX2, no compiler, or ``LONGATTN_NATIVE=off``) ``available()`` is
False and every caller has a PyTorch path (see linear.py, attention.py).

Ops (namespace ``longattn_cpu``): ``int8_gemm``, ``int4_gemm``, ``int5_gemm`` and the
dequantizers (csrc/quant_gemm.cpp), ``float_gemm`` (csrc/float_gemm.cpp),
``decode_attention`` (csrc/decode_attention.cpp) and ``scsa_decode`` (csrc/scsa_decode.cpp, the
sparse decode call of longattn.sparse; eager only, so it needs no fake). The build targets
AVX2; the AVX-512 functions are compiled for that target alone (``#pragma GCC target`` regions)
and run only where the CPU reports the features. The kernels that have both forms take an
``isa`` argument (``isa_code`` below); nothing about it is process-wide.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

from .build import BuildError, ExtensionSpec, ensure_built, library_path

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
                         announce="building native kernels (once per install, ~30 s)")


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


def _build_name() -> str:
    return f"native-torch{torch.__version__}-{_digest()}"


def installed_dir() -> Path:
    """Where the install step builds the kernels: inside the Python environment."""
    return Path(sys.prefix) / "share" / "longattn" / "kernels" / _build_name()


def library() -> Path:
    """The kernels' library: the one built at install time where it exists, else the cache's
    (built there now if missing).

    Raises:
        BuildError: the build failed or did not finish in time.
    """
    installed = library_path(kernel_spec(), installed_dir())
    if installed.exists():
        return installed
    from ..checkpoint.paths import cache_root
    return ensure_built(kernel_spec(), cache_root() / "kernels" / _build_name())


def _cpu_runs_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in AVX2_CAPABILITIES


def _build() -> bool:
    if _disabled() or not _cpu_runs_avx2():
        return False
    try:
        torch.ops.load_library(str(library()))
    except (BuildError, OSError) as e:  # no compiler, no ninja, out of time: PyTorch paths still work
        warnings.warn(f"the native CPU kernels are not available ({str(e).splitlines()[0]}); "
                      "using PyTorch ops", stacklevel=2)
        return False

    # shapes for torch.compile's tracing (the kernels run only on real tensors)
    @torch.library.register_fake("longattn_cpu::int8_gemm")
    def _(x, q, s, isa=-1):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("longattn_cpu::float_gemm")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("longattn_cpu::int4_gemm")
    def _(x, codes, d, m, isa=-1):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("longattn_cpu::int4_dequantize")
    def _(codes, d, m):
        return codes.new_empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)

    @torch.library.register_fake("longattn_cpu::int5_gemm")
    def _(x, codes, hbits, d, m, isa=-1):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("longattn_cpu::int5_dequantize")
    def _(codes, hbits, d, m):
        return codes.new_empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)

    @torch.library.register_fake("longattn_cpu::decode_attention")
    def _(q, k, v, k_pos, q_pos, k_new, v_new, window, sinks, scale, sink_logits=None, block_table=None,
          block_size=0, isa=-1, softcap=0.0, window_sinks=None):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("longattn_cpu::paged_store")
    def _(k_pool, v_pool, slots, k, v):
        return None
    return True


def available() -> bool:
    """True when the kernels are built and loaded (builds them on the first call)."""
    if "ok" not in _state:
        _state["ok"] = _build()
    return _state["ok"]


ISAS = {None: -1, "auto": -1, "avx2": 0, "avx512": 1}


def isa_code(isa: str | None = None) -> int:
    """The ``isa`` argument of the kernels with an AVX2 and an AVX-512 form (SCSA's opened-row
    phase, the dense fused decode attention's row loops, the int4 and int5 GEMMs): None or
    "auto" = -1 (each kernel's automatic choice), "avx2" = 0, "avx512" = 1 (the kernel raises
    RuntimeError on a CPU without AVX-512 F/BW/VL/DQ/VNNI). The int8 GEMM takes the argument and
    has one form, AVX2.

    Automatic: SCSA and the int4 and int5 GEMMs take their AVX-512 forms where the CPU has them;
    the dense attention too, except on AMD CPUs, whose 512-bit units split each operation in two,
    so the AVX2 loops are faster there. SCSA's and the dense attention's two forms give
    bit-identical outputs; the int4 and int5 GEMMs' differ in the last bits (other float lanes),
    both within the bound the tests derive. Within one process every call takes the same form,
    so a row's result never depends on the rows beside it. Forcing a form is for tests and
    benchmarks."""
    if isa not in ISAS:
        raise ValueError(f"isa is one of {', '.join(k for k in ISAS if k)} or None, got {isa!r}")
    return ISAS[isa]


def has_avx512() -> bool:
    """True when the kernels are built and the CPU runs their AVX-512 forms."""
    return available() and bool(torch.ops.longattn_cpu.cpu_avx512())


def dense_attention_avx512(isa: str | None = None) -> bool:
    """True when the dense fused decode attention takes its AVX-512 loops under ``isa``."""
    return available() and bool(torch.ops.longattn_cpu.avx512_dense_attention(isa_code(isa)))


def main() -> int:
    """``python -m longattn.ops.native``: build the kernels into the environment (installed_dir),
    the install step of ``make setup``. Exit 1, with one line, where they cannot be built (the
    PyTorch ops are used then)."""
    if not _cpu_runs_avx2():
        print("longattn: this CPU has no AVX2; the native kernels are not built (PyTorch ops are used)",
              file=sys.stderr)
        return 1
    try:
        so = ensure_built(kernel_spec(), installed_dir())
    except (BuildError, OSError) as e:
        print(f"longattn: the native kernels were not built ({str(e).splitlines()[0]}); "
              "PyTorch ops are used", file=sys.stderr)
        return 1
    print(f"longattn: native kernels in {so.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
