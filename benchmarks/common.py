"""What every benchmark script shares: where results go, what each result records about the run,
and the long-prefix cache the SCSA benchmarks start from.

Scripts run as ``python benchmarks/NAME.py`` with longattn installed (``make setup``); Python
puts this folder on the import path, so ``from common import ...`` needs no path edits.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch

from longattn.cache import KVCache
from longattn.host import cpu_description

RESULTS = Path(__file__).resolve().parent / "results"


def run_record() -> dict:
    """The facts a figure needs beside it: UTC date, the command, CPU, torch, threads."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads()}


def write_result(path, doc: dict) -> Path:
    """Write ``doc`` (with ``run_record()`` merged in where the doc does not set a key) as JSON
    at ``path``, through a temporary file so a killed run leaves the previous result intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**run_record(), **doc}, indent=1, default=float))
    os.replace(tmp, path)
    return path


def load_model(args):
    """Threads set, ``(checkpoint, model in args.weights, the bundled books' token ids)``."""
    from longattn.checkpoint import load_checkpoint
    from longattn.data import all_books_text
    from longattn.models import build_model
    torch.set_num_threads(args.threads)
    ck = load_checkpoint(args.model)
    model = build_model(ck.config, ck.state_dict, weights=args.weights)
    return ck, model, ck.tokenizer(all_books_text())["input_ids"]


def truncate(cache: KVCache, n: int) -> None:
    """Cut every layer of ``cache`` back to its first ``n`` positions."""
    for layer in cache.layers:
        layer.truncate(n)
    cache.next_pos = torch.full_like(cache.next_pos, n)


def extend_prefix(model, cache, policy, ids, start, n, chunk):
    """Prefill the tokens ``ids[start:n]`` into ``cache`` (holding ``start`` of them) in
    ``chunk``-token pieces, with progress on stderr."""
    for s in range(start, n, chunk):
        model(torch.tensor([ids[s:min(n, s + chunk)]]), cache=cache, policy=policy, logits="none")
        print(f"\rprefill {min(n, s + chunk)}/{n}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def prefix_cache(model, cfg, ids, n, chunk, path):
    """The n-token prefix cache of ``ids``: loaded from ``path`` when it holds one at least that
    long (cut back to n), else prefilled in ``chunk``-token pieces and, with a ``path``, saved
    there (written aside and renamed, so a killed run leaves no half file). The file must come
    from the same model and weight format."""
    from longattn.policy import AttentionPolicy
    if path and os.path.exists(path):
        cache = torch.load(path, weights_only=False)
        have = int(cache.next_pos.max())
        if have >= n:
            truncate(cache, n)
            return cache
        print(f"{path} holds {have} tokens, fewer than {n}: prefilling", file=sys.stderr)
    cache = KVCache(cfg, 1)
    extend_prefix(model, cache, AttentionPolicy.from_config(cfg), ids, 0, n, chunk)
    if path:
        tmp = f"{path}.tmp"
        torch.save(cache, tmp)
        os.replace(tmp, path)
    return cache
