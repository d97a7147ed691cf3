"""Cache memory of transformers' generate on SmolLM2-135M: longattn.hf SinkCache against
transformers' default DynamicCache, sampled as the output grows.

Both arms generate greedily (no stop token) from the same prompt, the SinkCache arm first;
a stopping criterion records the cache's K/V bytes after every --every steps, and the
process's resident memory. The SinkCache's bytes stay at ``(sinks + window)`` slots a layer;
the default cache grows by one slot a layer per token, and its attention with it, so its arm
may be cut shorter (``--dynamic-tokens``): the growth is linear from the first samples on.
The JSON is written after each arm, so a stopped run keeps the finished one.

    python benchmarks/hf_cache_memory.py --tokens 20000 --dynamic-tokens 8000 --threads 2
    python benchmarks/hf_cache_memory.py --tokens 64 --every 16         # smoke

Writes benchmarks/results/hf_cache_memory.json (and .png with matplotlib). Never run it
beside tests or builds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import longattn.hf
from common import RESULTS, write_result
from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.oracle import oracle_model
from longattn.lab.stream import resident_bytes



def dynamic_cache_bytes(cache) -> int:
    """K/V bytes a transformers DynamicCache holds."""
    return sum(l.keys.nbytes + l.values.nbytes for l in cache.layers if getattr(l, "keys", None) is not None)


class Recorder:
    """Stopping criterion that never stops: samples (tokens, cache bytes, rss, seconds)."""

    def __init__(self, nbytes, every: int):
        self.nbytes, self.every, self.steps, self.rows, self.t0 = nbytes, every, 0, [], time.perf_counter()

    def __call__(self, input_ids, scores, **kw):
        self.steps += 1
        if self.steps % self.every == 0:
            self.rows.append((int(input_ids.shape[1]), self.nbytes(), resident_bytes(),
                              time.perf_counter() - self.t0))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_arm(model, ids, tokens: int, every: int, cache, nbytes) -> list:
    from transformers import StoppingCriteriaList
    rec = Recorder(nbytes, every)
    model.generate(ids, past_key_values=cache, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([rec]))
    return rec.rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=20000, help="tokens the SinkCache arm generates")
    p.add_argument("--dynamic-tokens", type=int, default=None,
                   help="tokens the default-cache arm generates (default: --tokens)")
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "hf_cache_memory.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache
    tok = load_checkpoint("smollm2-135m", progress=False).tokenizer
    model = oracle_model("smollm2-135m")
    ids = torch.tensor([tok("Call me Ishmael. Some years ago")["input_ids"]])
    dyn_tokens = args.tokens if args.dynamic_tokens is None else args.dynamic_tokens
    out = {"model": "smollm2-135m", "tokens": args.tokens, "dynamic_tokens": dyn_tokens, "window": args.window, "sinks": args.sinks,
           "threads": args.threads, "columns": ["tokens", "cache_bytes", "rss_bytes", "seconds"]}
    sink = longattn.hf.apply(model, window=args.window, sinks=args.sinks)
    rows_sink = run_arm(model, ids, args.tokens, args.every, sink, sink.nbytes)
    longattn.hf.detach(model)
    out.update(sink_cache=rows_sink, sink_bytes_constant=len({r[1] for r in rows_sink}) <= 1)
    write_result(args.out, out)
    default = DynamicCache(config=model.config)
    rows_default = run_arm(model, ids, dyn_tokens, args.every, default, lambda: dynamic_cache_bytes(default))
    out.update(dynamic_cache=rows_default)
    write_result(args.out, out)
    for name, rows in (("SinkCache", rows_sink), ("DynamicCache", rows_default)):
        last = rows[-1] if rows else (0, 0, 0, 0.0)
        print(f"{name:<13} {last[0]:>7} tokens  cache {last[1] / 2**20:8.2f} MiB  rss {last[2] / 2**20:7.0f} MiB  "
              f"{last[3]:7.1f} s")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, rows in (("longattn.hf SinkCache", rows_sink), ("transformers DynamicCache", rows_default)):
            ax.plot([r[0] for r in rows], [r[1] / 2**20 for r in rows], label=name)
        ax.set_xlabel("tokens"), ax.set_ylabel("K/V cache MiB"), ax.legend()
        ax.set_title(f"SmolLM2-135M generate: window {args.window} + {args.sinks} sinks")
        fig.tight_layout()
        fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
