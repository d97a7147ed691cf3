"""`longattn generate`: stream a continuation, then a one-line summary."""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import LongattnError
from ..host import peak_rss_bytes, process_age_seconds
from .common import (add_context_arg, add_json_arg, add_model_args, add_policy_args, check_chunk,
                     check_context, check_policy_args, check_text_arg, check_token_ids, emit_json,
                     model_for, open_checkpoint, policy_from_args, read_text_file, setup_threads)

DEFAULT_PROMPT = "The three most useful facts about the Moon are"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", default=None,
                     help="read the prompt from a UTF-8 text file (a regular file of at most 64 MiB)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (tokens)")
    p.add_argument("--compile", nargs="?", const="jit", choices=["auto", "aot", "jit", "none"], default="auto",
                   help="the decode step: aot decodes with the server's step built ahead of time and "
                        "cached (built there on first use: about a minute per model, format and machine; "
                        "any window and sinks); jit (the value when none is given) compiles a fixed-shape "
                        "step with torch.compile in this run; none decodes eagerly (the reference); auto "
                        "is aot where it can run (longattn's native kernels, window and dense layers) and "
                        "none elsewhere")
    p.add_argument("--kv", choices=["f32", "bf16", "int8"], default=None,
                   help="how the KV cache stores keys and values: bf16 (the compiled step's default: half "
                        "the bytes, measured within 0.004 bits/token of f32 on the bundled models), int8 "
                        "(codes with a scale per 32 values: 0.28x the bytes of f32) or f32 (the "
                        "reference, and the eager step's default); the torch.compile step stores f32 only")
    add_policy_args(p, auto=True)
    p.add_argument("--sparse-calibrate", action="store_true", default=argparse.SUPPRESS,
                   help="sparse: calibrate the taus in this run's first decode steps (run exactly) "
                        "instead of reusing the taus an earlier run on this model kept in the cache")
    add_context_arg(p)
    add_json_arg(p)
    p.add_argument("--token-trace", action="store_true",
                   help="with --json: each new token's id and its time since process start "
                        "(token_ids, token_times_s)")
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
    if args.policy == "auto" and getattr(args, "sparse_calibrate", False):
        raise LongattnError("--policy auto never calibrates (it engages SCSA only with taus kept by an "
                            "earlier run); calibrate with --policy sparse --sparse-calibrate")
    from ..ops import native
    pool_format = args.kv not in (None, "f32")  # a format the fixed-shape step does not store
    if pool_format and args.compile == "jit":
        raise LongattnError(f"--kv {args.kv}: the torch.compile step stores f32 (drop --kv, or use --compile "
                            "aot or none)")
    if args.compile == "aot":  # refused here, before anything is read or built
        if args.policy in ("sparse", "auto"):
            raise LongattnError("--compile aot runs window and dense layers only; use --compile for --policy "
                                f"{args.policy}")
        if not native.available():
            raise LongattnError("--compile aot calls longattn's native kernels, which are not built here "
                                "(or --reference is set); decode without it")
    if args.prompt_file:
        text = read_text_file(args.prompt_file, "prompt file")
    else:
        text = check_text_arg(args.prompt, "--prompt") if args.prompt is not None else DEFAULT_PROMPT
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
    chosen = args.compile == "auto"
    if args.compile == "auto":  # decided after the load, so bad input is refused before the kernels build
        args.compile = "aot" if args.policy not in ("sparse", "auto") and native.available() else "none"
    taus = SparseTaus(ck, model, policy, getattr(args, "sparse_calibrate", False))
    policy = taus.policy  # with the kept taus on its sparse layers, when there are any
    auto = None
    if args.policy == "auto":
        policy, auto = taus.resolve_auto(ck.config, len(ids), args.max_new_tokens)
        print(f"-- policy auto: {auto.reason}", file=sys.stderr, flush=True)
    load_s = time.perf_counter() - t_load
    kv = "f32"  # the fixed-shape step stores float32 keys and values; the eager one what --kv says
    if args.compile != "none":
        from ..engine.static_step import StaticDecoder
        max_len = len(ids) + max(args.max_new_tokens, 1)
        if args.compile == "aot":
            from ..engine.aot_step import AOTBuildError
            from ..engine.paged_step import PagedDecoder, unsupported
            from ..cache.kv_format import KV_FORMATS
            try:
                # the server's step (windows are its inputs); a model it cannot run (a rope that
                # follows the sequence length) takes the fixed-shape step built for its policy
                why = unsupported(model, policy)
                if why is not None and pool_format:
                    raise LongattnError(f"--kv {args.kv} needs the compiled paged step, which cannot run here: {why}")
                if why is None:
                    kv = args.kv or "bf16"
                    session = PagedDecoder(model, policy, max_len=max_len, kv_dtype=KV_FORMATS[kv])
                else:
                    session = StaticDecoder(model, policy, max_len=max_len, compile="aot")
            except AOTBuildError as e:
                if not chosen or pool_format:  # asked for by name: refused in one line
                    raise
                # the default: the same answer from the eager step, a little slower
                print(f"-- the ahead-of-time decode step could not be built ({e.reason}); decoding with "
                      "the eager step", file=sys.stderr, flush=True)
                args.compile, kv = "none", "f32"
                session = Session(model, policy)
        else:
            session = StaticDecoder(model, policy, max_len=max_len, compile=True)
            print("-- compiling the decode step ...", file=sys.stderr, flush=True)
            print(f"-- compiled in {session.warmup():.1f} s", file=sys.stderr)
    else:
        from ..cache.kv_format import KV_FORMATS
        kv = args.kv or "f32"
        session = Session(model, policy, kv_dtype=KV_FORMATS[kv])
    streamer = TextStreamer(ck.tokenizer)
    if not args.json:
        sys.stdout.write(text if not args.chat else "")
    token_times = []  # process age at the first token (at every token with --token-trace)

    def on_token(stream: int, token: int) -> None:
        if not token_times or args.token_trace:
            token_times.append(process_age_seconds())
        if not args.json:
            streamer(stream, token)
    res = generate(session, [ids], args.max_new_tokens, sampling, stop_ids=set(ck.config.eos_token_ids),
                   chunk=args.chunk, on_token=on_token)
    if not args.json:
        streamer.finish()
    taus.finish(session.cache)
    kernels = "native" if native.available() else "reference"
    n = res.new_tokens
    tps = n / res.decode_seconds if res.decode_seconds > 0 else float("nan")
    pps = res.prompt_tokens / res.prefill_seconds if res.prefill_seconds > 0 else float("nan")
    summary = {"model": ck.name, "prompt_tokens": res.prompt_tokens, "new_tokens": n,
               "prefill_tok_s": round(pps, 2), "decode_tok_s": round(tps, 2),
               "cache_bytes": res.cache_bytes, "threads": args.threads, "weights": model.weights,
               "kernels": kernels, "compiled": args.compile != "none",
               "kv": kv,
               "step": "eager" if args.compile == "none" else args.compile,
               "load_s": round(load_s, 3),
               "prefill_s": round(res.prefill_seconds, 3), "decode_s": round(res.decode_seconds, 3),
               "first_token_after_start_s": round(token_times[0], 2) if token_times else None,
               "peak_rss_bytes": peak_rss_bytes(), **taus.report(session.cache),
               **({"auto": auto.report()} if auto is not None else {}),
               **({"token_ids": res.tokens[0], "token_times_s": [round(t, 3) for t in token_times]}
                  if args.token_trace else {}),
               "text": ck.tokenizer.decode(res.tokens[0], skip_special_tokens=True)}
    print(f"-- {ck.name}: {res.prompt_tokens} prompt + {n} new tokens, prefill {pps:.1f} tok/s, "
          f"decode {tps:.1f} tok/s, cache {res.cache_bytes / 2**20:.2f} MiB{taus.summary(session.cache)}",
          file=sys.stderr if args.json else sys.stdout)
    if args.json:
        emit_json(summary)
    return 0


