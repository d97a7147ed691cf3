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


def process_age_seconds() -> float:
    """Seconds since this process started (from /proc, 10 ms resolution; NaN where unknown):
    wall time from process start, as a user waiting at the prompt counts it."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (0 where unknown)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return 0
