"""`longattn sinks`: attention mass each layer and head puts on the first token(s) of real text."""

from __future__ import annotations

from .common import add_lab_parser, add_output_args, add_policy_args, load_text_model, policy_from_args, \
    save_results, setup_threads


def add_parser(sub) -> None:
    p = add_lab_parser(sub, "sinks", help="attention mass on the first token per layer and head (heatmap)",
                       description="Rebuild every layer's attention probabilities on a book passage and "
                                   "report the mean mass the queries put on the first token(s).")
    p.add_argument("--length", type=int, default=512, help="tokens of book text")
    p.add_argument("--first", type=int, default=1, help="how many leading tokens count as the sink")
    p.add_argument("--from-position", type=int, default=None,
                   help="average over queries at positions >= this (default: --first)")
    add_policy_args(p)
    add_output_args(p, "results/sinks", run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug
    from ..lab.sinkmass import plot_sinks, sink_mass
    from ..lab.tasks import book_passages
    setup_threads(args.threads)
    if args.length < 2:
        raise LongattnError("--length must be >= 2")
    if args.policy == "sparse":
        raise LongattnError("sinks measures window/dense attention; use --policy checkpoint, dense, window or global")
    out = out_dir(args.out)
    ck, model, encode = load_text_model(args, "sinks reads book text")
    policy = policy_from_args(ck.config, args)
    ids = book_passages(encode, 1, args.length)[0]
    res = sink_mass(model, ids, policy, first=args.first, from_position=args.from_position)
    res.update(model=ck.name, policy=args.policy, threads=args.threads,
               first_token=ck.tokenizer.convert_ids_to_tokens(int(ids[0])))
    print(f"{ck.name}: mean attention on the first {args.first} token(s) (first token {res['first_token']!r}), "
          f"queries {res['from_position']}..{args.length - 1}, policy {args.policy}")
    H = len(res["mass"][0])
    rows = [[i, res["windows"][i] or "full", res["per_layer"][i], max(r), r.index(max(r))]
            for i, r in enumerate(res["mass"])]
    print(format_table(["layer", "window", "mean mass", "max head mass", "max head"], rows, floatfmt=".3f"))
    print(f"mean over {len(rows)} layers x {H} heads: {res['mean']:.3f}")
    save_results(args, out, f"sinks_{slug(ck.name)}", res, lambda png: plot_sinks(res, png))
    return 0
