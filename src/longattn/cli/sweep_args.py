"""Options of the lab commands that run as sweeps (--workers, --threads-per-worker, --ray) and
the Markdown page each writes beside its JSON and PNG."""

from __future__ import annotations

import argparse

from ..errors import LongattnError


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep", "cells run serially, in local processes or on Ray; results stream into "
                                      "--out/STEM.cells.jsonl and a rerun with the same --out resumes")
    g.add_argument("--workers", type=int, default=1,
                   help="local worker processes (each loads the model once)")
    g.add_argument("--threads-per-worker", type=int, default=None, metavar="T",
                   help="torch threads per cell (default: --threads / --workers; 1 with --ray); results are "
                        "identical across runners for the same T")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run cells as Ray tasks (num_cpus = T each): a local Ray without ADDRESS, else the "
                        "cluster at ADDRESS (e.g. auto or ray://head:10001)")


def sweep_settings(args) -> dict:
    """``run_sweep`` keyword arguments (workers, threads, ray) from the parsed options."""
    if args.workers < 1:
        raise LongattnError(f"--workers must be >= 1, got {args.workers}")
    if args.ray is not None and args.workers > 1:
        raise LongattnError("use either --workers or --ray, not both")
    t = args.threads_per_worker
    if t is None:
        t = 1 if args.ray is not None else max(1, args.threads // args.workers)
    if t < 1:
        raise LongattnError(f"--threads-per-worker must be >= 1, got {t}")
    return {"workers": args.workers, "threads": t, "ray": args.ray}


def load_sweep_checkpoint(args, needs: str):
    """The checkpoint of --model (converted here once, so workers find it cached), refused
    without a tokenizer; its weights are not read: the cells load the model themselves."""
    from ..checkpoint import load_checkpoint
    from ..models.weights import parse_recipe
    parse_recipe(args.weights)  # a bad --weights fails before the slow load
    ck = load_checkpoint(args.model, read_weights=False)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; {needs}")
    return ck


def save_markdown(out, stem: str, title: str, notes, table) -> None:
    """Write ``out/stem.md`` (title, notes, ``table`` = (headers, rows), the PNG) and say so."""
    from ..lab.report import write_markdown
    path = write_markdown(out / f"{stem}.md", title, notes, *table, png=out / f"{stem}.png")
    print(f"wrote {path}")
