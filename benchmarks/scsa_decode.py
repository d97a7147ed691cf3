"""SCSA vs dense decode on a real long-context model (qwen2.5-0.5b), both arms in one process.

For each context length L (nested: one prefill grows the cache from length to length):
  * dense arm: 32 + 96 greedy decode steps from the L-token book prefix, timed over the 96;
  * sparse arm: the same cache truncated back to L, SCSA on every layer, teacher-forced with
    the dense arm's tokens: 32 calibration steps, then 96 timed steps; per-step greedy
    agreement = argmax(sparse logits) == dense token.
Then a sustained row at the longest L (--sustained steps, crossing a maintenance boundary).
With ``--cache-file`` the longest prefix is loaded (or prefilled once and saved there) and cut
back for each shorter L, longest first, the sustained row right after the longest.
The eager dense arm reads its cache with the fused C++ decode kernel (as the library's
Session does where the kernel is built); ``--static-dense`` adds the compiled static-shape
dense step (StaticDecoder, one dynamic-length graph) on the same cache and tokens, the
fastest dense decode longattn has, and ``--static-sparse`` SCSA inside that compiled step
(static_sparse.py; fresh indexes and calibration per context, teacher-forced alike), so
SCSA is compared engine for engine. ``--skip-eager-sparse`` leaves the eager SCSA arm out.

    python benchmarks/scsa_decode.py --threads 2 [--contexts 1024 4096 8192 16384 32768]

Writes benchmarks/results/scsa_decode.json and .png. Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


from longattn.cache import KVCache
from longattn.host import cpu_description
from longattn.ops import native
from longattn.policy import AttentionPolicy
from longattn.sparse import SCSAConfig
from longattn.sparse.policy import build_sparse_policy, stream_layers
from longattn.engine.static_step import StaticDecoder

from common import RESULTS, extend_prefix, load_model, prefix_cache, truncate, write_result


def run_dense(model, cache, policy, first_tok, steps):
    toks, times = [], []
    tok = first_tok
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tok.view(1, 1), cache=cache, policy=policy, logits="all")[0, -1]
        times.append(time.perf_counter() - t0)
        toks.append(int(tok))
        tok = logits.argmax()
    return toks, times


def run_static(dec, cache, forced, calib):
    """A static decoder (dense, or sparse with fresh indexes and calibration) over a copy of
    ``cache``, teacher-forced: ``(agreement list after calib, per-step seconds)``."""
    if dec.sparse is not None:
        dec.sparse.clear()
    dec.reset(cache.next_pos.item() + len(forced) + 1)
    dec.load_cache(cache)
    agree, times = [], []
    for i, t in enumerate(forced):
        t0 = time.perf_counter()
        logits = dec.step(torch.tensor([t]))[0]
        times.append(time.perf_counter() - t0)
        if i + 1 < len(forced) and i >= calib:
            agree.append(int(logits.argmax()) == forced[i + 1])
    return agree, times


def make_sparse_policy(cfg, args):
    return build_sparse_policy(cfg, SCSAConfig(min_context=0, calib_steps=args.calib, tolerance=args.tolerance,
                                               packing=args.packing, calib_metric=args.metric))


def counters_of(layers) -> dict:
    return {k: sum(sc.counters[k] for sc in layers) for k in
            ("opened_rows", "exact_rows", "clusters_scored", "calls", "rebuilds")}


def run_sparse(model, cache, policy, forced, calib):
    agree, times = [], []
    for i, t in enumerate(forced):
        t0 = time.perf_counter()
        logits = model(torch.tensor([[t]]), cache=cache, policy=policy, logits="all")[0, -1]
        times.append(time.perf_counter() - t0)
        if i + 1 < len(forced) and i >= calib:
            agree.append(int(logits.argmax()) == forced[i + 1])
    return agree, times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--timed", type=int, default=96)
    ap.add_argument("--sustained", type=int, default=600)
    ap.add_argument("--tolerance", type=float, default=0.025)
    ap.add_argument("--packing", default="q8_0")
    ap.add_argument("--metric", choices=["head", "group"], default="head", help="SCSAConfig.calib_metric")
    ap.add_argument("--weights", choices=["f32", "bf16", "int8", "int4"], default="bf16",
                    help="weight format of both arms (int8 makes the weight reads, which SCSA cannot "
                         "shrink, a smaller part of a step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--static-dense", action="store_true",
                    help="also time the compiled static dense step (one dynamic graph, compiled once)")
    ap.add_argument("--static-sparse", action="store_true",
                    help="also run SCSA inside the compiled static step (one dynamic graph, compiled once)")
    ap.add_argument("--skip-eager-sparse", action="store_true",
                    help="leave out the eager SCSA arm (with --static-sparse)")
    ap.add_argument("--cache-file", default=None,
                    help="load the longest context's prefix cache from here (same --model and --weights; "
                         "saved there after a prefill); contexts then run longest first, the sustained row "
                         "right after the longest")
    ap.add_argument("--out", default=str(RESULTS / "scsa_decode.json"))
    args = ap.parse_args()
    ck, model, ids = load_model(args)
    dense_pol = AttentionPolicy.from_config(ck.config)
    steps = args.calib + args.timed
    dec = None
    if args.static_dense:
        dec = StaticDecoder(model, dense_pol, max_len=max(args.contexts) + steps + 1, dynamic=True)
        print(f"static dense step compiled in {dec.warmup():.0f} s", file=sys.stderr, flush=True)
    sdec = None
    if args.static_sparse:
        sdec = StaticDecoder(model, make_sparse_policy(ck.config, args), max_len=max(args.contexts) + steps + 1,
                             dynamic=True)
        print(f"static sparse step compiled in {sdec.warmup():.0f} s", file=sys.stderr, flush=True)
    def arms_at(L: int, n_steps: int) -> dict:
        """Every arm from the same L-token cache, teacher-forced with the eager dense tokens."""
        first = torch.tensor(ids[L])
        toks, d_times = run_dense(model, cache, dense_pol, first, n_steps)
        truncate(cache, L)
        d = statistics.median(d_times[args.calib:])
        row = {"context": L, "steps": n_steps - args.calib, "calib_steps": args.calib, "dense_tok_s": 1 / d}
        msg = f"L={L:>6} x {n_steps - args.calib}  dense {1 / d:6.2f} tok/s"
        if not args.skip_eager_sparse:
            sp_pol = make_sparse_policy(ck.config, args)
            for st in cache.op_state:  # a fresh SCSA state (index, calibration) for this context
                st.clear()
            agree, s_times = run_sparse(model, cache, sp_pol, toks, args.calib)
            truncate(cache, L)
            s = statistics.median(s_times[args.calib:])
            layers = list(stream_layers(cache).values())
            taus = [t for sc in layers for t in sc.tau_values() if t is not None] or [0.0]  # None: exact head
            row.update(sparse_tok_s=1 / s, speedup=d / s, agreement=sum(agree) / len(agree),
                       counters=counters_of(layers), tau_median=statistics.median(taus), tau_min=min(taus),
                       sparse_step_p90_s=sorted(s_times[args.calib:])[int(0.9 * (n_steps - args.calib))])
            msg += (f" | SCSA {1 / s:6.2f} tok/s {d / s:5.2f}x agreement {100 * row['agreement']:5.1f}% "
                    f"tau median {row['tau_median']:.3f}")
        if dec is not None:
            st = statistics.median(run_static(dec, cache, toks, args.calib)[1][args.calib:])
            row["static_dense_tok_s"] = 1 / st
            msg += f" | static dense {1 / st:6.2f} tok/s"
        if sdec is not None:
            agree, ss_times = run_static(sdec, cache, toks, args.calib)
            ss = statistics.median(ss_times[args.calib:])
            layers = list(sdec.sparse.layers.values())
            taus = [t for sc in layers for t in sc.tau_values() if t is not None] or [0.0]  # None: exact head
            row.update(static_sparse_tok_s=1 / ss, static_sparse_agreement=sum(agree) / len(agree),
                       static_sparse_counters=counters_of(layers), static_sparse_tau_median=statistics.median(taus),
                       static_sparse_step_p90_s=sorted(ss_times[args.calib:])[int(0.9 * (n_steps - args.calib))],
                       static_sparse_vs_dense=d / ss)
            msg += f" | static SCSA {1 / ss:6.2f} tok/s agreement {100 * row['static_sparse_agreement']:5.1f}%"
            if dec is not None:
                row["static_sparse_vs_static_dense"] = st / ss
                msg += f" ({st / ss:.2f}x static dense)"
        print(msg, flush=True)
        return row

    rows, prefill_s, sustained = [], 0.0, None
    if args.cache_file:  # one prefix for all: longest first, then cut back context by context
        t0 = time.perf_counter()
        cache = prefix_cache(model, ck.config, ids, max(args.contexts), args.chunk, args.cache_file)
        prefill_s = time.perf_counter() - t0
        for L in sorted(args.contexts, reverse=True):
            truncate(cache, L)
            rows.insert(0, arms_at(L, steps))
            if L == max(args.contexts) and args.sustained:
                sustained = arms_at(L, args.calib + args.sustained)
    else:
        cache, filled = KVCache(ck.config, 1), 0
        for L in sorted(args.contexts):
            t0 = time.perf_counter()
            extend_prefix(model, cache, dense_pol, ids, filled, L, args.chunk)  # the shared prefix grows to L
            filled = L
            prefill_s += time.perf_counter() - t0
            rows.append(arms_at(L, steps))
        # the longest context again for --sustained steps (crossing index maintenance passes)
        sustained = arms_at(max(args.contexts), args.calib + args.sustained) if args.sustained else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"model": args.model, "weights": args.weights, "threads": args.threads, "packing": args.packing,
           "dense_read": "fused" if native.available() else "matmul", "scsa_kernel":
               ("native-avx512" if native.has_avx512() else "native-avx2") if native.available() else "torch",
           "tolerance": args.tolerance, "metric": args.metric, "cpu": cpu_description(), "rows": rows, "sustained": sustained, "prefill_seconds": prefill_s,
           "prefix_from_file": bool(args.cache_file), "dense_attention_form": "avx512" if native.dense_attention_avx512() else "avx2"}
    write_result(args.out, out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["context"] for r in rows]
        for key, label, mark in (("dense_tok_s", "dense (eager)", "o-"), ("sparse_tok_s", "SCSA (eager)", "s-"),
                                 ("static_dense_tok_s", "dense (static, compiled)", "o--"),
                                 ("static_sparse_tok_s", "SCSA (static, compiled)", "s--")):
            if key in rows[0]:
                ax[0].plot(xs, [r[key] for r in rows], mark, label=label)
        ax[0].set_xscale("log", base=2); ax[0].set_xlabel("context"); ax[0].set_ylabel("decode tok/s")
        ax[0].legend()
        for key, label in (("agreement", "SCSA (eager)"), ("static_sparse_agreement", "SCSA (static)")):
            if key in rows[0]:
                ax[1].plot(xs, [100 * r[key] for r in rows], "o-", label=label)
        ax[1].set_xscale("log", base=2); ax[1].set_xlabel("context"); ax[1].set_ylabel("greedy agreement %")
        ax[1].legend()
        fig.suptitle(f"SCSA vs dense decode, {args.model} ({args.weights} weights, {args.threads} threads)")
        fig.tight_layout(); fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)
    except Exception as e:  # plotting is a convenience; the JSON is the result
        print(f"plot skipped: {e}", file=sys.stderr)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
