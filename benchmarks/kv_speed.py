"""Decode speed of the server's KV pool formats: one stream decoding after a long prompt through
the serving engine, with the pool in float32 and in bfloat16, alternated in one run.

    python benchmarks/kv_speed.py --threads 2 [--model smollm2-135m] [--tokens 2048] [--new 64] [--rounds 5]

Each round serves, for each format in turn, one greedy request (a held-out book passage of
``--tokens`` tokens, ``--new`` tokens generated, no prefix reuse) on a fresh engine built on one
shared model, and takes the decode rate from the first to the last generated token. Reports
each format's median tokens/s and the ratio bf16 / f32. Writes benchmarks/results/kv_speed.json.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

from common import write_result
from weights_quality import passages

from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.prepared import prepared_model
from longattn.engine.sampling import SamplingConfig
from longattn.policy import AttentionPolicy
from longattn.cache.kv_format import KV_FORMATS
from longattn.serve.batching import Engine, EngineConfig, Request


def decode_rate(model, tok, policy, ids: list, new: int, kv: str, **config) -> float:
    """Tokens/s between the first and the last generated token of one request alone
    (``config``: more EngineConfig fields)."""
    engine = Engine(model, tok, policy, EngineConfig(kv=kv, retain=0, **config)).start()
    try:
        stamps, done = [], threading.Event()

        def emit(kind, _):  # text arrives as tokens are generated: (time, tokens so far)
            if kind == "text":
                stamps.append((time.perf_counter(), len(req.generated)))
            else:
                done.set()
        req = Request(prompt=ids, max_tokens=new, sampling=SamplingConfig(), ignore_eos=True, emit=emit)
        engine.submit(req)
        assert done.wait(3600) and req.finish_reason == "length", req.finish_reason
        (t0, n0), (t1, n1) = stamps[0], stamps[-1]
        return (n1 - n0) / (t1 - t0)
    finally:
        engine.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ck = load_checkpoint(args.model, progress=False)
    model = prepared_model(ck, "auto", progress=False)
    policy = AttentionPolicy.from_config(ck.config)
    texts = passages(ck.tokenizer, args.tokens, args.rounds)
    rates = {kv: [] for kv in KV_FORMATS}
    for r in range(args.rounds):
        ids = texts[r % len(texts)][1]
        for kv in (KV_FORMATS if r % 2 == 0 else list(KV_FORMATS)[::-1]):
            rates[kv].append(decode_rate(model, ck.tokenizer, policy, ids, args.new, kv))
            print(f"round {r} {kv:5s} {rates[kv][-1]:.1f} tok/s", flush=True)
    med = {kv: statistics.median(v) for kv, v in rates.items()}
    print(f"median: f32 {med['f32']:.1f} tok/s, bf16 {med['bf16']:.1f} tok/s, bf16/f32 {med['bf16'] / med['f32']:.3f}")
    print("wrote", write_result(args.out, {"model": args.model, "prompt_tokens": args.tokens, "new_tokens": args.new,
                                           "rounds": rates, "median_tok_s": med,
                                           "bf16_over_f32": med["bf16"] / med["f32"]}))


if __name__ == "__main__":
    main()
