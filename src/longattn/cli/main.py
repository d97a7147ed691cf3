"""`longattn` entry point: subcommands register themselves from small modules."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from . import interrupt

# command name -> module under longattn.cli that defines add_parser(subparsers)
COMMANDS = ["generate", "models", "demo", "stream", "quality", "receptive", "cache_cmd", "scaling",
            "sinks", "retrieval", "serve", "report"]


class OneLineParser(argparse.ArgumentParser):
    """argparse with the CLI's error contract: a bad option is one line, exit 2."""

    def error(self, message):
        sys.stderr.write(f"longattn: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"longattn: warning: {message}\n"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
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


# Commands that end the process as soon as their output is flushed (entry): tearing down
# torch, the tokenizer and a mapped model takes ~0.8 s of a 3 s generate, and nothing they
# leave needs an exit handler (no pools, servers or temporaries outlive run()).
FAST_EXIT = ("generate", "stream", "models")
_last_command: list = []


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shown = warnings.formatwarning
    warnings.formatwarning = _one_line_warning  # the CLI's warnings are one line each, too
    handler = interrupt.install()
    try:
        try:  # Ctrl-C while torch and the commands import is one line as well
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "func", None):
                parser.print_help()
                return 2
            from .common import run_guarded
        except (KeyboardInterrupt, Exception) as e:
            if isinstance(e, KeyboardInterrupt) or interrupt.received():
                return _interrupted()
            raise
        _last_command[:] = [args.command]
        try:
            return run_guarded(args.func, args)
        except Exception:
            if interrupt.received():  # e.g. an import the interrupt cut in half
                return _interrupted()
            raise
    finally:
        warnings.formatwarning = shown
        interrupt.restore(handler)


def _interrupted() -> int:
    print("longattn: interrupted", file=sys.stderr)
    return 130


def entry() -> None:
    """The ``longattn`` console script: ``main()``, then a prompt exit for FAST_EXIT commands."""
    code = main()
    if _last_command and _last_command[0] in FAST_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
