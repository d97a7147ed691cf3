"""Wall time of one retrieval grid run serially, in 2 worker processes and on a local Ray, and
Ray's cost per cell beyond the serial run.

Each runner starts from an empty results file (a temporary directory), so every cell runs;
the 2-worker run should take at most 0.6x the serial one on a 2-core machine (cells are
independent and each holds one thread). Ray's overhead per cell is
``(ray wall - serial wall) / cells`` with Ray given one CPU, so both run one cell at a time;
Ray's start-up is timed apart. Every runner also loads the model once per process, so
use a grid of many cells for the ratios to speak of the cells. Writes ``results/sweep_scaling.json``.

    python benchmarks/sweep_scaling.py --model smollm2-135m --samples 4 --distances 64,192
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import RESULTS, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="passkey")
    ap.add_argument("--distances", default="64,192")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    ap.add_argument("--out", default=str(RESULTS / "sweep_scaling.json"))
    a = ap.parse_args()
    from longattn.checkpoint import load_checkpoint
    from longattn.lab.retrieval import retrieval_cells, retrieval_policy_specs
    from longattn.lab.sweep import run_sweep
    cfg = load_checkpoint(a.model).config  # converts once, before any worker starts
    specs = retrieval_policy_specs(cfg, a.window, 0)
    cells = [c for c, _ in retrieval_cells(a.model, "f32", a.tasks.split(","), [int(d) for d in a.distances.split(",")],
                                           specs, a.samples, a.length, 42, a.max_new_tokens, 512)]
    walls, results = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in (("serial", {}), ("workers_2", {"workers": 2})):
            t0 = time.perf_counter()
            recs = run_sweep(cells, Path(tmp) / f"{name}.jsonl", threads=1, **kw)
            walls[name] = time.perf_counter() - t0
            results[name] = {r["key"]: r["result"] for r in recs}
        if not a.no_ray:
            import ray
            t0 = time.perf_counter()
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            walls["ray_start"] = time.perf_counter() - t0
            try:
                t0 = time.perf_counter()
                recs = run_sweep(cells, Path(tmp) / "ray.jsonl", threads=1, ray="")
                walls["ray_1cpu"] = time.perf_counter() - t0
                results["ray_1cpu"] = {r["key"]: r["result"] for r in recs}
            finally:
                ray.shutdown()
    same = all(r == results["serial"] for r in results.values())
    doc = {"model": a.model, "cells": len(cells), "wall_s": walls, "identical_results": same,
           "workers_2_over_serial": walls["workers_2"] / walls["serial"]}
    if "ray_1cpu" in walls:
        doc["ray_overhead_per_cell_s"] = (walls["ray_1cpu"] - walls["serial"]) / len(cells)
    print(f"{len(cells)} cells; 2 workers / serial = {doc['workers_2_over_serial']:.2f}; results identical: {same}")
    if "ray_overhead_per_cell_s" in doc:
        print(f"Ray: start {walls['ray_start']:.1f} s, {doc['ray_overhead_per_cell_s'] * 1e3:.0f} ms per cell over serial")
    print(f"wrote {write_result(a.out, doc)}")


if __name__ == "__main__":
    main()
