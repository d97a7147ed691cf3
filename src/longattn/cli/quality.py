"""`longattn quality`: bits/token of windowed attention on book passages (window x sinks grid)."""

from __future__ import annotations

from .common import add_lab_parser, add_output_args, load_text_model, progress_ticker, save_results, setup_threads


def add_parser(sub) -> None:
    from ..lab.plots import int_list
    p = add_lab_parser(sub, "quality", help="bits/token vs window and sinks on book passages, with the full baseline",
                       description="Score the second half of N book passages of T tokens under a grid of "
                                   "imposed windows x sinks, beside the checkpoint's own attention.")
    p.add_argument("--passages", type=int, default=2, help="number of book passages")
    p.add_argument("--length", type=int, default=1024, help="tokens per passage (the second half is scored)")
    p.add_argument("--windows", type=int_list, default="64,128,256,512", help="windows W, comma-separated")
    p.add_argument("--sinks", type=int_list, default="0,1,4", help="sink counts S, comma-separated")
    p.add_argument("--mode", choices=["auto", "window", "global"], default="auto",
                   help="window: W on every layer; global: W on a hybrid checkpoint's global layers only "
                        "(trained windows kept); auto: global for Gemma 3, window otherwise")
    p.add_argument("--reindex", action="store_true",
                   help="StreamingLLM position re-indexing (chunked through ring caches; moves only the sinks)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward on the --reindex path")
    add_output_args(p, "results/quality", run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug
    from ..lab.quality import plot_quality, quality_sweep
    from ..lab.tasks import book_passages
    setup_threads(args.threads)
    if args.passages < 1 or args.length < 4:
        raise LongattnError("need --passages >= 1 and --length >= 4")
    if args.chunk < 1:
        raise LongattnError("--chunk must be >= 1")
    if any(w < 1 for w in args.windows):
        raise LongattnError("--windows must be positive")
    out = out_dir(args.out)
    ck, model, encode = load_text_model(args, "quality needs text passages")
    passages = book_passages(encode, args.passages, args.length)
    total = args.passages * (1 + len(args.windows) * len(args.sinks))
    bar, tick = progress_ticker(total, "quality", unit="fwd")
    res = quality_sweep(model, passages, args.windows, args.sinks, mode=args.mode, reindex=args.reindex,
                        chunk=args.chunk, progress=tick)
    bar.close()
    res.update(model=ck.name, threads=args.threads, weights=args.weights, source="bundled books (longattn.data)")
    b = res["baseline"]
    print(f"{ck.name}: {args.passages} passages x {args.length} tokens, bits/token on positions "
          f"{args.length // 2}..{args.length - 1}; mode {res['mode']}{', re-indexed' if args.reindex else ''}")
    rows = [[b["label"], "-", "-", b["bits_per_token"], 0.0]]
    kind = "window" if res["mode"] == "window" else "W on global layers"
    rows += [[kind, r["window"], r["sinks"], r["bits_per_token"], r["delta_bits"]] for r in res["rows"]]
    print(format_table(["policy", "window", "sinks", "bits/token", "delta"], rows))
    save_results(args, out, f"quality_{slug(ck.name)}", res, lambda png: plot_quality(res, png))
    return 0
