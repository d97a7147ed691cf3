"""Stream >= 200,000 tokens of the bundled books through a real model in bounded memory.

    python benchmarks/stream_long.py --threads 2 [--tokens 200000] [--window 1024 --sinks 4] [--reindex]

Reports peak resident memory after the first 10,000 tokens and at the end (goal: within 5%),
early vs late throughput (goal: late >= 0.9x early), the throughput of the segment ending near
10K tokens against the last segment (flat from 10K to the end), bits/token per segment and cache
bytes. Writes benchmarks/results/stream_long.json (or --out). Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from longattn.cache.factory import make_cache  # noqa: E402
from longattn.checkpoint import load_checkpoint  # noqa: E402
from longattn.data import all_books_text  # noqa: E402
from longattn.models import build_model  # noqa: E402
from longattn.policy import AttentionPolicy  # noqa: E402
from longattn.stream import stream_score  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reindex", action="store_true",
                    help="positions within the cache (StreamingLLM style) instead of absolute")
    ap.add_argument("--segment", type=int, default=10_000, help="tokens per curve segment")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "stream_long.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ck = load_checkpoint(args.model)
    model = build_model(ck.config, ck.state_dict, torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    ids = ck.tokenizer(all_books_text())["input_ids"]
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = torch.tensor(ids[: args.tokens])
    pol = AttentionPolicy.build(ck.config, "window", window=args.window, sinks=args.sinks)
    cache = make_cache(ck.config, pol, kind="bounded", model=model, reindex=args.reindex)
    from tqdm import tqdm
    bar = tqdm(total=args.tokens, unit="tok", file=sys.stderr)
    res = stream_score(model, ids, pol, cache, chunk=args.chunk, early_tokens=10_000, curve_every=args.segment,
                       on_chunk=lambda n, r: (bar.update(n), bar.set_postfix(bpt=f"{r.bits_per_token:.3f}")))
    bar.close()
    d = res.to_dict()
    d.update(model=args.model, window=args.window, sinks=args.sinks, chunk=args.chunk, threads=args.threads,
             dtype=args.dtype, reindex=args.reindex, rss_growth=res.peak_rss_bytes / res.peak_rss_early - 1,
             late_over_early=res.late_tok_s / res.early_tok_s if res.early_tok_s else float("nan"))
    # Flat from 10K: the first segment (warm-up included) is left out; the segment ending at or
    # after 10K tokens is compared with the last one.
    segs = [(c[0], c[6]) for c in res.curve]
    at10k = next((r for t, r in segs[1:] if t >= 10_000), segs[-1][1])
    d.update(segment_tok_s_at_10k=at10k, segment_tok_s_last=segs[-1][1],
             last_over_10k=segs[-1][1] / at10k if at10k else float("nan"),
             segment_tok_s_median=sorted(r for _, r in segs[1:])[len(segs[1:]) // 2] if len(segs) > 1 else at10k)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(d, indent=1))
    print(f"{args.tokens} tokens: {res.bits_per_token:.4f} bits/token, cache {res.cache_bytes / 2**20:.2f} MiB, "
          f"peak RSS after 10K {res.peak_rss_early / 2**20:.0f} MiB -> end {res.peak_rss_bytes / 2**20:.0f} MiB "
          f"({100 * d['rss_growth']:+.2f}%), early {res.early_tok_s:.0f} tok/s -> late {res.late_tok_s:.0f} tok/s "
          f"({d['late_over_early']:.2f}x); segment at 10K {at10k:.0f} tok/s -> last {segs[-1][1]:.0f} tok/s "
          f"({d['last_over_10k']:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
