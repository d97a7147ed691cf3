"""`longattn demo`: the main job `make demo` runs.

1. Generate from a built-in prompt on the default bundled model, streaming the text.
2. Stream a few thousand tokens of a bundled book through the model with window + sinks
   beside full attention, and print bits/token, tok/s and cache bytes for both.
"""

from __future__ import annotations

import argparse
import importlib

from .common import add_json_arg


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the main job: generate, then stream a book windowed vs full",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or checkpoint path")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")
    p.add_argument("--stream-tokens", type=int, default=3000, help="book tokens to stream (0 = skip)")
    p.add_argument("--window", type=int, default=256, help="window for the bounded stream")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens for the bounded stream")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from . import generate as gen_cmd
    from .main import build_parser
    # generate's own parser fills in every option it has (a hand-built Namespace fell behind
    # when generate gained --compile and --weights, and `make demo` failed)
    gargs = build_parser().parse_args(["generate", "--model", args.model, "--threads", str(args.threads),
                                       "--max-new-tokens", str(args.max_new_tokens)])
    print(f"== generate ({args.model}, greedy, built-in prompt)")
    rc = gen_cmd.run(gargs)
    if rc or args.stream_tokens <= 0:
        return rc
    try:
        stream_cmd = importlib.import_module("longattn.cli.stream")
    except ModuleNotFoundError:
        return 0
    return stream_cmd.demo_compare(args)
