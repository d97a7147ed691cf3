"""`longattn sinks`: attention mass each layer and head puts on the first token(s) of real text."""

from __future__ import annotations

import argparse

from .common import add_json_arg, add_model_args, add_policy_args, emit_json, load_model, policy_from_args, \
    setup_threads


def add_parser(sub) -> None:
    p = sub.add_parser("sinks", help="attention mass on the first token per layer and head (heatmap)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Rebuild every layer's attention probabilities on a book passage and "
                                   "report the mean mass the queries put on the first token(s).")
    add_model_args(p)
    p.add_argument("--length", type=int, default=512, help="tokens of book text")
    p.add_argument("--first", type=int, default=1, help="how many leading tokens count as the sink")
    p.add_argument("--from-position", type=int, default=None,
                   help="average over queries at positions >= this (default: --first)")
    add_policy_args(p)
    p.add_argument("--out", default="results/sinks", help="directory for the JSON and PNG")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug, write_json, written
    from ..lab.sinkmass import plot_sinks, sink_mass
    from ..lab.tasks import book_passages
    setup_threads(args.threads)
    if args.length < 2:
        raise LongattnError("--length must be >= 2")
    if args.policy == "sparse":
        raise LongattnError("sinks measures window/dense attention; use --policy checkpoint, dense, window or global")
    out = out_dir(args.out)
    ck, model = load_model(args)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; sinks reads book text")
    policy = policy_from_args(ck.config, args)
    ids = book_passages(lambda s: ck.tokenizer(s)["input_ids"], 1, args.length)[0]
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
    stem = f"sinks_{slug(ck.name)}"
    paths = [write_json(out / f"{stem}.json", res)]
    plot_sinks(res, out / f"{stem}.png")
    paths.append(out / f"{stem}.png")
    print(written(paths))
    if args.json:
        emit_json(res)
    return 0
