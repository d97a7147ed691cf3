"""Decode and prefill speed: longattn vs transformers (and llama.cpp when installed).

Same weights, same thread count, arms alternated in one run, medians of repeats, ratios.
Prompts of 128 and 2,048 tokens from a bundled book; decode = greedy steps after prefill.

    python benchmarks/decode_speed.py --threads 2 [--models smollm2-135m ...] [--quick]

Writes benchmarks/results/decode_speed.json. Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from longattn.checkpoint import load_checkpoint  # noqa: E402
from longattn.checkpoint.oracle import oracle_model  # noqa: E402
from longattn.data import book_body  # noqa: E402
from longattn.models import build_model  # noqa: E402
from longattn.session import Session  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BANDWIDTH = 12.6e9  # measured memory read bandwidth of this machine (DESIGN.md)


def time_longattn(model, ids, steps):
    s = Session(model)
    t0 = time.perf_counter()
    logits = s.prefill([ids], chunk=0)[:, 0]
    t1 = time.perf_counter()
    tok = logits.argmax(-1)
    for _ in range(steps):
        tok = s.step(tok).argmax(-1)
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / steps, s.cache.nbytes()


@torch.inference_mode()
def time_hf(hf, ids, steps):
    from transformers import DynamicCache
    x = torch.tensor([ids])
    cache = DynamicCache(config=hf.config)
    t0 = time.perf_counter()
    out = hf(x, past_key_values=cache, use_cache=True)
    t1 = time.perf_counter()
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        out = hf(tok, past_key_values=out.past_key_values, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / steps


def time_llamacpp(llm, ids, steps):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    for _ in range(steps):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / steps


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (embedding row aside; the head reads it all)."""
    n = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and model.lm_head is not None:
            continue  # untied: the embedding is a row lookup
        n += p.numel() * p.element_size()
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 2048])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smollm2 only, 128 tokens, 1 repeat, 8 steps")
    ap.add_argument("--out", default=str(RESULTS / "decode_speed.json"))
    args = ap.parse_args()
    if args.quick:
        args.models, args.prompts, args.repeats, args.steps = ["smollm2-135m"], [128], 1, 8
    torch.set_num_threads(args.threads)
    text = book_body()
    try:
        import llama_cpp  # noqa: F401
        have_llamacpp = True
    except ImportError:
        have_llamacpp = False
    rows = []
    for name in args.models:
        ck = load_checkpoint(name, progress=True)
        arms = {"longattn-f32": build_model(ck.config, ck.state_dict, torch.float32),
                "longattn-bf16": build_model(ck.config, ck.state_dict, torch.bfloat16)}
        hf = oracle_model(name)
        llm = None
        if have_llamacpp:
            import llama_cpp
            llm = llama_cpp.Llama(str(ck.source), n_threads=args.threads, n_ctx=4096, verbose=False)
        all_ids = ck.tokenizer(text)["input_ids"]
        for T in args.prompts:
            ids = all_ids[:T]
            samples = {k: [] for k in list(arms) + ["transformers-f32"] + (["llama.cpp"] if llm else [])}
            cache_bytes = {}
            for r in range(args.repeats + 1):  # the first round warms up and is dropped
                for arm, m in arms.items():
                    p, d, cb = time_longattn(m, ids, args.steps)
                    cache_bytes[arm] = cb
                    if r:
                        samples[arm].append((p, d))
                p, d = time_hf(hf, ids, args.steps)
                if r:
                    samples["transformers-f32"].append((p, d))
                if llm:
                    p, d = time_llamacpp(llm, ids, args.steps)
                    if r:
                        samples["llama.cpp"].append((p, d))
            med = {k: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
                   for k, v in samples.items()}
            hf_p, hf_d = med["transformers-f32"]
            for arm, (p, d) in med.items():
                row = {"model": name, "prompt": T, "arm": arm, "prefill_tok_s": T / p, "decode_tok_s": 1 / d,
                       "decode_vs_transformers": hf_d / d, "prefill_vs_transformers": hf_p / p}
                if arm in arms:
                    wb = weight_bytes(arms[arm])
                    kv = cache_bytes[arm] // 2  # average cache read over the decode (half filled on avg) is
                    # close to the prompt's cache; use the allocated bytes as an upper bound
                    row["bytes_per_token"] = wb + cache_bytes[arm]
                    row["bandwidth_limit_tok_s"] = BANDWIDTH / (wb + cache_bytes[arm])
                    row["fraction_of_bandwidth_limit"] = (1 / d) / row["bandwidth_limit_tok_s"]
                rows.append(row)
                print(f"{name:<14} T={T:<5} {arm:<18} prefill {T / p:8.1f} tok/s ({hf_p / p:5.2f}x)  "
                      f"decode {1 / d:7.2f} tok/s ({hf_d / d:5.2f}x vs transformers)", flush=True)
        del hf, arms, llm
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "threads": args.threads, "steps": args.steps, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
