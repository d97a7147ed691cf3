"""Prefill attention time: banded O(T*W) vs fused causal SDPA vs masked SDPA vs FlexAttention.

One layer's attention over a whole prompt, B=1, fp32 on CPU, 8 heads of 128, W=1024 by
default. Arms, run interleaved (every arm once per round, several rounds) so that drift in a
shared machine's load hits all arms alike; medians are reported with ratios measured in the
same run against SDPA causal (``is_causal=True``, which reads T(T+1)/2 pairs and so is *not*
windowed -- it is the cost the window is meant to beat):

  banded        longattn.ops.banded.banded_attention (window W)
  sdpa_causal   F.scaled_dot_product_attention(is_causal=True)   -- full causal, reference cost
  sdpa_mask     SDPA with an explicit [T, T] window mask          -- skipped above --mask-gib
  flex          torch.nn.attention.flex_attention, compiled, sliding-window block mask

Each windowed arm's output is checked against banded's (max abs difference recorded).

    python benchmarks/prefill_attention.py --quick          # T = 1K..4K, 1 round (< 2 min)
    python benchmarks/prefill_attention.py                  # T = 1K..32K, 3 rounds (long)

Writes benchmarks/results/prefill_attention.json (``--quick``: prefill_attention_quick.json,
so a smoke run never overwrites the full result).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

# OpenMP threads that spin-wait (libgomp's default) stall badly when another process holds a
# core: banded makes one parallel region per block, and at T=2048 with 2 threads on a busy
# 2-core box it measured 0.6-0.9 s instead of 0.15-0.2 s (fused causal, one region: unchanged).
# Sleeping waiters make the comparison robust to a shared machine. Must be set before torch
# loads; an explicit OMP_WAIT_POLICY in the environment wins. Recorded in the JSON.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the OpenMP setting above)
import torch.nn.functional as F  # noqa: E402

from common import RESULTS, write_result  # noqa: E402
from longattn.lab.arithmetic import attention_pairs  # noqa: E402
from longattn.ops.banded import banded_attention, default_block_size, plan_blocks  # noqa: E402

FULL_SIZES = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SIZES = [1024, 2048, 4096]
ARMS = ["banded", "sdpa_causal", "sdpa_mask", "flex"]


def window_bool_mask(T: int, W: int) -> torch.Tensor:
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j <= i) & ((i - j) < W)  # [T, T]


def sdpa_mask_bytes(T: int) -> int:
    # the bool mask, plus the additive float32 copy SDPA makes of it on CPU
    return T * T * (1 + 4)


class FlexArm:
    """Compiled FlexAttention with a sliding-window block mask; records why if it cannot run."""

    def __init__(self, W: int):
        self.W = W
        self.error = None
        self.compile_s = {}
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            self._create = create_block_mask
            self._fn = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # pragma: no cover - depends on the torch build
            self.error = f"{type(e).__name__}: {e}"

    def prepare(self, q, k, v):
        """Build the block mask and compile (timed separately); returns a callable or None."""
        if self.error:
            return None
        W, T = self.W, q.shape[2]

        def sliding(b, h, qi, ki):
            return (ki <= qi) & (qi - ki < W)

        try:
            t0 = time.perf_counter()
            bm = self._create(sliding, None, None, T, T, device=str(q.device))
            fn = lambda: self._fn(q, k, v, block_mask=bm)  # noqa: E731
            fn()  # compiles on first call for this shape
            self.compile_s[T] = round(time.perf_counter() - t0, 2)
            return fn
        except Exception as e:
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return None


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (1 if args.quick else 3)
    W, H, D = args.window, args.heads, args.head_dim
    flex = FlexArm(W) if not args.no_flex else None
    rows = []
    for T in sizes:
        q = torch.randn(1, H, T, D)
        k = torch.randn(1, H, T, D)
        v = torch.randn(1, H, T, D)
        fns, skipped, outputs = {}, {}, {}
        fns["banded"] = lambda: banded_attention(q, k, v, W)
        fns["sdpa_causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        need = sdpa_mask_bytes(T)
        if need > args.mask_gib * 2**30:
            skipped["sdpa_mask"] = (f"window mask needs {need / 2**30:.1f} GiB (bool + float32 copy) "
                                    f"> --mask-gib {args.mask_gib}")
        else:
            mask = window_bool_mask(T, W)
            fns["sdpa_mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if flex is None:
            skipped["flex"] = "disabled with --no-flex"
        else:
            fn = flex.prepare(q, k, v)
            if fn is None:
                skipped["flex"] = flex.error
            else:
                fns["flex"] = fn
        for name, fn in fns.items():  # warm-up, and keep one output to compare
            outputs[name] = fn()
        times = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = med["sdpa_causal"]
        row = {
            "T": T,
            "pairs_causal": attention_pairs(T, None),
            "pairs_window": attention_pairs(T, W),
            "pair_ratio": attention_pairs(T, None) / attention_pairs(T, W),
            "block_size": default_block_size(W),
            # scores banded actually computes per head (band + masked block overlap)
            "pairs_banded_computed": sum(b.scores for b in plan_blocks(T, T, W)) if W < T else None,
            "median_s": {n: round(t, 5) for n, t in med.items()},
            "times_s": {n: [round(t, 5) for t in ts] for n, ts in times.items()},
            "speedup_vs_sdpa_causal": {n: round(base / t, 3) for n, t in med.items()},
            "max_abs_diff_vs_banded": {n: float((o - outputs["banded"]).abs().max())
                                       for n, o in outputs.items()
                                       if n not in ("banded", "sdpa_causal")},
            "skipped": skipped,
        }
        if flex is not None and T in flex.compile_s:
            row["flex_mask_and_compile_s"] = flex.compile_s[T]
        rows.append(row)
        print_row(row, first=(len(rows) == 1))
        del q, k, v, fns, outputs
    return {
        "benchmark": "prefill_attention",
        "config": {"window": W, "heads": H, "head_dim": D, "batch": 1, "dtype": "float32",
                   "threads": args.threads, "repeats": repeats, "quick": args.quick,
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                   "interleaved": True, "statistic": "median"},
        "machine": {"torch": torch.__version__, "python": platform.python_version(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "processor": platform.processor() or platform.machine()},
        "rows": rows,
    }


def print_row(row: dict, first: bool) -> None:
    if first:
        print(f"{'T':>6} {'pairs x':>7} | " + " | ".join(f"{a:>17}" for a in ARMS))
        print("-" * (17 + 20 * len(ARMS)))
    cells = []
    for a in ARMS:
        if a in row["median_s"]:
            cells.append(f"{row['median_s'][a] * 1e3:8.1f}ms x{row['speedup_vs_sdpa_causal'][a]:5.2f}")
        else:
            cells.append(f"{'skipped':>17}")
    print(f"{row['T']:>6} {row['pair_ratio']:>7.2f} | " + " | ".join(cells), flush=True)
    for a, why in row["skipped"].items():
        print(f"{'':>6}   {a} skipped: {why}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T = 1K..4K, 1 round")
    p.add_argument("--sizes", type=int, nargs="+", help="sequence lengths (overrides the defaults)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, help="interleaved rounds (default 3, quick 1)")
    p.add_argument("--mask-gib", type=float, default=6.0,
                   help="skip the explicit-mask SDPA arm when its mask would exceed this")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves compile time)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    result = run(args)
    out = args.out or (RESULTS /
                       ("prefill_attention_quick.json" if args.quick else "prefill_attention.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
