"""`longattn scaling`: decode step time vs context (growing vs ring) and prefill attention time."""

from __future__ import annotations

from .common import add_kv_arg, add_lab_parser, add_output_args, load_model, progress_ticker, save_results, setup_threads


def add_parser(sub) -> None:
    from ..lab.plots import int_list
    p = add_lab_parser(sub, "scaling", help="decode step and prefill attention time vs context",
                       description="Median decode step time with a full (growing) cache and a ring, and "
                                   "prefill attention time for dense causal SDPA, masked SDPA and banded "
                                   "attention. Use bigger --decode-contexts/--prefill-contexts for the "
                                   "long-context regime (e.g. up to 32768).")
    p.add_argument("--decode-contexts", type=int_list, default="512,1024,2048,4096,8192",
                   help="contexts T for the decode step, comma-separated")
    p.add_argument("--prefill-contexts", type=int_list, default="1024,2048,4096,8192",
                   help="prompt lengths T for prefill attention, comma-separated")
    p.add_argument("--window", type=int, default=1024, help="window W (ring size, mask and band width)")
    p.add_argument("--sinks", type=int, default=0, help="sink tokens with the window")
    p.add_argument("--repeats", type=int, default=5, help="timed decode steps per point (median)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefill calls per point (median)")
    p.add_argument("--skip-decode", action="store_true", help="only time prefill attention (no model load)")
    add_kv_arg(p)
    add_output_args(p, "results/scaling", run)


def run(args) -> int:
    import torch
    from ..errors import LongattnError
    from ..lab.plots import format_table, out_dir, slug
    from ..lab.scaling import decode_step_times, plot_scaling, prefill_attention_times
    setup_threads(args.threads)
    if args.window < 1 or args.sinks < 0 or args.repeats < 1 or args.prefill_repeats < 1:
        raise LongattnError("need --window >= 1, --sinks >= 0 and repeats >= 1")
    out = out_dir(args.out)
    n = (0 if args.skip_decode else len(args.decode_contexts)) + len(args.prefill_contexts)
    bar, tick = progress_ticker(n, "scaling", unit="point")
    from ..checkpoint import load_checkpoint
    if args.skip_decode:
        ck = load_checkpoint(args.model, progress=True, with_tokenizer=False)
        cfg, name, decode = ck.config, ck.name, None
        del ck
    else:
        ck, model = load_model(args)
        cfg, name = ck.config, ck.name
        from ..cache.kv_format import KV_FORMATS
        decode = decode_step_times(model, args.decode_contexts, args.window, args.sinks, args.repeats,
                                   progress=tick, kv_dtype=KV_FORMATS[args.kv])
        del model
    prefill = prefill_attention_times(args.prefill_contexts, args.window, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.head_dim, args.sinks, args.prefill_repeats, progress=tick)
    bar.close()
    res = {"experiment": "scaling", "model": name, "threads": torch.get_num_threads(), "weights": args.weights,
           "kv": args.kv, "decode": decode, "prefill": prefill}
    if decode:
        print(f"{name}: decode step (median of {args.repeats}), {res['threads']} threads, "
              f"ring W={args.window} + {args.sinks} sinks, KV cache {args.kv}")
        print(format_table(["T", "growing ms", "ring ms", "speedup", "growing MiB", "ring MiB"],
                           [[t, g, r, s, gb / 2**20, rb / 2**20] for t, g, r, s, gb, rb in
                            zip(decode["contexts"], decode["growing_ms"], decode["ring_ms"], decode["speedup"],
                                decode["growing_cache_bytes"], decode["ring_cache_bytes"])], floatfmt=".2f"))
    print(f"prefill attention, one layer (H={cfg.num_heads}, Hkv={cfg.num_kv_heads}, D={cfg.head_dim}, "
          f"W={args.window}), median of {args.prefill_repeats}")
    print(format_table(["T", "dense causal ms", "masked ms", "banded ms", "dense/banded"],
                       [[t, d, m, b, d / b] for t, d, m, b in
                        zip(prefill["contexts"], prefill["dense_ms"], prefill["masked_ms"], prefill["banded_ms"])],
                       floatfmt=".2f"))
    save_results(args, out, f"scaling_{slug(name)}", res, lambda png: plot_scaling(res, png))
    return 0
