"""Sweeps: a grid of independent cells run serially, in local processes or as Ray tasks.

A cell is a picklable, JSON-able spec (``Cell``: experiment, model, weights, params with every
seed it uses), so its result depends on the spec alone and is the same whichever runner
computes it (for the same thread count per cell: torch's reductions may split differently
across another number of threads). Results stream into one JSON-lines file, one line per
finished cell, written by the driver process with flush + fsync: a killed run loses at most
the cells in flight. A rerun over the same file resumes: cells whose key (a hash of the spec)
is already there are not recomputed.

Runners:
    serial      the cells run in this process (``workers=1``, no Ray).
    processes   ``workers=N`` spawned processes; each loads a model once and keeps it while
                consecutive cells use it (cells are ordered by model).
    Ray         ``ray=""`` starts a local Ray (``ray.init()``), ``ray="ADDRESS"`` joins a
                cluster; every cell is one task with ``num_cpus`` = its threads. Workers on
                other nodes need longattn and the models installed there.

Each experiment module exposes ``run_cell(ctx, params) -> dict`` and is named in ``CELL_RUNNERS``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..errors import LongattnError

# experiment -> module holding ``run_cell(ctx, params)`` (imported in the process running the cell)
CELL_RUNNERS = {"retrieval": "longattn.lab.retrieval", "quality": "longattn.lab.quality"}
RAY_INSTALL = "--ray needs Ray: pip install 'longattn[ray]' (or pip install ray==2.52.0)"


@dataclass(frozen=True)
class Cell:
    """One unit of a sweep. ``params`` holds JSON values only (seeds included)."""

    experiment: str
    model: str
    params: dict = field(default_factory=dict)
    weights: str = "f32"

    def spec(self) -> dict:
        return {"experiment": self.experiment, "model": self.model, "weights": self.weights,
                "params": self.params}

    @property
    def key(self) -> str:
        """A stable 16-hex-digit hash of the spec (canonical JSON, sorted keys)."""
        text = json.dumps(self.spec(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class ModelContext:
    """What a cell runs on: the model, its tokenizer as functions, its stop tokens."""

    name: str
    config: object
    model: object
    encode: Callable[[str], list]
    decode: Callable[[list], str]
    stop_ids: frozenset


@functools.lru_cache(maxsize=1)
def model_context(model: str, weights: str = "f32") -> ModelContext:
    """Load ``model`` once per process (one held at a time: cells come ordered by model)."""
    from ..checkpoint import load_checkpoint
    from ..checkpoint.prepared import prepared_model
    ck = load_checkpoint(model, progress=False, read_weights=False)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; the lab's sweeps read text")
    tok = ck.tokenizer
    m = prepared_model(ck, weights, progress=False)
    return ModelContext(ck.name, ck.config, m, lambda s: tok(s)["input_ids"],
                        lambda ids: tok.decode(ids, skip_special_tokens=True), frozenset(ck.config.eos_token_ids))


def run_cell(cell: Cell, threads: int = 1) -> dict:
    """Compute one cell in this process with ``threads`` torch threads -> its JSON-lines record."""
    import torch
    torch.set_num_threads(threads)
    if cell.experiment not in CELL_RUNNERS:
        raise LongattnError(f"unknown sweep experiment '{cell.experiment}'; known: {', '.join(CELL_RUNNERS)}")
    runner = importlib.import_module(CELL_RUNNERS[cell.experiment]).run_cell
    t0 = time.perf_counter()
    result = runner(model_context(cell.model, cell.weights), cell.params)
    return {"key": cell.key, "cell": cell.spec(), "result": result,
            "seconds": time.perf_counter() - t0, "host": socket.gethostname()}


# ---------------------------------------------------------------- the results file

def read_records(path) -> dict:
    """``{key: record}`` of a JSON-lines results file; a torn last line (a kill mid-write) is
    cut off the file so appends start on a fresh line."""
    path = Path(path)
    if not path.exists():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    out = {}
    for line in data[:end].splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["key"]] = rec
    return out


class RecordWriter:
    """Appends one JSON line per record and forces it to disk before returning."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec, sort_keys=True, allow_nan=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


