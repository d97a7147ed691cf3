"""`longattn retrieval`: passkey / RULER-style accuracy vs needle distance, full vs window vs sinks."""

from __future__ import annotations

from .common import add_lab_parser, add_output_args, load_text_model, progress_ticker, save_results, setup_threads


def add_parser(sub) -> None:
    from ..lab.plots import int_list, str_list
    from ..lab.tasks import TASKS
    p = add_lab_parser(sub, "retrieval", help="passkey / RULER niah / vt accuracy vs needle distance",
                       description="Greedy retrieval accuracy with the needle a controlled number of tokens "
                                   "before the end of the prompt, under the checkpoint's attention, a window, "
                                   "and a window + sinks. Book text stands in for RULER's essay haystack. "
                                   f"Tasks: {', '.join(TASKS)}.")
    p.add_argument("--tasks", type=str_list, default="passkey", help="tasks, comma-separated")
    p.add_argument("--distances", type=int_list, default="64,192,448",
                   help="needle distances from the end of the prompt (tokens), comma-separated")
    p.add_argument("--length", type=int, default=512, help="prompt tokens at most")
    p.add_argument("--samples", type=int, default=2, help="prompts per task and distance")
    p.add_argument("--seed", type=int, default=42, help="base seed (sample i uses seed + i)")
    p.add_argument("--window", type=int, default=128, help="imposed window W")
    p.add_argument("--sinks", type=int, default=4, help="sinks for the window + sinks policy (0 = skip it)")
    p.add_argument("--mode", choices=["auto", "window", "global"], default="auto",
                   help="window: W on every layer; global: W on a hybrid checkpoint's global layers; "
                        "auto: global for Gemma 3, window otherwise")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: the task's published count: passkey 10, niah 128, vt 30)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (tokens)")
    add_output_args(p, "results/retrieval", run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug
    from ..lab.retrieval import plot_retrieval, retrieval_policies, retrieval_sweep
    from ..lab.tasks import TASKS
    setup_threads(args.threads)
    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        raise LongattnError(f"unknown task(s) {', '.join(bad)}; known: {', '.join(TASKS)}")
    if args.window < 1 or args.sinks < 0 or args.samples < 1 or args.length < 2:
        raise LongattnError("need --window >= 1, --sinks >= 0, --samples >= 1 and --length >= 2")
    if any(d < 1 or d > args.length for d in args.distances):
        raise LongattnError(f"--distances must lie in 1..--length ({args.length})")
    out = out_dir(args.out)
    ck, model, encode = load_text_model(args, "retrieval needs text prompts")
    tok = ck.tokenizer
    policies = retrieval_policies(ck.config, args.window, args.sinks, args.mode)
    bar, tick = progress_ticker(len(args.tasks) * len(args.distances) * args.samples * len(policies), "retrieval",
                                unit="prompt")
    res = retrieval_sweep(model, encode, lambda ids: tok.decode(ids, skip_special_tokens=True),
                          args.tasks, args.distances, policies, args.samples, args.length, args.seed,
                          args.max_new_tokens, set(ck.config.eos_token_ids), args.chunk, progress=tick)
    bar.close()
    res.update(model=ck.name, threads=args.threads, window=args.window, sinks=args.sinks)
    print(f"{ck.name}: prompts <= {args.length} tokens, {args.samples} samples per point, greedy; "
          f"distance = tokens from the needle to the prompt end; {res['haystack']}")
    print(format_table(["task", "policy", "distance", "measured", "score %"],
                       [[r["task"], r["policy"], r["distance"], round(r["mean_needle_distance"]), r["score"]]
                        for r in res["rows"]], floatfmt=".1f"))
    save_results(args, out, f"retrieval_{slug(ck.name)}", res, lambda png: plot_retrieval(res, png),
                 summary=lambda: {k: v for k, v in res.items() if k != "records"})
    return 0
