"""`longattn quality`: bits/token of windowed attention on book passages (window x sinks grid)."""

from __future__ import annotations

from .common import add_kv_arg, add_lab_parser, add_output_args, save_results, setup_threads
from .sweep_args import add_sweep_args, load_sweep_checkpoint, save_markdown, sweep_settings


def add_parser(sub) -> None:
    from ..lab.plots import int_list
    p = add_lab_parser(sub, "quality", help="bits/token vs window and sinks on book passages, with the full baseline",
                       description="Score the second half of N book passages of T tokens under a grid of "
                                   "imposed windows x sinks, beside the checkpoint's own attention, with "
                                   "bootstrap intervals over passages.")
    p.add_argument("--passages", type=int, default=16, help="number of book passages (1-2 for a smoke run)")
    p.add_argument("--length", type=int, default=1024, help="tokens per passage (the second half is scored)")
    p.add_argument("--windows", type=int_list, default="64,128,256,512", help="windows W, comma-separated")
    p.add_argument("--sinks", type=int_list, default="0,1,4", help="sink counts S, comma-separated")
    p.add_argument("--mode", choices=["auto", "window", "global"], default="auto",
                   help="window: W on every layer; global: W on a hybrid checkpoint's global layers only "
                        "(trained windows kept); auto: global for Gemma 3, window otherwise")
    p.add_argument("--reindex", action="store_true",
                   help="StreamingLLM position re-indexing (chunked through ring caches; moves only the sinks)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward through caches (--reindex, --kv)")
    add_kv_arg(p)
    add_sweep_args(p)
    add_output_args(p, "results/quality", run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug
    from ..lab.quality import markdown_rows, plot_quality, quality_cells, quality_result, resolve_mode
    from ..lab.sweep import run_sweep
    setup_threads(args.threads)
    sweep = sweep_settings(args)
    if args.passages < 1 or args.length < 4:
        raise LongattnError("need --passages >= 1 and --length >= 4")
    if args.chunk < 1:
        raise LongattnError("--chunk must be >= 1")
    if any(w < 1 for w in args.windows):
        raise LongattnError("--windows must be positive")
    out = out_dir(args.out)
    ck = load_sweep_checkpoint(args, "quality needs text passages")
    stem = f"quality_{slug(ck.name)}"
    cells = quality_cells(args.model, args.weights, ck.config, args.passages, args.length, args.windows, args.sinks,
                          args.mode, args.reindex, args.chunk, args.kv)
    recs = run_sweep([c for c, _, _ in cells], out / f"{stem}.cells.jsonl", desc="quality", **sweep)
    per = {}
    for (_, arm, i), rec in zip(cells, recs):
        per.setdefault(arm, [None] * args.passages)[i] = (rec["result"]["bits"], rec["result"]["count"])
    arms = [(w, s, per[(w, s)]) for w in args.windows for s in args.sinks]
    res = quality_result(ck.config, resolve_mode(ck.config, args.mode), args.reindex, [args.length], per[None], arms)
    res.update(model=ck.name, threads_per_cell=sweep["threads"], weights=args.weights, kv=args.kv,
               source="bundled books (longattn.data)")
    b = res["baseline"]
    head = (f"{ck.name}: {args.passages} passages x {args.length} tokens, bits/token on positions "
            f"{args.length // 2}..{args.length - 1}; mode {res['mode']}{', re-indexed' if args.reindex else ''}"
            f"{f', KV cache {args.kv}' if args.kv != 'f32' else ''}")
    print(head)
    rows = [[b["label"], "-", "-", b["bits_per_token"], b["ci"][0], b["ci"][1], 0.0, None, None]]
    kind = "window" if res["mode"] == "window" else "W on global layers"
    rows += [[kind, r["window"], r["sinks"], r["bits_per_token"], r["ci"][0], r["ci"][1], r["delta_bits"],
              r["delta_ci"][0], r["delta_ci"][1]] for r in res["rows"]]
    print(format_table(["policy", "window", "sinks", "bits/token", "lo", "hi", "delta", "lo", "hi"], rows))
    save_markdown(out, stem, f"Quality: {ck.name}", [head, res["intervals"]], markdown_rows(res))
    save_results(args, out, stem, res, lambda png: plot_quality(res, png))
    return 0
