"""`longattn cache`: KV-cache bytes vs context per policy and model, measured and by formula."""

from __future__ import annotations

from .common import add_lab_parser, add_output_args, progress_ticker, save_results, setup_threads

DEFAULT_MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"]


def add_parser(sub) -> None:
    from ..lab.plots import int_list, str_list
    p = add_lab_parser(sub, "cache", help="KV cache bytes vs context per policy: measured caches and the formula",
                       description="Build each policy's cache with make_cache, fill it with T tokens and "
                                   "read its bytes, beside hybrid_cache_bytes (the closed form).", model=False)
    p.add_argument("--models", type=str_list, default=",".join(DEFAULT_MODELS),
                   help="bundled model names or checkpoint paths, comma-separated")
    p.add_argument("--contexts", type=int_list, default="256,512,1024,2048,4096,8192,16384,32768",
                   help="context lengths T, comma-separated")
    p.add_argument("--window", type=int, default=1024, help="imposed window W")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens with the imposed window")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16", "int8"], default="float32",
                   help="K/V storage format (int8: q8 rows, D codes and a float32 scale per 32 values)")
    p.add_argument("--measure-max", type=int, default=8192,
                   help="build and fill real caches only up to this T (the formula covers every T)")
    p.add_argument("--fill", choices=["update", "model"], default="update",
                   help="update: random K/V through cache.update; model: prefill random ids through the model")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    add_output_args(p, "results/cache", run)


def run(args) -> int:
    import torch
    from ..checkpoint import load_checkpoint
    from ..errors import LongattnError
    from ..lab.cachebytes import cache_sweep, named_policies, plot_cache
    from ..lab.plots import format_table, out_dir
    setup_threads(args.threads)
    if args.window < 1 or args.sinks < 0:
        raise LongattnError("--window must be >= 1 and --sinks >= 0")
    if any(t < 1 for t in args.contexts):
        raise LongattnError("--contexts must be positive")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "int8": torch.int8}[args.kv_dtype]
    out = out_dir(args.out)
    results = []
    for name in args.models:
        ck = load_checkpoint(name, progress=True, with_tokenizer=False)
        model = None
        if args.fill == "model":
            from ..models import build_model
            model = build_model(ck.config, ck.state_dict)
        pols = named_policies(ck.config, args.window, args.sinks)
        bar, tick = progress_ticker(len(pols) * len(args.contexts), f"cache {ck.name}", unit="cache")
        res = cache_sweep(ck.config, pols, sorted(args.contexts), dtype, measure_max=args.measure_max,
                          model=model, progress=tick)
        bar.close()
        res["model"] = ck.name
        results.append(res)
        del model, ck
    rows, bad = [], 0
    for res in results:
        for r in res["rows"]:
            m = r.get("match")
            bad += m is False
            rows.append([res["model"], r["policy"], r["tokens"], r["formula_bytes"] / 2**20,
                         r["allocated_bytes"] / 2**20 if "allocated_bytes" in r else None,
                         r["held_bytes"] / 2**20 if "held_bytes" in r else None,
                         "-" if m is None else ("yes" if m else "NO")])
    print(format_table(["model", "policy", "T", "formula MiB", "allocated MiB", "held MiB", "match"], rows,
                       floatfmt=".3f"))
    print("allocated = cache.nbytes() (a ring allocates sinks+W slots up front); held = filled slots; "
          "match: held == formula, and allocated == formula once the rings are full")
    doc = {"experiment": "cache", "window": args.window, "sinks": args.sinks, "kv_dtype": args.kv_dtype,
           "contexts": sorted(args.contexts), "mismatches": bad, "models": results}
    save_results(args, out, "cache", doc, lambda png: plot_cache(results, png),
                 summary=lambda: ({k: v for k, v in doc.items() if k != "models"} |
                                  {"rows": [dict(model=res["model"], **{k: r[k] for k in r if not k.startswith("layer")
                                                                        and k != "windows"})
                                            for res in results for r in res["rows"]]}))
    return 0 if bad == 0 else 1
