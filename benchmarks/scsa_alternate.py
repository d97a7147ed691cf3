"""Static SCSA vs static dense decode on qwen2.5-0.5b, arms alternated in short blocks.

scsa_decode.py times each arm in one long run after the other; on a shared host whose speed
drifts by tens of percent over minutes that is not enough to trust a ratio. Here both compiled
static decoders (dense, and SCSA on every layer) start from the same prefix cache and take
turns: ``--rounds`` rounds of ``--block`` steps each. ``--cluster-sizes``, ``--tolerances``,
``--outliers`` and ``--probes`` (SCSAConfig.probe_dims) add one SCSA arm per value (their
product). Every kernel takes its automatic form (``ops.native.isa_code``; scsa_call.py and
decode_attention.py compare the AVX2 and AVX-512 forms call by call). Every arm first takes ``--calib`` + 8
untimed steps (SCSA calibrates there, fresh index per context), so all arms then decode the
same positions.

Tokens are the book's own, fed to every arm alike (teacher forcing with natural text). Greedy
agreement of an SCSA arm at a step = its argmax equals the dense arm's argmax at the same
position, counted over every step after calibration (the 8 warm steps and the timed ones).
As a control, the calibration steps (exact attention through SCSA's own dense path, so only
rounding differs from the dense arm) are counted the same way; ``--controls`` adds two arms that
open every cluster (tau 0, no calibration): q8_0 packing (what the packing alone costs) and f32
packing (rounding alone, on every step). ``--outlier-slots`` adds, per SCSA arm, ``...+slots``:
the same arm with the index's contiguous outlier copies withheld (ClusterIndex.extra_k/extra_v),
so its native calls read the outliers from the cache by slot (the same bits, another read).

The prefix cache of the longest context is built once (or loaded from ``--cache-file``, saved
there after a build: a 32K prefill takes ~11 minutes here) and cut back for shorter contexts.

    python benchmarks/scsa_alternate.py --threads 2 --contexts 32768 16384 4096 \\
        --cache-file /tmp/qwen_int4_32k.pt

Writes benchmarks/results/scsa_alternate.json. Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch


from longattn.host import cpu_description
from longattn.ops import native
from longattn.policy import AttentionPolicy
from longattn.sparse import SCSAConfig, SCSALayer
from longattn.sparse.index import ClusterIndex
from longattn.sparse.policy import build_sparse_policy
from longattn.engine.static_step import StaticDecoder


from common import RESULTS, load_model, prefix_cache, truncate, write_result


def withhold_copies(slot_cfgs: set) -> None:
    """Indexes built under a config whose id is in ``slot_cfgs`` keep no outlier copies, so their
    native calls read the outliers from the cache by slot (``--outlier-slots``)."""
    copy = ClusterIndex._copy_outliers

    def patched(self, k, v, kept=0):
        if id(self.cfg) in slot_cfgs:
            self.extra_k = self.extra_v = None
        else:
            copy(self, k, v, kept)

    ClusterIndex._copy_outliers = patched


def no_shortcut(general_cfgs: set) -> None:
    """Layers under a config whose id is in ``general_cfgs`` never take the decode loop's
    shortcut (SCSALayer._hot_call): every call runs the general path (``--general``)."""
    hot_call = SCSALayer._hot_call

    def patched(self, *a):
        return None if id(self.cfg) in general_cfgs else hot_call(self, *a)

    SCSALayer._hot_call = patched


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--weights", choices=["f32", "bf16", "int8", "int4"], default="int4")
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 16384, 4096])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=12)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--tolerances", nargs="+", type=float, default=[0.025],
                    help="one SCSA arm per SCSAConfig.tolerance (times each cluster size)")
    ap.add_argument("--metric", choices=["head", "group"], default="group")
    ap.add_argument("--controls", action="store_true",
                    help="two more arms at tau 0 (everything opened): q8_0 packing, and f32 packing (PyTorch "
                         "path, slow): what packing alone, and rounding alone, do to agreement")
    ap.add_argument("--cluster-sizes", nargs="+", type=int, default=[128],
                    help="one SCSA arm per SCSAConfig.cluster_size (all alternated with dense)")
    ap.add_argument("--calib-quantiles", nargs="+", type=float, default=[SCSAConfig().calib_quantile],
                    help="SCSAConfig.calib_quantile per arm (0.5: the median calibration error meets the tolerance)")
    ap.add_argument("--outliers", nargs="+", type=int, default=[SCSAConfig().outliers],
                    help="one SCSA arm per SCSAConfig.outliers (keys per cluster read exactly; times the "
                         "cluster sizes and tolerances)")
    ap.add_argument("--probes", nargs="+", type=int, default=[SCSAConfig().probe_dims],
                    help="SCSAConfig.probe_dims per arm (0 = no probe)")
    ap.add_argument("--probe-keys", type=int, default=SCSAConfig().probe_keys)
    ap.add_argument("--general", action="store_true",
                    help="per SCSA arm, an arm ...+general whose layers never take SCSALayer's decode-loop "
                         "shortcut (the general path's Python on every call; the same bits)")
    ap.add_argument("--outlier-slots", action="store_true",
                    help="per SCSA arm, an arm ...+slots whose native calls read the outliers from the cache "
                         "by slot instead of the index's copies")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--cache-file", default=None, help="load/save the longest prefix cache here")
    ap.add_argument("--out", default=str(RESULTS / "scsa_alternate.json"))
    args = ap.parse_args()
    ck, model, ids = load_model(args)
    contexts = sorted(args.contexts, reverse=True)  # the cache is cut back from the longest
    forms = [None]  # each kernel's automatic form
    warm = args.calib + 8
    steps = warm + args.rounds * len(forms) * args.block
    max_len = contexts[0] + steps + 1
    decs = {"dense": StaticDecoder(model, AttentionPolicy.from_config(ck.config), max_len=max_len, dynamic=True)}
    arms = [(cs, tol, o, q, pr) for cs in args.cluster_sizes for tol in args.tolerances for o in args.outliers
            for q in args.calib_quantiles for pr in args.probes]
    sparse_arms = {}
    slot_cfgs = set()  # ids of the configs of +slots arms (see withhold_copies)
    withhold_copies(slot_cfgs)
    general_cfgs = set()  # ids of the configs of +general arms (see no_shortcut)
    no_shortcut(general_cfgs)
    for cs, tol, o, q, pr in arms:
        name = "sparse" + (f"-{cs}" if len(args.cluster_sizes) > 1 else "") + \
            (f"@{tol:g}" if len(args.tolerances) > 1 else "") + (f"+out{o}" if len(args.outliers) > 1 else "") + \
            (f"~q{q:g}" if len(args.calib_quantiles) > 1 else "") + (f"+probe{pr}" if len(args.probes) > 1 else "")
        scsa = SCSAConfig(min_context=0, calib_steps=args.calib, tolerance=tol, calib_metric=args.metric,
                          calib_quantile=q, cluster_size=cs, outliers=o, probe_dims=pr, probe_keys=args.probe_keys)
        for slots, general in [(s, g) for s in ([False, True] if args.outlier_slots else [False])
                               for g in ([False, True] if args.general else [False])]:
            arm = name + ("+slots" if slots else "") + ("+general" if general else "")
            sparse_arms[arm] = tol
            cfg = dataclasses.replace(scsa)  # an arm's own config object: +slots, +general arms are told apart by it
            if slots:
                slot_cfgs.add(id(cfg))
            if general:
                general_cfgs.add(id(cfg))
            decs[arm] = StaticDecoder(model, build_sparse_policy(ck.config, cfg), max_len=max_len, dynamic=True)
    if args.controls:  # tau 0, no calibration: every cluster opened, so no tail at all
        for name, packing in (("control-q8-all", "q8_0"), ("control-f32-all", "f32")):
            scsa = SCSAConfig(min_context=0, calib_steps=0, tau_default=0.0, packing=packing)
            sparse_arms[name] = None
            decs[name] = StaticDecoder(model, build_sparse_policy(ck.config, scsa), max_len=max_len, dynamic=True)
    for name, dec in decs.items():
        print(f"static {name} step compiled in {dec.warmup():.0f} s", file=sys.stderr, flush=True)
    cache = prefix_cache(model, ck.config, ids, contexts[0], args.chunk, args.cache_file)
    rows = []
    for L in contexts:
        truncate(cache, L)
        pos = {}
        for name, dec in decs.items():
            if dec.sparse is not None:
                dec.sparse.clear()
            dec.reset(max_len)
            dec.load_cache(cache)
            pos[name] = L

        def run(name, n):
            dec, times = decs[name], []
            for _ in range(n):
                t0 = time.perf_counter()
                logits = dec.step(torch.tensor([ids[pos[name]]]))
                times.append(time.perf_counter() - t0)
                top[name][pos[name]] = int(logits[0].argmax())
                pos[name] += 1
            return times

        top = {name: {} for name in decs}
        for name in decs:
            run(name, warm)  # SCSA calibrates here, then a few steps on the frozen taus
            if decs[name].sparse is not None:  # the +slots arms, and only they, read by slot
                assert all((ix.extra_k is None) == ("+slots" in name)
                           for sc in decs[name].sparse.layers.values() for ix in sc.indexes), name
        samples = {(a, f): [] for a in decs for f in forms}
        for _ in range(args.rounds):
            for f in forms:
                for a in decs:
                    samples[(a, f)] += run(a, args.block)
        for arm in sparse_arms:
            layers = list(decs[arm].sparse.layers.values())
            opened = sum(sc.counters["opened_rows"] for sc in layers)
            outlier_rows = sum(sc.counters["outlier_rows"] for sc in layers)
            calib = decs[arm].sparse.cfg.calib_steps
            sparse_calls = sum(sc.counters["calls"] for sc in layers) - calib * len(layers)
            judged = [p for p in top[arm] if p >= L + args.calib]
            agree = sum(top[arm][p] == top["dense"][p] for p in judged)
            # control: calibration steps attend exactly (another dense kernel, other rounding)
            calib_agree = sum(top[arm][p] == top["dense"][p] for p in range(L, L + calib))
            # the cache grows by one row a step: its mean length over the judged calls
            rows_per_call = max(1, sparse_calls * ck.config.num_kv_heads * (L + args.calib + len(judged) / 2))
            row = {"context": L, "arm": arm, "cluster_size": decs[arm].sparse.cfg.cluster_size,
                   "outliers": decs[arm].sparse.cfg.outliers, "probe_dims": decs[arm].sparse.cfg.probe_dims,
                   "probe_keys": decs[arm].sparse.cfg.probe_keys,
                   "tolerance": sparse_arms[arm], "timed_steps_per_arm": args.rounds * len(forms) * args.block,
                   "agreement": agree / len(judged), "agreed_steps": agree, "judged_steps": len(judged),
                   "calibration_steps_agreeing": calib_agree, "calibration_steps": calib,
                   "opened_fraction": opened / rows_per_call,
                   # keys read exactly because they are clusters' outliers (sink and suffix not counted)
                   "outlier_fraction": outlier_rows / rows_per_call,
                   # heads that attend exactly (no tau meets the tolerance) hold no tau
                   "tau_median": statistics.median([t for sc in layers for t in sc.tau_values() if t is not None]
                                                   or [0.0]),
                   "exact_heads": sum(t is None for sc in layers for t in sc.tau_values()),
                   # layers sent to their dense read by the cost rule (SCSAConfig.dense_when_cheaper),
                   # whose heads exact_heads counts too
                   "dense_by_cost": sorted(sc.layer_index for sc in layers if sc.cfg.dense_when_cheaper
                                           and sc.cost_ratio is not None and sc.cost_ratio > 1.0)}
            msg = f"L={L:>6} {arm}"
            for f in forms:
                tag = "auto" if f is None else "avx512" if f else "avx2"
                d, s = statistics.median(samples[("dense", f)]), statistics.median(samples[(arm, f)])
                row[tag] = {"dense_ms": 1e3 * d, "sparse_ms": 1e3 * s, "speedup": d / s}
                msg += f" | {tag}: dense {1e3 * d:6.1f} ms SCSA {1e3 * s:6.1f} ms  {d / s:4.2f}x"
            print(msg + f" | opened {100 * row['opened_fraction']:.0f}% + outliers "
                  f"{100 * row['outlier_fraction']:.0f}% | agreement {agree}/{len(judged)} "
                  f"(exact calibration steps {calib_agree}/{calib})",
                  flush=True)
            rows.append(row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {
        "model": args.model, "weights": args.weights, "threads": args.threads, "rounds": args.rounds,
        "block": args.block, "tolerances": args.tolerances, "outliers": args.outliers, "metric": args.metric,
        "probes": args.probes, "probe_keys": args.probe_keys, "outlier_slots": args.outlier_slots, "general": args.general,
        "calib_quantiles": args.calib_quantiles,
        "cpu": cpu_description(),
        # the dense attention's automatic loops (AVX2 on AMD, see native.isa_code)
        "auto_dense_attention_form": "avx512" if native.dense_attention_avx512() else "avx2",
        "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