# ---------------------------------------------------------------- runners

def _init_worker(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def _serial(cells, threads) -> Iterable[dict]:
    for c in cells:
        yield run_cell(c, threads)


def _processes(cells, threads, workers) -> Iterable[dict]:
    # concurrent.futures, not multiprocessing.Pool: a worker that dies (killed, out of memory)
    # fails the sweep at once instead of leaving it waiting for the lost cell forever
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(threads,))
    try:
        pending = {ex.submit(run_cell, c, threads) for c in cells}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    yield f.result()
                except BrokenProcessPool:
                    raise LongattnError("a sweep worker process died (killed, or out of memory); "
                                        "run the same command again to resume") from None
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _ray(cells, threads, address: str) -> Iterable[dict]:
    try:
        import ray
    except ImportError:
        raise LongattnError(RAY_INSTALL) from None
    started = not ray.is_initialized()
    if started:
        import warnings
        with warnings.catch_warnings():  # Ray's notes on GPU variables do not concern CPU cells
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR")
    pending = []
    try:
        task = ray.remote(num_cpus=threads)(run_cell)
        pending = [task.remote(c, threads) for c in cells]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    except BaseException:
        for ref in pending:  # a stopped sweep leaves no task running on the cluster
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()


def run_sweep(cells: list, path, workers: int = 1, threads: int = 1, ray: Optional[str] = None,
              progress: bool = True, desc: str = "cells") -> list:
    """Run every cell of ``cells`` not yet in the JSON-lines file ``path``; return all their
    records in the order of ``cells``.

    Args:
        cells: ``Cell`` specs (duplicates run once).
        path: the JSON-lines results file (created; appended to; resumed from).
        workers: local processes (1 = this process) when ``ray`` is None.
        threads: torch threads per cell (per worker process; Ray ``num_cpus`` per task).
        ray: None = no Ray; "" = a local Ray; "ADDRESS" = an existing cluster.
        progress: a tqdm bar over the cells on stderr (ETA from the cells run so far).
    Returns:
        ``[record]``: ``{"key", "cell", "result", "seconds", "host"}`` per cell.
    """
    if workers < 1 or threads < 1:
        raise LongattnError(f"need --workers >= 1 and threads >= 1, got {workers} and {threads}")
    if ray is not None and workers > 1:
        raise LongattnError("use either --workers or --ray, not both")
    if ray is not None:
        try:
            import ray as _ray_mod  # noqa: F401 (fail before anything runs)
        except ImportError:
            raise LongattnError(RAY_INSTALL) from None
    done = read_records(path)
    order = {}
    for c in cells:
        order.setdefault(c.key, c)
    todo = sorted((c for k, c in order.items() if k not in done), key=lambda c: (c.model, c.weights))
    from .plots import progress_bar
    bar = progress_bar(len(order), desc, disable=not progress, unit="cell")
    bar.update(len(order) - len(todo))
    writer = RecordWriter(path)
    try:
        if not todo:
            stream = iter(())
        elif ray is not None:
            stream = _ray(todo, threads, ray)
        elif workers > 1:
            stream = _processes(todo, threads, min(workers, len(todo)))
        else:
            stream = _serial(todo, threads)
        for rec in stream:
            writer.write(rec)
            done[rec["key"]] = rec
            bar.update(1)
    finally:
        writer.close()
        bar.close()
    return [done[c.key] for c in cells]


def build_policy(cfg, spec: dict):
    """An AttentionPolicy from a JSON spec ``{"mode", "window", "sinks"[, "scsa": {...}]}``:
    mode as ``AttentionPolicy.build``; ``"sparse"`` builds SCSA with the ``scsa`` fields."""
    from ..policy import AttentionPolicy
    if spec["mode"] == "sparse":
        from ..sparse.config import SCSAConfig
        from ..sparse.policy import build_sparse_policy
        return build_sparse_policy(cfg, SCSAConfig(**spec.get("scsa", {})), window=spec.get("window"),
                                   sinks=spec.get("sinks", 0))
    return AttentionPolicy.build(cfg, spec["mode"], window=spec.get("window"), sinks=spec.get("sinks", 0))