class SparseTaus:
    """A sparse run's taus: reused from the cache when an earlier run on this model kept them
    (decode is sparse from its first step), else calibrated in the first decode steps and kept
    for later runs once every sparse layer has chosen. ``report()`` and ``summary()`` say which,
    and where the sparse layers' time went. A no-op for other policies. ``resolve_auto`` turns
    the sparse policy of ``--policy auto`` into the run's policy."""

    def __init__(self, ck, model, policy, calibrate: bool):
        from ..sparse.policy import sparse_layers
        self.policy, self.source, self.path = policy, None, None
        if not sparse_layers(policy):
            return
        self.source = "calibrated in this run"
        if ck.weights_key is not None:
            from ..sparse.tau_cache import load_cached_taus, tau_cache_path
            self.path = tau_cache_path(ck.weights_key, model.weights, policy)
            kept = None if calibrate else load_cached_taus(self.path, policy, ck.config)
            if kept is not None:
                self.policy, self.source = kept, "reused from the cache"

    def resolve_auto(self, cfg, prompt_tokens: int, new_tokens: int):
        """(the run's policy, the AutoChoice): SCSA kept on the layers ``sparse.auto.choose``
        picks for this prompt and ``new_tokens``, the checkpoint's attention elsewhere. Only
        taus reused from the cache can be chosen, so an auto run never calibrates."""
        from ..sparse import auto
        from ..sparse.policy import policy_taus
        from ..sparse.tau_cache import cached_costs
        reused = self.source == "reused from the cache"
        choice = auto.choose(cfg, auto.candidate_layers(self.policy), prompt_tokens, new_tokens,
                             self.policy.sparse_config.min_context, policy_taus(self.policy) if reused else None,
                             cached_costs(self.path) if reused else None)
        chosen = auto.restrict(self.policy, choice.sparse_layers)  # keeps the chosen layers' taus
        if choice.sparse_layers:
            self.policy = chosen
        else:
            self.policy, self.source = chosen, None
        return chosen, choice

    def finish(self, cache) -> None:
        """After the run over ``cache``: keep newly calibrated taus for the next run."""
        if self.source == "calibrated in this run" and self.path is not None:
            from ..checkpoint.paths import CacheWriteError
            from ..sparse.tau_cache import store_taus
            try:
                if not store_taus(self.path, self.policy, cache):
                    self.source = "calibration unfinished (too few decode steps past min_context)"
            except CacheWriteError as e:  # the text is out already: the next run calibrates again
                self.source = f"calibrated in this run, not kept: {e}"

    def report(self, cache) -> dict:
        if self.source is None:
            return {}
        from ..sparse.policy import sparse_seconds
        secs = sparse_seconds(self.policy, cache)
        return {"sparse": {"taus": self.source, "index_in_prefill_s": round(secs["index_prefill"], 3),
                           "index_in_decode_s": round(secs["index_decode"], 3),
                           "calibration_s": round(secs["calibration"], 3)}}

    def summary(self, cache) -> str:
        if self.source is None:
            return ""
        s = self.report(cache)["sparse"]
        return (f"; sparse taus {s['taus']}, index {s['index_in_prefill_s']:.2f} s in prefill + "
                f"{s['index_in_decode_s']:.2f} s in decode, calibration {s['calibration_s']:.2f} s")
