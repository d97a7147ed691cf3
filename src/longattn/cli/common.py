"""Options shared by every command that runs a model, and the one-line error contract."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..errors import LongattnError


def add_model_args(p: argparse.ArgumentParser, default_model: str = "smollm2-135m") -> None:
    p.add_argument("--model", default=default_model,
                   help="bundled model name (see `longattn models`), a .gguf file or an HF directory")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weight dtype of the projection matrices (activations stay float32)")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="checkpoint",
                   choices=["checkpoint", "dense", "window", "global", "sparse"],
                   help="checkpoint: trained windows; dense: none; window: --window on every layer; "
                        "global: --window on the checkpoint's global layers; sparse: SCSA decode")
    p.add_argument("--window", type=int, default=None, help="window W (keys per query incl. itself)")
    p.add_argument("--sinks", type=int, default=0, help="sink tokens always readable")


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the figures as the last line of stdout")


def setup_threads(n: int) -> None:
    if n is None or n < 1:
        raise LongattnError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)


def emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=float) + "\n")
    sys.stdout.flush()


def policy_from_args(cfg, args):
    from ..policy import AttentionPolicy
    mode = args.policy
    if args.window is not None and mode == "checkpoint":
        mode = "window"  # --window alone imposes it on every layer
    if mode == "sparse":
        from ..sparse_policy import sparse_policy  # noqa: WPS433 (wired in the SCSA module)
        return sparse_policy(cfg, args)
    return AttentionPolicy.build(cfg, mode=mode, window=args.window, sinks=args.sinks)


def load_model(args, progress: bool = True):
    """(checkpoint, model) from --model / --dtype, with a one-line error on bad input."""
    from ..checkpoint import load_checkpoint
    from ..models import build_model
    ck = load_checkpoint(args.model, progress=progress)
    dtype = torch.bfloat16 if getattr(args, "dtype", "float32") == "bfloat16" else torch.float32
    return ck, build_model(ck.config, ck.state_dict, dtype=dtype)


def run_guarded(fn, args) -> int:
    """Run a command; a LongattnError (or bad file) becomes one line on stderr and exit 2."""
    try:
        return fn(args) or 0
    except LongattnError as e:
        print(f"longattn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("longattn: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"longattn: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    except MemoryError:
        print("longattn: error: out of memory; use a smaller context, window or batch", file=sys.stderr)
        return 2
