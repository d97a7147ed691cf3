"""What machine a measured figure came from (benchmarks record it beside every result).

Figures come from different kinds of CPU (AVX2 only, or AVX-512 with VNNI and AMX); speed
ratios against llama.cpp, whose build targets the CPU it was compiled on, are only comparable
on one kind.
"""

from __future__ import annotations

import os
import platform

# Instruction-set extensions that change which kernels are fastest (ours use AVX2 + FMA + F16C,
# and AVX-512 forms where the CPU has them).
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def cpu_description() -> dict:
    """``{"model": str, "flags": [str], "cpus": int}`` read from /proc/cpuinfo where it exists."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key:  # the first processor's block ends: the others repeat it
                    break
                if key == "model name":
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in FLAGS_OF_INTEREST if f in flags], "cpus": os.cpu_count()}
