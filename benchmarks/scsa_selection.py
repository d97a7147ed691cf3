"""SCSA: what selection costs (flat vs hierarchical) and what a decode call costs vs dense SDPA.

Part 1, selection: time of the priority + selection step only (``cluster_scores`` + the flat stop
rule, or the tree walk) and the number of summaries scored, on one KV head (7 query heads, as one
Qwen2.5-0.5B group) of synthetic clustered keys, at 32K .. 1,048,576 rows. Next to each time
stands ``clusters_scored`` (summaries scored per call, deterministic): the cost measure that does
not depend on the machine's load. Hierarchical selection is flat in N when it stays constant.
Three regimes of synthetic queries (strength 1.5, noise 1.0, unless said):
  * diffuse: each query head mixes two of 48 key components; a fixed fraction of the cache
    matters, so the opened set grows with N;
  * focused: the heads of a group aim at one of max(48, N/512) components; a bounded set of
    keys carries most of the mass, but the background's share grows with N, so the set a
    true tau needs grows too (see oracle_opened);
  * sharp: focused with strength 3.0 (selection part only): the target keeps nearly all the
    mass at every N, so the needed set stays bounded.
The relative output error of each selection (at the same fixed tau) is reported next to its
cost: a cheap walk that stops early is only as good as its error. So are two checks against
the exact per-leaf masses: ``oracle_opened``, the fewest leaves that really leave less than tau
of the mass uncaptured (what any selection meeting tau in truth must open, hence score), and
``*_true_uncaptured``, the mass fraction each selection really left unopened (its stop rule
bounds only its estimate of that by tau), and ``flat_opened_overestimate_nats``, by how much
the largest estimate among the leaves flat opened exceeds that leaf's true log-mass.
Two more flat arms are judged alike (output error, truly uncaptured, opened): ``refined``, the
stop rule re-decided with the opened leaves' exact masses until nothing more opens
(SCSAConfig.refine), and ``bounded``, the same with every unopened leaf counted at its upper
bound ``a + log m + beta |q| r`` instead of its estimate: a rule that holds tau in truth for any
query, and what that guarantee costs in leaves opened.
Part 2, attend: one full ``SCSALayer.attend`` (after its 32-call self-calibration) vs dense
``F.scaled_dot_product_attention`` at 4K .. 32K tokens for the Qwen2.5-0.5B head shape
(14 query heads, 2 KV heads, head_dim 64), diffuse regime, with the relative error of the output.

Timings are medians over interleaved repeats (methods alternate inside every repeat); ratios are
computed from medians of the same run. Writes benchmarks/results/scsa_selection.json and .png.

    python benchmarks/scsa_selection.py --quick          # < 2 minutes
    python benchmarks/scsa_selection.py --threads 2      # the full grid (selection to 1,048,576 rows)
    python benchmarks/scsa_selection.py --quick --sizes 1048576 --no-attend   # one size, selection only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from longattn.sparse import SCSAConfig, SCSALayer
from longattn.sparse.config import TREE_ORDERS
from longattn.sparse.kernel import cluster_scores, needed, select_flat, select_tree
from longattn.sparse.synthetic import synthetic_cache

HEAD_DIM = 64
QWEN_HEADS, QWEN_KV = 14, 2
REGIMES = {
    "diffuse": dict(cache=lambda n: dict(centers=48), queries=dict(topics=2)),
    "focused": dict(cache=lambda n: dict(centers=max(48, n // 512)), queries=dict(topics=1)),
    # focused with queries twice as strong: the target keeps nearly all the mass at every N, so
    # the set a true tau needs stays bounded (the fair test of "cost tracks the opened set")
    "sharp": dict(cache=lambda n: dict(centers=max(48, n // 512)), queries=dict(topics=1, strength=3.0)),
}


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def mem_available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def true_leaf_logmass(index, q, k, beta: float) -> torch.Tensor:
    """``[1, g, M]`` exact log attention mass of each leaf cluster (one KV head).

    q ``[g, D]``, k ``[N, D]``. With these in place of the estimates, the stop rule opens the
    fewest leaves that really leave less than tau of the mass uncaptured: a floor on what any
    selection meeting tau must open (and so score), whatever its summaries.
    """
    slots = index.slots[0, :index.num_clusters]                       # [M, cs], -1 = padding
    s = beta * q @ k.T                                                # [g, N]
    member = s[:, slots.clamp_min(0)].masked_fill(slots < 0, float("-inf"))  # [g, M, cs]
    return torch.logsumexp(member, -1).unsqueeze(0)


def bench_selection(n: int, regime: str, queries: int, repeats: int, tau: float,
                    tree_order: str = "similar", cluster_size: int = 128) -> dict:
    """Priority + selection time and summaries scored, flat vs hierarchical, one KV head."""
    spec = REGIMES[regime]
    cache = synthetic_cache(n, 1, HEAD_DIM, seed=7, **spec["cache"](n))
    group = QWEN_HEADS // QWEN_KV
    qs = cache.queries(queries, group, seed=3, **spec["queries"])  # [Q, 1, g, 1, D]
    cfg = SCSAConfig(min_context=0, calib_steps=0, tau_default=tau, hierarchical=True, tree_order=tree_order,
                     cluster_size=cluster_size, outliers=0)  # committed results predate outliers
    layer = SCSALayer(cfg, group, 1, HEAD_DIM)
    t0 = time.perf_counter()
    layer.attend(qs[0], cache.k, cache.v, HEAD_DIM ** -0.5)  # builds the index and the tree
    build_s = time.perf_counter() - t0
    index = layer.indexes[0]
    beta = HEAD_DIM ** -0.5
    preps = [layer._prepare(index, q[0, :, 0], cache.k[0], cache.v[0], beta, flat_scores=False) for q in qs]
    taus = layer.taus

    def flat(p):
        _, est = cluster_scores(p["qg"], index.live_summ, index.live_resid, index.live_log_counts,
                                index.live_radius, beta)
        return select_flat(est, p["log_exact"], taus)

    def hier(p):
        return select_tree(p["qg"], index.tree, p["log_exact"], taus, beta)[0]

    times = {"flat": [], "hier": []}
    scored = {"flat": [], "hier": []}
    opened = {"flat": [], "hier": []}
    for rep in range(repeats):
        order = ("flat", "hier") if rep % 2 == 0 else ("hier", "flat")
        for p in preps:
            for name in order:
                fn = flat if name == "flat" else hier
                t0 = time.perf_counter()
                sel = fn(p)
                times[name].append(time.perf_counter() - t0)
                if rep == 0:
                    scored[name].append(sel.scored)
                    opened[name].append(int(sel.opened.sum()))
    # Output error of each selection against dense attention (the price of a cheap selection).
    arms = ("flat", "hier", "refined", "bounded")
    errors = {name: [] for name in arms}
    oracle, over = [], []
    extra_opened = {"refined": [], "bounded": []}
    uncaptured = {name: [] for name in arms}
    for q, p in zip(qs, preps):
        true = true_leaf_logmass(index, q[0, :, 0], cache.k[0, 0], beta)
        oracle.append(int(needed(true, p["log_exact"], taus).sum()))
        dense = F.scaled_dot_product_attention(q, cache.k, cache.v, scale=beta, enable_gqa=True)
        dense = dense[0, :, 0].view(1, group, HEAD_DIM)  # [Hkv=1, g, D]
        full = layer._prepare(index, q[0, :, 0], cache.k[0], cache.v[0], beta, flat_scores=True)
        total = torch.logaddexp(torch.logsumexp(true, -1), p["log_exact"])  # [1, g] true log-mass
        # "bounded": every unopened leaf counted at its upper bound a + log m + beta |q| r (no
        # estimate), opened ones at their exact mass: the rule's tau then holds in truth, whatever
        # the queries (up to the packing's rounding of the exact masses)
        cap = beta * full["qg"].norm(dim=-1, keepdim=True) * index.live_radius.unsqueeze(1)  # [1, g, M]
        bound = {**full, "est": full["tail"] + cap}
        for name in arms:
            p_arm = bound if name == "bounded" else full
            sel, tail, v_tail = layer._select(index, p_arm, beta, taus, hierarchical=name == "hier")
            if name in extra_opened:  # flat, re-decided with the opened leaves' exact masses to a fixed point
                sel = layer.refine(index, p_arm, sel, taus, beta, rounds=64)
                extra_opened[name].append(int(sel.opened.sum()))
            o = layer._output(index, full, sel, tail, v_tail, beta)
            errors[name].append(((o - dense).norm(dim=-1) / dense.norm(dim=-1)).median().item())
            # what the stop rule left out, in truth (tau bounds its estimate of this)
            left = torch.logsumexp(true.masked_fill(sel.opened.unsqueeze(1), float("-inf")), -1)
            uncaptured[name].append((left - total).exp().median().item())
            if name == "flat":  # how far the estimates of the leaves it opened exceed their true
                # log-mass (the largest, in nats): one such leaf inflates the rule's denominator
                wrong = (full["est"] - true).masked_fill(~sel.opened.unsqueeze(1), float("-inf"))
                over.append(wrong.amax(-1).median().item())
    out = {"n": n, "regime": regime, "clusters": index.num_clusters, "tree_nodes": index.tree.num_nodes,
           "build_s": round(build_s, 3), "tau": tau, "tree_order": tree_order, "cluster_size": cluster_size}
    for name in ("flat", "hier"):
        out[f"{name}_ms"] = round(median_ms(times[name]), 4)
        out[f"{name}_scored"] = statistics.median(scored[name])
        out[f"{name}_opened"] = statistics.median(opened[name])
    for name in arms:
        out[f"{name}_median_rel_err"] = round(statistics.median(errors[name]), 5)
        out[f"{name}_true_uncaptured"] = round(statistics.median(uncaptured[name]), 5)
    for name, counts in extra_opened.items():
        out[f"{name}_opened"] = statistics.median(counts)
    out["oracle_opened"] = statistics.median(oracle)
    out["flat_opened_overestimate_nats"] = round(statistics.median(over), 2)
    out["flat_over_hier"] = round(out["flat_ms"] / out["hier_ms"], 3)
    del cache, layer, index, preps
    return out


def bench_attend(n: int, regime: str, queries: int, repeats: int, calib_steps: int) -> dict:
    """Full decode attention, SCSA (flat and hierarchical, self-calibrated) vs dense SDPA."""
    spec = REGIMES[regime]
    cache = synthetic_cache(n, QWEN_KV, HEAD_DIM, seed=11, **spec["cache"](n))
    beta = HEAD_DIM ** -0.5
    calib = cache.queries(calib_steps, QWEN_HEADS, seed=5, **spec["queries"])
    qs = cache.queries(queries, QWEN_HEADS, seed=6, **spec["queries"])
    layers = {}
    calib_s = {}
    for name, hierarchical in (("flat", False), ("hier", True)):
        layer = SCSALayer(SCSAConfig(min_context=0, calib_steps=calib_steps, hierarchical=hierarchical, outliers=0),
                          QWEN_HEADS, QWEN_KV, HEAD_DIM)
        t0 = time.perf_counter()
        for q in calib:
            layer.attend(q, cache.k, cache.v, beta)
        calib_s[name] = time.perf_counter() - t0
        assert layer.calibrated
        layers[name] = layer
    dense_out = [F.scaled_dot_product_attention(q, cache.k, cache.v, scale=beta, enable_gqa=True) for q in qs]
    errs = {name: [] for name in layers}
    opened = {}
    for name, layer in layers.items():
        before = layer.counters["opened_rows"]
        for q, d in zip(qs, dense_out):
            o = layer.attend(q, cache.k, cache.v, beta)
            errs[name].append(((o - d).norm(dim=-1) / d.norm(dim=-1)).median().item())
        opened[name] = (layer.counters["opened_rows"] - before) / (queries * QWEN_KV * n)
    times = {"dense": [], "flat": [], "hier": []}
    names = list(times)
    for rep in range(repeats):
        order = names[rep % 3:] + names[:rep % 3]
        for q in qs:
            for name in order:
                t0 = time.perf_counter()
                if name == "dense":
                    F.scaled_dot_product_attention(q, cache.k, cache.v, scale=beta, enable_gqa=True)
                else:
                    layers[name].attend(q, cache.k, cache.v, beta)
                times[name].append(time.perf_counter() - t0)
    out = {"n": n, "regime": regime}
    for name in names:
        out[f"{name}_ms"] = round(median_ms(times[name]), 4)
    for name in layers:
        out[f"speedup_{name}"] = round(out["dense_ms"] / out[f"{name}_ms"], 3)
        out[f"{name}_opened_frac"] = round(opened[name], 4)
        out[f"{name}_median_rel_err"] = round(statistics.median(errs[name]), 5)
        out[f"{name}_taus"] = [round(t, 4) for t in layers[name].taus.tolist()]
        out[f"{name}_calib_s"] = round(calib_s[name], 3)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    sel = results["selection"]
    for regime, style in (("diffuse", "-"), ("focused", "--"), ("sharp", ":")):
        rows = [r for r in sel if r["regime"] == regime]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        for name, color in (("flat", "tab:blue"), ("hier", "tab:orange")):
            axes[0].plot(ns, [r[f"{name}_ms"] for r in rows], style, marker="o", color=color,
                         label=f"{name}, {regime}")
            axes[1].plot(ns, [r[f"{name}_scored"] for r in rows], style, marker="o", color=color,
                         label=f"{name}, {regime}")
    for ax, title, ylabel in ((axes[0], "selection time (priorities + stop rule)", "ms"),
                              (axes[1], "summaries scored per call (1 KV head)", "count")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("cached rows")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for regime, style in (("diffuse", "-"), ("focused", "--")):
        att = [r for r in results["attend"] if r["regime"] == regime]
        if not att:
            continue
        ns = [r["n"] for r in att]
        for name, color in (("dense", "black"), ("flat", "tab:blue"), ("hier", "tab:orange")):
            if name == "dense" and regime != "diffuse":
                continue
            axes[2].plot(ns, [r[f"{name}_ms"] for r in att], style, marker="o", color=color,
                         label="dense SDPA" if name == "dense" else f"SCSA {name}, {regime}")
        for r in att:
            axes[2].annotate(f"{r['speedup_flat']:.2f}x", (r["n"], r["flat_ms"]), fontsize=7,
                             textcoords="offset points", xytext=(0, -11), ha="center", color="tab:blue")
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("cached tokens")
    axes[2].set_ylabel("ms per decode call (one layer)")
    axes[2].set_title(f"attend vs dense, {QWEN_HEADS}q/{QWEN_KV}kv x {HEAD_DIM}")
    axes[2].grid(True, which="both", alpha=0.3)
    if results["attend"]:
        axes[2].legend(fontsize=7)
    fig.suptitle(f"SCSA on synthetic clustered keys ({results['meta']['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small grid, few repeats (< 2 minutes)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats per point")
    ap.add_argument("--tau", type=float, default=0.02, help="stop threshold for the selection part")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="selection sizes in rows (default: 32K..1M, --quick: 32K and 128K)")
    ap.add_argument("--tree-order", choices=TREE_ORDERS, default="similar",
                    help="how the hierarchical tree groups leaf clusters (SCSAConfig.tree_order)")
    ap.add_argument("--cluster-size", type=int, default=128,
                    help="leaf cluster size for part 1 (SCSAConfig.cluster_size)")
    ap.add_argument("--name", default="scsa_selection", help="results file stem")
    ap.add_argument("--no-attend", action="store_true", help="skip part 2 (attend vs dense)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.quick:
        sel_sizes, att_sizes = [32768, 131072], [4096, 16384]
        queries, repeats, calib = 4, args.repeats or 3, 16
    else:
        sel_sizes = [32768, 65536, 131072, 262144, 524288, 1 << 20]
        att_sizes = [4096, 8192, 16384, 32768]
        queries, repeats, calib = 12, args.repeats or 5, 32
    if args.sizes is not None:
        sel_sizes = args.sizes
    if any(n < 1024 for n in sel_sizes):
        print("error: --sizes must be >= 1024 rows", file=sys.stderr)
        return 2
    # Peak RSS measured 424 MB at 131,072 rows (~200 MB of it the interpreter): ~1.7 KB per row; ask for 2.5
    need_gb = max(sel_sizes) * 2560 / 2**30
    if mem_available_gb() and mem_available_gb() < need_gb:
        print(f"error: {max(sel_sizes)} rows need ~{need_gb:.1f} GB, {mem_available_gb():.1f} GB available",
              file=sys.stderr)
        return 2
    if args.no_attend:
        att_sizes = []
    results = {"meta": {"threads": args.threads, "quick": args.quick, "torch": torch.__version__,
                        "python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "tree_order": args.tree_order, "cluster_size": args.cluster_size,
                        "loadavg_start": os.getloadavg(), "repeats": repeats,
                        "queries": queries},
               "selection": [], "attend": []}
    t_start = time.perf_counter()
    for n in sel_sizes:
        for regime in REGIMES:
            r = bench_selection(n, regime, queries, repeats, args.tau, args.tree_order, args.cluster_size)
            results["selection"].append(r)
            parts = [f"{name} {r[name + '_ms']:8.3f} ms ({r[name + '_scored']:.0f} scored, "
                     f"{r[name + '_opened']:.0f} opened, err {r[name + '_median_rel_err']:.3f})"
                     for name in ("flat", "hier")]
            print(f"select {regime:8s} N={n:8d} M={r['clusters']:5d}  {parts[0]}  {parts[1]}  "
                  f"oracle {r['oracle_opened']:.0f} opened  truly uncaptured flat {r['flat_true_uncaptured']:.3f} "
                  f"hier {r['hier_true_uncaptured']:.3f}  refined: {r['refined_opened']:.0f} opened, uncaptured "
                  f"{r['refined_true_uncaptured']:.3f}, err {r['refined_median_rel_err']:.3f}  bounded: "
                  f"{r['bounded_opened']:.0f} opened, uncaptured {r['bounded_true_uncaptured']:.3f}  "
                  f"opened overestimate {r['flat_opened_overestimate_nats']:.1f} nats  "
                  f"flat/hier {r['flat_over_hier']:.2f} time, "
                  f"{r['flat_scored'] / max(r['hier_scored'], 1):.2f} scored", flush=True)
    for n in att_sizes:
        for regime in ("diffuse", "focused"):
            r = bench_attend(n, regime, queries, repeats, calib)
            results["attend"].append(r)
            parts = [f"{name} {r[name + '_ms']:7.3f} ms (x{r['speedup_' + name]:.2f}, opened "
                     f"{r[name + '_opened_frac']:.1%}, err {r[name + '_median_rel_err']:.4f})"
                     for name in ("flat", "hier")]
            print(f"attend {regime:8s} N={n:6d}  dense {r['dense_ms']:7.3f} ms  {parts[0]}  {parts[1]}",
                  flush=True)
    results["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    results["meta"]["loadavg_end"] = os.getloadavg()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    json_path.write_text(json.dumps(results, indent=1))
    plot(results, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')} ({results['meta']['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
