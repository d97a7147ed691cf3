"""One layer's decode attention over a static buffer: longattn's fused C++ kernel against the
matmul form (two batched matmuls and a masked softmax, the path inductor compiles otherwise),
both eager, on the bundled models' head shapes with a window-1,024 + 4-sink ring (1,029 slots)
and Gemma 3's 512-slot local ring.

Each arm reads a different buffer per call, cycling through 64 MiB of buffers (larger than
many CPUs' L3, so most reads come from memory as in a model's step). Where the CPU has
AVX-512, the fused kernel's two row loops run forced as two more arms (``fused-avx2``,
``fused-avx512``, same bits; ``fused`` is the automatic choice, AVX2 on AMD). Arms alternated in every
repeat; medians; JSON under benchmarks/results/.

    python benchmarks/decode_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


from longattn.ops import native
from longattn.ops.masks import allowed_mask
from longattn.ops.attention import attend_buffer_and_self

from common import RESULTS, write_result
# name -> (query heads, KV heads, slots, head dim, window, sinks)
SHAPES = {
    "smollm2-135m ring": (9, 3, 1029, 64, 1024, 4),
    "qwen2.5-0.5b ring": (14, 2, 1029, 64, 1024, 4),
    "gemma3-270m global ring": (4, 1, 1029, 256, 1024, 4),
    "gemma3-270m local": (4, 1, 513, 256, 512, 0),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=100, help="timed calls per arm and repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "decode_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        sys.exit("the native kernels are not built on this machine (no AVX2 or no compiler)")
    rows = []
    for name, (H, Hkv, S, D, window, sinks) in SHAPES.items():
        per_buf = 2 * Hkv * S * D * 4
        n_bufs = max(2, (64 << 20) // per_buf)  # 64 MiB in all, twice the L3
        g = torch.Generator().manual_seed(0)
        bufs = [(torch.randn(1, Hkv, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g))
                for _ in range(n_bufs)]
        q = torch.randn(1, H, 1, D, generator=g)
        k_new, v_new = torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
        k_pos = torch.arange(S)[None]
        q_pos = torch.full((1, 1), S)
        mask = allowed_mask(q_pos, k_pos, window, sinks)
        scale = D ** -0.5
        arms = {
            "fused": lambda k, v, isa=-1: torch.ops.longattn_cpu.decode_attention(
                q, k, v, k_pos, q_pos, k_new, v_new, window, sinks, scale, isa=isa),
            "matmul": lambda k, v: attend_buffer_and_self(q, k, v, mask, k_new, v_new, q_pos >= 0, scale),
        }
        if native.has_avx512():  # each of the fused kernel's row loops forced, as arms (same bits)
            fused = arms["fused"]
            arms["fused-avx2"] = lambda k, v: fused(k, v, native.isa_code("avx2"))
            arms["fused-avx512"] = lambda k, v: fused(k, v, native.isa_code("avx512"))
        times = {a: [] for a in arms}
        for r in range(args.repeats + 1):  # round 0 warms up
            for arm, f in arms.items():
                ts = []
                for i in range(args.calls):
                    k, v = bufs[i % n_bufs]
                    t0 = time.perf_counter()
                    f(k, v)
                    ts.append(time.perf_counter() - t0)
                if r:
                    times[arm] += ts
        med = {a: statistics.median(ts) for a, ts in times.items()}
        row = {"shape": name, "H": H, "Hkv": Hkv, "slots": S, "D": D, "buffer_bytes": per_buf,
               **{f"{a}_us": med[a] * 1e6 for a in arms},
               **{f"{a}_GB_s": per_buf / med[a] / 1e9 for a in arms},
               "fused_speedup": med["matmul"] / med["fused"]}
        rows.append(row)
        print(f"{name:<24} fused {row['fused_us']:6.0f} us ({row['fused_GB_s']:4.1f} GB/s)  "
              f"matmul {row['matmul_us']:6.0f} us ({row['matmul_GB_s']:4.1f} GB/s)  "
              f"fused {row['fused_speedup']:.1f}x"
              + (f"  (forced: AVX2 form {row['fused-avx2_us']:6.0f} us, AVX-512 form {row['fused-avx512_us']:6.0f} us)"
                 if "fused-avx2" in med else ""), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"threads": args.threads, "calls": args.calls, "repeats": args.repeats, "torch": torch.__version__,
           "fused_form": "avx512" if native.dense_attention_avx512() else "avx2", "rows": rows}
    write_result(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
