"""`longattn generate`: stream a continuation, then a one-line summary."""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import LongattnError
from ..host import peak_rss_bytes, process_age_seconds
from .common import (add_context_arg, add_json_arg, add_model_args, add_policy_args, check_chunk,
                     check_context, check_policy_args, check_token_ids, emit_json, model_for,
                     open_checkpoint, policy_from_args, read_text_file, setup_threads)

DEFAULT_PROMPT = "The three most useful facts about the Moon are"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (tokens)")
    p.add_argument("--compile", action="store_true",
                   help="decode with the fixed-shape step compiled by torch.compile (first step compiles)")
    add_policy_args(p)
    add_context_arg(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def encode_prompt(tok, text: str, chat: bool) -> list:
    if chat:
        if not getattr(tok, "chat_template", None):
            raise LongattnError("this checkpoint has no chat template; drop --chat")
        from ..chat import chat_ids
        return chat_ids(tok, [{"role": "user", "content": text}])
    return list(tok(text)["input_ids"])


class TextStreamer:
    """Prints decoded text as tokens arrive, holding back incomplete UTF-8 / merges."""

    def __init__(self, tok, out=None):
        self.tok, self.out, self.ids, self.printed = tok, out or sys.stdout, [], 0

    def __call__(self, stream: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def finish(self) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def run(args) -> int:
    from ..engine.sampling import SamplingConfig
    from ..engine.session import Session, generate
    setup_threads(args.threads)
    if args.max_new_tokens < 0:
        raise LongattnError("--max-new-tokens must be >= 0")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    check_chunk(args.chunk)
    check_policy_args(args)
    if args.prompt_file:
        text = read_text_file(args.prompt_file, "prompt file")
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    t_load = time.perf_counter()
    ck = open_checkpoint(args)
    policy = policy_from_args(ck.config, args)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; generate needs one to read the prompt")
    ids = encode_prompt(ck.tokenizer, text, args.chat)
    if not ids:
        raise LongattnError("the prompt is empty; give some text")
    check_token_ids(ck.config, ids)
    check_context(ck.config, policy, len(ids) + args.max_new_tokens, args,
                  f"the prompt ({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens}")
    model = model_for(ck, args)
    load_s = time.perf_counter() - t_load
    if args.compile:
        from ..engine.static_step import StaticDecoder
        session = StaticDecoder(model, policy, max_len=len(ids) + max(args.max_new_tokens, 1), compile=True)
        print("-- compiling the decode step ...", file=sys.stderr, flush=True)
        print(f"-- compiled in {session.warmup():.1f} s", file=sys.stderr)
    else:
        session = Session(model, policy)
    streamer = TextStreamer(ck.tokenizer)
    if not args.json:
        sys.stdout.write(text if not args.chat else "")
    first_token = []

    def on_token(stream: int, token: int) -> None:
        if not first_token:
            first_token.append(process_age_seconds())
        if not args.json:
            streamer(stream, token)
    res = generate(session, [ids], args.max_new_tokens, sampling, stop_ids=set(ck.config.eos_token_ids),
                   chunk=args.chunk, on_token=on_token)
    if not args.json:
        streamer.finish()
    n = res.new_tokens
    tps = n / res.decode_seconds if res.decode_seconds > 0 else float("nan")
    pps = res.prompt_tokens / res.prefill_seconds if res.prefill_seconds > 0 else float("nan")
    summary = {"model": ck.name, "prompt_tokens": res.prompt_tokens, "new_tokens": n,
               "prefill_tok_s": round(pps, 2), "decode_tok_s": round(tps, 2),
               "cache_bytes": res.cache_bytes, "threads": args.threads, "weights": model.weights,
               "compiled": bool(args.compile), "load_s": round(load_s, 3),
               "prefill_s": round(res.prefill_seconds, 3), "decode_s": round(res.decode_seconds, 3),
               "first_token_after_start_s": round(first_token[0], 2) if first_token else None,
               "peak_rss_bytes": peak_rss_bytes(),
               "text": ck.tokenizer.decode(res.tokens[0], skip_special_tokens=True)}
    print(f"-- {ck.name}: {res.prompt_tokens} prompt + {n} new tokens, prefill {pps:.1f} tok/s, "
          f"decode {tps:.1f} tok/s, cache {res.cache_bytes / 2**20:.2f} MiB", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        emit_json(summary)
    return 0
