"""Where a prefill's time goes: the quantized GEMMs, attention, and everything else.

    python benchmarks/prefill_split.py --threads 2 [--models qwen2.5-0.5b] [--prompts 4000 8000]

One ``Session.prefill`` of book text cut to each prompt length, default (``auto``) weights and
the checkpoint's attention, under ``torch.profiler`` after an untimed 256-token warm-up. Self
CPU time is grouped by operator: ``longattn_cpu::*_gemm`` (the quantized and float GEMMs),
attention (PyTorch's fused SDPA and longattn's banded and decode kernels), and the rest (norms,
rope, activations, copies). The profiler's own overhead inflates wall time at short prompts,
so read the shares, not the sums, there. Writes benchmarks/results/prefill_split.json.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from common import RESULTS, write_result

from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.prepared import prepared_model
from longattn.data import all_books_text
from longattn.engine import Session

ATTENTION = ("attention", "banded", "scaled_dot_product", "softmax", "bmm")


def group(op: str) -> str:
    """The share an operator's self time counts towards."""
    if op.startswith("longattn_cpu::") and op.endswith("_gemm"):
        return "gemm"
    return "attention" if any(s in op for s in ATTENTION) else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--prompts", nargs="+", type=int, default=[4000, 8000], help="prompt tokens")
    ap.add_argument("--out", default=str(RESULTS / "prefill_split.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = all_books_text()
    rows = []
    for name in args.models:
        ck = load_checkpoint(name)
        model = prepared_model(ck, "auto")
        ids = ck.tokenizer.encode(text)
        Session(model).prefill([ids[:256]])
        for T in args.prompts:
            t = time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                Session(model).prefill([ids[:T]])
            wall = time.perf_counter() - t
            shares = collections.Counter()
            for e in prof.key_averages():
                shares[group(e.key)] += e.self_cpu_time_total / 1e6
            total = sum(shares.values())
            row = {"model": name, "prompt_tokens": T, "wall_s": wall,
                   **{f"{g}_s": shares[g] for g in ("gemm", "attention", "other")},
                   **{f"{g}_share": shares[g] / total for g in ("gemm", "attention", "other")}}
            rows.append(row)
            print(f"{name:14s} T={T:6d}: wall {wall:7.2f} s  gemm {row['gemm_share']:5.1%}  "
                  f"attention {row['attention_share']:5.1%}  other {row['other_share']:5.1%}", flush=True)
    print("wrote", write_result(Path(args.out), {"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
