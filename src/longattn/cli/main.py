"""`longattn` entry point: subcommands register themselves from small modules."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command name -> module under longattn.cli that defines add_parser(subparsers)
COMMANDS = ["generate", "models", "demo", "stream", "quality", "receptive", "cache_cmd", "scaling",
            "sinks", "retrieval", "report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longattn", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run pretrained decoder LLMs over long contexts with bounded attention.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"longattn.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"longattn.cli.{name}":
                continue  # command not built yet
            raise
        mod.add_parser(sub)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .common import run_guarded
    return run_guarded(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
