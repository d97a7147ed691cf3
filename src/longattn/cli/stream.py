"""`longattn stream`: score a long text as it streams through the model in bounded memory."""

from __future__ import annotations

import argparse
import sys

from ..errors import LongattnError
from .common import (add_context_arg, add_kv_arg, add_json_arg, add_model_args, add_policy_args, check_chunk,
                     check_context, check_policy_args, check_token_ids, emit_json, load_model,
                     model_for, open_checkpoint, policy_from_args, read_text_file, setup_threads)


def add_parser(sub) -> None:
    p = sub.add_parser("stream", help="score a long text streaming through the model (bits/token, memory)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    p.add_argument("--file", default=None,
                   help="UTF-8 text file to stream, a regular file of at most 64 MiB (default: every "
                        "bundled book, concatenated)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    p.add_argument("--repeat", type=int, default=1, help="repeat the text N times (long streams)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    p.add_argument("--reindex", action="store_true",
                   help="positions within the cache (StreamingLLM style) instead of absolute")
    p.add_argument("--cache", choices=["auto", "bounded", "growing"], default="auto",
                   help="auto: ring caches on windowed layers, growing elsewhere")
    add_kv_arg(p)
    add_policy_args(p)
    add_context_arg(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def tokenize_text(tok, text: str, max_tokens=None, repeat: int = 1):
    if repeat < 1:
        raise LongattnError("--repeat must be >= 1")
    base = tok(text)["input_ids"]
    if max_tokens is not None and max_tokens < 2:
        raise LongattnError("--max-tokens must be >= 2")
    n = len(base) * repeat if max_tokens is None else min(len(base) * repeat, max_tokens)
    reps = -(-n // len(base)) if base else 0  # only the repeats needed: --repeat may be huge
    import torch
    return torch.tensor((base * reps)[:n], dtype=torch.int64)


def stream_run(model, ids, policy, chunk: int = 256, cache_kind: str = "auto", reindex: bool = False,
               quiet: bool = False, desc: str = "stream", kv: str = "f32"):
    """Score ``ids [N]`` through ``model`` under ``policy`` in bounded memory, with a progress
    bar on stderr; returns lab.stream's StreamResult. ``kv``: the caches' storage format."""
    from tqdm import tqdm
    from ..cache.factory import make_cache
    from ..cache.kv_format import KV_FORMATS
    from ..lab.stream import stream_score
    cache = make_cache(model.config, policy, batch=1, kind=cache_kind, model=model, reindex=reindex,
                       dtype=KV_FORMATS[kv])
    bar = tqdm(total=int(ids.numel()), unit="tok", desc=desc, disable=quiet, file=sys.stderr,
               dynamic_ncols=True)

    def on_chunk(n, res):
        bar.update(n)
        bar.set_postfix(bpt=f"{res.bits_per_token:.3f}", cache=f"{res.max_cache_bytes / 2**20:.1f}MiB",
                        rss=f"{res.peak_rss_bytes / 2**20:.0f}MiB")
    res = stream_score(model, ids, policy, cache, chunk=chunk, on_chunk=on_chunk)
    bar.close()
    return res


def run(args) -> int:
    from ..data import all_books_text
    setup_threads(args.threads)
    check_chunk(args.chunk)
    check_policy_args(args)
    if args.repeat < 1:
        raise LongattnError("--repeat must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise LongattnError("--max-tokens must be >= 2")
    text = read_text_file(args.file, "--file") if args.file else all_books_text()
    ck = open_checkpoint(args)
    policy = policy_from_args(ck.config, args)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; stream needs one to read text")
    ids = tokenize_text(ck.tokenizer, text, args.max_tokens, args.repeat)
    if ids.numel() < 2:
        raise LongattnError("the text holds fewer than 2 tokens; nothing to score")
    check_token_ids(ck.config, ids.tolist())
    check_context(ck.config, policy, int(ids.numel()), args, f"the text ({ids.numel()} tokens)")
    model = model_for(ck, args)
    res = stream_run(model, ids, policy, args.chunk, args.cache, args.reindex, kv=args.kv)
    out = res.to_dict()
    out.update(model=ck.name, window=args.window, sinks=args.sinks, policy=args.policy,
               reindex=args.reindex, kv=args.kv, scored_positions="1..N-1", threads=args.threads)
    print(f"{ck.name}: {res.tokens} tokens, {res.bits_per_token:.4f} bits/token (positions 1..N-1), "
          f"{out['tok_s']:.1f} tok/s, cache {res.cache_bytes / 2**20:.2f} MiB "
          f"(max {res.max_cache_bytes / 2**20:.2f}), peak RSS {res.peak_rss_bytes / 2**20:.0f} MiB")
    if args.json:
        out.pop("curve")
        emit_json(out)
    return 0


def demo_compare(args) -> int:
    """Part 2 of `make demo`: the same book excerpt with window + sinks and with full attention."""
    from ..data import book_body
    from ..policy import AttentionPolicy
    ck, model = load_model(args, progress=True)
    ids = tokenize_text(ck.tokenizer, book_body(), args.stream_tokens)
    rows = []
    for label, pol in [(f"window {args.window} + {args.sinks} sinks",
                        AttentionPolicy.build(ck.config, "window", window=args.window, sinks=args.sinks)),
                       ("full attention", AttentionPolicy.build(ck.config, "checkpoint"))]:
        res = stream_run(model, ids, pol, desc=label)
        rows.append((label, res))
    print(f"\n== stream {len(ids)} tokens of Moby Dick through {ck.name}")
    print(f"{'policy':<24} {'bits/token':>10} {'tok/s':>8} {'cache MiB':>10}")
    for label, r in rows:
        print(f"{label:<24} {r.bits_per_token:>10.4f} {r.tokens / r.seconds:>8.1f} {r.cache_bytes / 2**20:>10.2f}")
    if getattr(args, "json", False):
        emit_json({"stream": [{"policy": l, "bits_per_token": r.bits_per_token,
                               "tok_s": r.tokens / r.seconds, "cache_bytes": r.cache_bytes} for l, r in rows]})
    return 0
