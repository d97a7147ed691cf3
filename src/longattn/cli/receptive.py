"""`longattn receptive`: how far a one-token change travels through stacked windows."""

from __future__ import annotations

from .common import add_lab_parser, add_output_args, load_text_model, save_results, setup_threads


def add_parser(sub) -> None:
    from ..lab.plots import int_list
    p = add_lab_parser(sub, "receptive", help="largest logit change vs distance after changing one token",
                       description="Change the token at one position of a book passage and record the "
                                   "largest change of any logit at each later distance, with a window on "
                                   "every layer. Beyond L*(W-1) the change is exactly zero.")
    p.add_argument("--windows", type=int_list, default="4,8,16", help="windows W, comma-separated")
    p.add_argument("--sinks", type=int, default=0, help="sink tokens with every window")
    p.add_argument("--length", type=int, default=512, help="tokens of book text")
    p.add_argument("--position", type=int, default=8, help="position whose token is changed")
    add_output_args(p, "results/receptive", run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, progress_bar, slug
    from ..lab.receptive import plot_receptive, receptive_field
    from ..lab.tasks import book_passages
    setup_threads(args.threads)
    if args.length < 2 or not 0 <= args.position < args.length:
        raise LongattnError(f"need --length >= 2 and 0 <= --position < --length (got {args.position})")
    if any(w < 1 for w in args.windows):
        raise LongattnError("--windows must be positive")
    out = out_dir(args.out)
    ck, model, encode = load_text_model(args, "receptive reads book text")
    ids = book_passages(encode, 1, args.length)[0]
    bar = progress_bar(len(args.windows), "receptive", unit="window")
    results = []
    for w in args.windows:
        results.append(receptive_field(model, ids, w, args.position, args.sinks))
        bar.update(1)
    bar.close()
    for r in results:
        r.update(model=ck.name, threads=args.threads)
    L = ck.config.num_layers
    print(f"{ck.name}: token at position {args.position} of {args.length} changed; window on all {L} layers")
    rows = []
    for r in results:
        beyond = r["zero_beyond_reach"] if r["reach"] < len(r["distances"]) else None
        ch = r["max_logit_change"]
        rows.append([r["window"], r["reach"], r["last_nonzero_distance"], ch[min(len(ch) - 1, r["reach"])],
                     "-" if beyond is None else ("yes" if beyond else "NO")])
    print(format_table(["window", "reach L(W-1)", "last nonzero", "change at reach", "exact 0 beyond"], rows,
                       floatfmt=".3g"))
    res = {"experiment": "receptive", "model": ck.name, "results": results}
    save_results(args, out, f"receptive_{slug(ck.name)}", res, lambda png: plot_receptive(results, png),
                 summary=lambda: {"experiment": "receptive", "model": ck.name,
                                  "summary": [{k: r[k] for k in ("window", "sinks", "reach", "last_nonzero_distance",
                                                                 "zero_beyond_reach")} for r in results]})
    return 0
