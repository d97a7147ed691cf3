"""`longattn retrieval`: passkey / RULER-style accuracy vs needle distance, full vs window vs sinks."""

from __future__ import annotations

from .common import add_kv_arg, add_lab_parser, add_output_args, save_results, setup_threads
from .sweep_args import add_sweep_args, load_sweep_checkpoint, save_markdown, sweep_settings


def add_parser(sub) -> None:
    from ..lab.plots import int_list, str_list
    from ..lab.tasks import TASKS
    p = add_lab_parser(sub, "retrieval", help="passkey / RULER niah / vt accuracy vs needle distance",
                       description="Greedy retrieval accuracy with the needle a controlled number of tokens "
                                   "before the end of the prompt, under the checkpoint's attention, a window, "
                                   "and a window + sinks, with 95% intervals. Book text stands in for RULER's "
                                   f"essay haystack. Tasks: {', '.join(TASKS)}.")
    p.add_argument("--tasks", type=str_list, default="passkey", help="tasks, comma-separated")
    p.add_argument("--distances", type=int_list, default="64,192,448",
                   help="needle distances from the end of the prompt (tokens), comma-separated")
    p.add_argument("--length", type=int, default=512, help="prompt tokens at most")
    p.add_argument("--samples", type=int, default=50,
                   help="prompts per task and distance (the same prompts under every policy); 1-2 for a smoke run")
    p.add_argument("--seed", type=int, default=42, help="base seed (sample i uses seed + i)")
    p.add_argument("--window", type=int, default=128, help="imposed window W")
    p.add_argument("--sinks", type=int, default=4, help="sinks for the window + sinks policy (0 = skip it)")
    p.add_argument("--scsa", action="store_true",
                   help="add SCSA (default settings) on the checkpoint's global layers as a policy")
    p.add_argument("--mode", choices=["auto", "window", "global"], default="auto",
                   help="window: W on every layer; global: W on a hybrid checkpoint's global layers; "
                        "auto: global for Gemma 3, window otherwise")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: the task's published count: passkey 10, niah 128, vt 30)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (tokens)")
    add_kv_arg(p)
    add_sweep_args(p)
    add_output_args(p, "results/retrieval", run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug
    from ..lab.retrieval import (check_settings, markdown_rows, plot_retrieval, retrieval_cells,
                                 retrieval_policy_specs, retrieval_result)
    from ..lab.sweep import build_policy, run_sweep
    setup_threads(args.threads)
    sweep = sweep_settings(args)
    check_settings(args.tasks, args.samples, args.max_new_tokens)
    if args.window < 1 or args.sinks < 0 or args.length < 2 or args.chunk < 1:
        raise LongattnError("need --window >= 1, --sinks >= 0, --length >= 2 and --chunk >= 1")
    if any(d < 1 or d > args.length for d in args.distances):
        raise LongattnError(f"--distances must lie in 1..--length ({args.length})")
    out = out_dir(args.out)
    ck = load_sweep_checkpoint(args, "retrieval needs text prompts")
    cfg = ck.config
    specs = retrieval_policy_specs(cfg, args.window, args.sinks, args.mode, scsa=args.scsa)
    arms = [(label, build_policy(cfg, spec).windows) for label, spec in specs]
    stem = f"retrieval_{slug(ck.name)}"
    cells = retrieval_cells(args.model, args.weights, args.tasks, args.distances, specs, args.samples,
                            args.length, args.seed, args.max_new_tokens, args.chunk, args.kv)
    recs = run_sweep([c for c, _ in cells], out / f"{stem}.cells.jsonl", desc="retrieval", **sweep)
    records = [{**meta, **rec["result"]} for (_, meta), rec in zip(cells, recs)]
    res = retrieval_result(ck.name, args.tasks, args.distances, arms, records, args.length, args.samples, args.seed)
    res.update(threads_per_cell=sweep["threads"], window=args.window, sinks=args.sinks, weights=args.weights,
               kv=args.kv)
    head = (f"{ck.name}: prompts <= {args.length} tokens, {args.samples} samples per point, greedy; "
            f"distance = tokens from the needle to the prompt end; {res['haystack']}"
            f"{f'; KV cache {args.kv}' if args.kv != 'f32' else ''}")
    print(head)
    print(format_table(["task", "policy", "distance", "measured", "score %", "95% CI"],
                       [[r["task"], r["policy"], r["distance"], round(r["mean_needle_distance"]), r["score"],
                         f"{r['score_lo']:.1f}-{r['score_hi']:.1f}"] for r in res["rows"]], floatfmt=".1f"))
    save_markdown(out, stem, f"Retrieval: {ck.name}", [head, res["scoring"], res["intervals"]], markdown_rows(res))
    save_results(args, out, stem, res, lambda png: plot_retrieval(res, png),
                 summary=lambda: {k: v for k, v in res.items() if k != "records"})
    return 0
