"""The quantized matmul kernel against the float32 GEMM on widened weights, at prefill and
decode row counts, on the bundled models' matrix shapes.

    python benchmarks/prefill_gemm.py --threads 2 [--rows 1 16 128 512] [--rounds 7]

Arms, alternated within each round, medians over rounds:
- ``kernel``: ``ops/csrc/quant_gemm.cpp`` on the stored int4 / int5 / int8 weights (activations
  rounded to int8 per block of 32, integer dots): what every row count runs;
- ``widened``: the weight widened to float32 block by block and PyTorch's float32 GEMM
  (``ops.linear.widened_linear``), what prefill-sized products ran before the kernel served them.

Random weights of each model's shapes (q/k/v fused, gate/up fused, down). Writes
benchmarks/results/prefill_gemm.json (or --out): per (shape, format, rows) both medians, their
ratio and the kernel's rate in GMAC/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import write_result

from longattn.models.weights import quantize_int4, quantize_int5, quantize_int8
from longattn.ops import linear, native

# (model, matrix, N, K): hidden sizes, heads and intermediate sizes of the bundled models
SHAPES = [
    ("smollm2-135m", "qkv", 960, 576), ("smollm2-135m", "gate_up", 3072, 576), ("smollm2-135m", "down", 576, 1536),
    ("gemma3-270m", "qkv", 1536, 640), ("gemma3-270m", "gate_up", 4096, 640), ("gemma3-270m", "down", 640, 2048),
    ("qwen2.5-0.5b", "qkv", 1152, 896), ("qwen2.5-0.5b", "gate_up", 9728, 896), ("qwen2.5-0.5b", "down", 896, 4864),
]


def arms(fmt: str, w: torch.Tensor):
    """(kernel(x), widened(x)) for ``w [N, K]`` stored as ``fmt``."""
    N = w.shape[0]
    if fmt == "int8":
        q, s = quantize_int8(w)
        return (lambda x: linear.int8_matmul(x, q, s, "avx2"),
                lambda x: linear.widened_linear(x, N, lambda i, j: linear.dequantize_int8(q[i:j], s[i:j])))
    if fmt == "int4":
        c, d, m = quantize_int4(w)
        return (lambda x: linear.int4_matmul(x, c, d, m, "avx2"),
                lambda x: linear.widened_linear(x, N, lambda i, j: linear.dequantize_int4(c[i:j], d[i:j], m[i:j])))
    c, h, d, m = quantize_int5(w)
    return (lambda x: linear.int5_matmul(x, c, h, d, m, "avx2"),
            lambda x: linear.widened_linear(x, N, lambda i, j: linear.dequantize_int5(c[i:j], h[i:j], d[i:j], m[i:j])))


def timed(f, x) -> float:
    t = time.perf_counter()
    f(x)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--formats", nargs="+", default=["int4", "int5", "int8"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_gemm.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("prefill_gemm: the native kernels are not built (make setup)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for model, name, N, K in SHAPES:
        w = torch.randn(N, K, generator=g)
        for fmt in args.formats:
            kernel, widened = arms(fmt, w)
            for M in args.rows:
                x = torch.randn(M, K, generator=g)
                kernel(x), widened(x)  # warm: pages touched, threads up
                tk, tw = [], []
                for r in range(args.rounds):  # alternated, the first arm swapping each round
                    for arm in ((kernel, tk), (widened, tw))[::1 if r % 2 == 0 else -1]:
                        arm[1].append(timed(arm[0], x))
                mk, mw = statistics.median(tk), statistics.median(tw)
                row = {"model": model, "matrix": name, "N": N, "K": K, "format": fmt, "rows": M,
                       "kernel_ms": mk * 1e3, "widened_ms": mw * 1e3, "speedup": mw / mk,
                       "kernel_gmacs": M * N * K / mk / 1e9}
                rows.append(row)
                print(f"{model:13s} {name:8s} {N:5d}x{K:<5d} {fmt} rows {M:4d}: kernel {mk * 1e3:8.3f} ms "
                      f"widened {mw * 1e3:8.3f} ms  {mw / mk:5.2f}x  ({row['kernel_gmacs']:.0f} GMAC/s)")
    write_result(args.out, {"threads": args.threads, "rounds": args.rounds, "results": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
