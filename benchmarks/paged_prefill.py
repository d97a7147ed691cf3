"""A served prefill chunk's attention over the paged cache: its queries as rows of the fused
decode kernel (what the server runs, so a position gets the same bits prefilled or decoded)
against gathering the view and running SDPA / the masked matmul form (what ran before).

    python benchmarks/paged_prefill.py --threads 2 [--rounds 5]

One layer, B = 1, a chunk of ``--chunk`` queries after ``start`` cached positions, the bundled
models' head shapes, dense and window 1024 + 4 sinks. Arms alternated within each round,
medians over rounds:
- ``rows``: ``ops.attention.paged_rows_attention`` (the pool read in place, row by row);
- ``gather``: ``PagedRows.gather()`` then ``ops.attention.attend`` on the contiguous view.
Writes benchmarks/results/paged_prefill.json: per case both medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import write_result

from longattn.ops import native
from longattn.ops.attention import PagedRows, attend, paged_rows_attention

# (model, query heads, KV heads, head dim)
HEADS = [("smollm2-135m", 9, 3, 64), ("qwen2.5-0.5b", 14, 2, 64), ("gemma3-270m", 4, 1, 256)]


def case(H, Hkv, D, start, chunk, bs, g):
    """q, q_pos and the paged view (k, v, k_pos) of one stream holding ``start + chunk``
    positions in scattered blocks."""
    n = start + chunk
    nb = -(-n // bs)
    pool_k, pool_v = (torch.randn(1, Hkv, (nb + 8) * bs, D, generator=g) for _ in range(2))
    table = torch.randperm(nb + 8, generator=g)[:nb][None]
    k_pos = torch.arange(nb * bs)[None]
    k_pos = torch.where(k_pos < n, k_pos, -1)
    q = torch.randn(1, H, chunk, D, generator=g)
    return q, torch.arange(start, n)[None], PagedRows(pool_k, table, bs, n), PagedRows(pool_v, table, bs, n), k_pos


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--starts", type=int, nargs="+", default=[0, 2048, 8192])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "paged_prefill.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("paged_prefill: the native kernels are not built (make setup)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for model, H, Hkv, D in HEADS:
        for start in args.starts:
            q, q_pos, k, v, k_pos = case(H, Hkv, D, start, args.chunk, args.block_size, g)
            for window, sinks in ((None, 0), (1024, 4)):
                scale = D ** -0.5
                a = lambda: paged_rows_attention(q, q_pos, k, v, k_pos, window, sinks, scale)  # noqa: E731
                b = lambda: attend(q, q_pos, k.gather(), v.gather(), k_pos, window, sinks, scale, fused=False)  # noqa: E731
                err = (a() - b()).abs().max().item()  # warm, and the two agree to rounding
                ta, tb = [], []
                for r in range(args.rounds):
                    for f, t in ((a, ta), (b, tb))[::1 if r % 2 == 0 else -1]:
                        t.append(timed(f))
                ma, mb = statistics.median(ta), statistics.median(tb)
                row = {"model": model, "heads": H, "kv_heads": Hkv, "head_dim": D, "start": start,
                       "chunk": args.chunk, "window": window, "sinks": sinks, "rows_ms": ma * 1e3,
                       "gather_ms": mb * 1e3, "rows_vs_gather": ma / mb, "max_abs_diff": err}
                rows.append(row)
                print(f"{model:13s} start {start:5d} window {str(window):5s}: rows {ma * 1e3:8.2f} ms  "
                      f"gather {mb * 1e3:8.2f} ms  rows/gather {ma / mb:5.2f}  (diff {err:.1e})")
    write_result(args.out, {"threads": args.threads, "rounds": args.rounds, "block_size": args.block_size,
                            "results": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
