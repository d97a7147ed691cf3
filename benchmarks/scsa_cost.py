"""What one SCSA layer call costs against the dense read it replaces, as a linear model.

SCSAConfig.dense_when_cheaper routes a layer to its dense read when the sparse call would cost
more (sparse/cost.py). The model counts a call in *dense row reads* (one float32 key and value
row read for all G query heads of a KV head, what the fused dense kernel does per cached token
and KV head), so its constants are ratios, less tied to one host's speed than times:

    sparse = fixed + per_cluster * Hkv * M + per_opened * opened rows + per_exact * exact rows
             + per_probed * probed rows
    dense  = Hkv * N

This benchmark measures both on synthetic clustered caches (Qwen2.5-0.5B head shapes: 14 query
/ 2 KV heads, head_dim 64; sparse.synthetic), arms alternated in one process: SCSALayer.attend
with the native call at fixed thresholds (tau 1: nothing opened, to 0.01: much opened), with
and without outliers (exact rows), and with the probe (``--probes R``: SCSAConfig.probe_dims, at
tau 0.16 with 8 outliers; its pass scores every packed member row, the probed rows) over several
lengths; the dense arm is the dense layer's own
op as the static step calls it (WindowOp, the fused kernel). It fits the dense time per row
(least squares through the origin plus a fixed part), then the sparse time in those units, and
prints the fitted constants and each point's predicted against measured ratio. per_probed is
also fitted alone against the constants sparse/cost.py holds (``per_probed_given_cost_py``),
which is how cost.PER_PROBED was set.

    python benchmarks/scsa_cost.py --threads 2      # ~3 minutes here

Writes benchmarks/results/scsa_cost.json. Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


from longattn.cache.base import KVView
from longattn.host import cpu_description
from longattn.lab.plots import write_json
from longattn.ops import native
from longattn.ops.attention import WindowOp
from longattn.sparse import SCSAConfig, SCSALayer, cost
from longattn.sparse.synthetic import synthetic_cache

from common import RESULTS
H, HKV, D = 14, 2, 64


def median_us(fn, calls: int, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def lstsq(rows: list, y: list) -> list:
    """Least-squares coefficients of ``y ~ rows @ c``."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, b).solution.flatten().tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--taus", nargs="+", type=float, default=[1.0, 0.16, 0.04, 0.01])
    ap.add_argument("--outliers", nargs="+", type=int, default=[0, 8])
    ap.add_argument("--probes", nargs="*", type=int, default=[16, 64],
                    help="probe arms (SCSAConfig.probe_dims), each at tau 0.16 with 8 outliers")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "scsa_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        sys.exit("scsa_cost: the native kernels are not built here (needs AVX2 and a compiler)")
    scale = D ** -0.5
    dense_op = WindowOp()
    points, dense_points = [], []
    for n in args.sizes:
        cache = synthetic_cache(n, HKV, D, seed=1)
        q = cache.queries(1, H, seed=2)[0]
        k, v = cache.k, cache.v
        pos = torch.arange(n).unsqueeze(0)
        arms = {"dense": lambda: dense_op(q, pos[:, n - 1:], KVView(k, v, pos, k[:, :, -1:], v[:, :, -1:]), scale)}
        layers = {}
        settings = [(o, tau, 0) for o in args.outliers for tau in args.taus] + [(8, 0.16, r) for r in args.probes]
        for o, tau, r in settings:
            layer = SCSALayer(SCSAConfig(min_context=0, calib_steps=0, outliers=o, probe_dims=r), H, HKV, D)
            layer.set_taus(tau)
            layer.attend(q, k, v, scale)  # builds the index, untimed
            layers[(o, tau, r)] = layer
            arms[(o, tau, r)] = lambda L=layer: L.attend(q, k, v, scale)
        samples = {a: [] for a in arms}
        for _ in range(args.repeats):  # arms alternated, each a median of its own repeats
            for a, fn in arms.items():
                samples[a].append(median_us(fn, args.calls, 1))
        t = {a: statistics.median(s) for a, s in samples.items()}
        dense_points.append({"n": n, "us": t["dense"]})
        for (o, tau, r), layer in layers.items():
            index = layer.indexes[0]
            calls = layer.counters["calls"]
            points.append({"n": n, "outliers": o, "tau": tau, "probe_dims": r,
                           "clusters": index.num_clusters,
                           "opened_rows": layer.counters["opened_rows"] / calls,
                           "exact_rows": HKV * index.exact_count(n), "probed_rows": layer.probed_rows(index),
                           "us": t[(o, tau, r)], "dense_us": t["dense"]})
        print(f"N={n}: dense {t['dense']:.0f} us; " + ", ".join(
            f"out{p['outliers']} tau {p['tau']}" + (f" probe {p['probe_dims']}" if p["probe_dims"] else "")
            + f": {p['us']:.0f} us ({p['opened_rows'] / (HKV * n):.0%} opened)"
            for p in points if p["n"] == n), flush=True)
    # dense: us = d0 + d1 * Hkv * N  ->  one dense row read costs d1 us
    d0, d1 = lstsq([[1.0, HKV * p["n"]] for p in dense_points], [p["us"] for p in dense_points])
    # sparse, in dense row reads: us / d1 = fixed + per_cluster * Hkv * M + per_opened * opened + per_exact * exact
    # (+ per_probed * probed rows)
    coef = lstsq([[1.0, HKV * p["clusters"], p["opened_rows"], p["exact_rows"], p["probed_rows"]] for p in points],
                 [p["us"] / d1 for p in points])
    fit = dict(zip(("fixed", "per_cluster", "per_opened", "per_exact", "per_probed"), coef))
    fit["dense_fixed"] = d0 / d1
    # per_probed alone, the other constants as sparse/cost.py holds them (how PER_PROBED was set)
    probed = [p for p in points if p["probed_rows"]]
    if probed:
        rest = [p["us"] / d1 - cost.sparse_cost(HKV, p["clusters"], p["opened_rows"], p["exact_rows"]) for p in probed]
        fit["per_probed_given_cost_py"] = lstsq([[p["probed_rows"]] for p in probed], rest)[0]
    print(f"dense: {d0:.1f} us + {1e3 * d1:.2f} ns per row read  ->  model constants in row reads: "
          + ", ".join(f"{k_} {v_:.3g}" for k_, v_ in fit.items()))
    for p in points:
        pred = fit["fixed"] + fit["per_cluster"] * HKV * p["clusters"] + fit["per_opened"] * p["opened_rows"] \
            + fit["per_exact"] * p["exact_rows"] + fit["per_probed"] * p["probed_rows"]
        p["predicted_ratio"] = pred / (fit["dense_fixed"] + HKV * p["n"])
        p["measured_ratio"] = p["us"] / p["dense_us"]
    errs = [abs(p["predicted_ratio"] - p["measured_ratio"]) for p in points]
    print(f"sparse / dense ratio, predicted vs measured: median |error| {statistics.median(errs):.3f}, "
          f"max {max(errs):.3f} over {len(points)} points")
    write_json(args.out, {"threads": args.threads, "cpu": cpu_description(), "shape": [H, HKV, D],
                          "calls": args.calls, "repeats": args.repeats, "dense_us_per_row": d1, "dense_us_fixed": d0,
                          "fit_row_reads": fit, "points": points, "dense": dense_points})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
