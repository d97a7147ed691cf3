"""Quality cost of the KV pool formats: bits/token with keys and values stored as bfloat16 or
int8 (q8: a float32 scale per 32 values) against float32, through the paged cache the server and
``generate`` run.

    python benchmarks/kv_quality.py --threads 2 [--models ...] [--tokens 2048] [--passages 3]

For every model (default weights, ``auto``), passage and policy (the checkpoint's attention,
and window 256 + 4 sinks on every layer): the passage is prefilled in chunks of 256 through a
``PagedKVCache`` whose pool stores ``f32``, ``bf16`` or ``int8``, and bits/token of next-token
prediction is taken over positions 1..N-1. Passages as in weights_quality.py (one per bundled
book, from 20% into its body). Writes benchmarks/results/kv_quality.json (or --out): per model
and policy every format's bits/token and its difference from f32. Quality only: nothing is timed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import write_result
from weights_quality import passages

from longattn.cache.paged import BlockPool, PagedKVCache, PagedStream
from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.prepared import prepared_model
from longattn.engine.session import Session
from longattn.lab.stream import nll_bits
from longattn.policy import AttentionPolicy
from longattn.cache.kv_format import KV_FORMATS


def bits(model, policy, ids: list, kv: str, chunk: int = 256, block_size: int = 16) -> float:
    cfg = model.config
    need = cfg.num_layers * (-(-len(ids) // block_size) + 1)
    pool = BlockPool(need, block_size, cfg.num_kv_heads, cfg.head_dim, KV_FORMATS[kv])
    session = Session(model, policy, PagedKVCache(cfg, pool, [PagedStream.for_policy(policy)]))
    logits = session.prefill([ids], chunk=chunk, logits="all")[0]        # [N, V]
    x = torch.tensor(ids)
    return nll_bits(logits[:-1], x[1:]).mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--passages", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_quality.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        ck = load_checkpoint(name, progress=False)
        model = prepared_model(ck, "auto", progress=False)
        texts = passages(ck.tokenizer, args.tokens, args.passages)
        for pname, policy in (("checkpoint", AttentionPolicy.from_config(ck.config)),
                              ("window 256 + 4 sinks", AttentionPolicy.build(ck.config, "window", window=256, sinks=4))):
            per = {kv: [bits(model, policy, ids, kv) for _, ids in texts] for kv in KV_FORMATS}
            mean = {kv: sum(v) / len(v) for kv, v in per.items()}
            row = {"model": name, "policy": pname, "tokens": args.tokens, "passages": [p for p, _ in texts],
                   **mean, **{f"{kv}_minus_f32": mean[kv] - mean["f32"] for kv in KV_FORMATS if kv != "f32"},
                   "per_passage": per}
            rows.append(row)
            print(f"{name:13s} {pname:22s} f32 {mean['f32']:.4f}  " + "  ".join(
                f"{kv} {mean[kv]:.4f} ({mean[kv] - mean['f32']:+.4f})" for kv in KV_FORMATS if kv != "f32"), flush=True)
    write_result(args.out, {"threads": args.threads, "results": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
