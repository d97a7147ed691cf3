"""One stream's decode rate through the server's engine against `longattn generate`'s, on the
same held-out prompt, arms alternated, each measurement in a fresh process.

    python benchmarks/serve_vs_generate.py --threads 2 [--model smollm2-135m] [--tokens 512] [--new 64] [--rounds 5]

Arms (each a fresh process per round, so no arm inherits another's threads or caches):
  generate     the decode path `longattn generate` takes by default: eager prefill loaded into
               a bfloat16 paged pool, then the server's compiled step (engine/paged_step.py,
               PagedDecoder);
  generate-static  the same prefill, then the fixed-shape step built ahead of time for the
               policy (engine/static_step.py, engine/aot_step.py; what `generate` takes for
               models the paged step cannot run);
  serve        the serving engine as `longattn serve` runs it by default: the compiled paged step
               (engine/paged_step.py) over a bfloat16 pool, the model and engine made and driven off the
               main thread as the CLI does;
  serve-eager  the same engine with `--compile none` (the eager model over the same pool).
Each arm decodes ``--new`` greedy tokens after a ``--tokens``-token book passage (one passage per
round, taken from the bundled books) and reports tokens/s from its first to its last generated
token. Prints each arm's median and the ratios serve / generate, serve / serve-eager and
generate / generate-static; writes
benchmarks/results/serve_vs_generate.json. Packages are built (once) before the first round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ARMS = ("generate", "generate-static", "serve", "serve-eager")


def rate(stamps: list) -> float:
    """Tokens/s between the first and the last of ``stamps`` [(time, tokens so far)]."""
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return (n1 - n0) / (t1 - t0)


def run_generate(ck, model, ids: list, new: int, static: bool) -> float:
    from longattn.engine.paged_step import PagedDecoder
    from longattn.engine.sampling import SamplingConfig
    from longattn.engine.session import generate
    from longattn.engine.static_step import StaticDecoder
    from longattn.policy import AttentionPolicy
    policy, max_len = AttentionPolicy.from_config(ck.config), len(ids) + new
    session = StaticDecoder(model, policy, max_len=max_len, compile="aot") if static else \
        PagedDecoder(model, policy, max_len=max_len, kv_dtype=torch.bfloat16)
    stamps: list = []
    generate(session, [ids], new, SamplingConfig(), stop_ids=set(),
             on_token=lambda b, t: stamps.append((time.perf_counter(), len(stamps) + 1)))
    return rate(stamps)


def run_serve(model_name: str, ids: list, new: int, compile: str) -> float:
    """One request through the engine, made and driven from a thread of its own: the main thread
    runs no PyTorch op at all, as in `longattn serve` (cli/serve.py), since a second thread's
    OpenMP team makes every parallel region of the engine's step wake its workers from sleep
    (~3x slower steps on 2 cores)."""
    from kv_speed import decode_rate

    from longattn.checkpoint import load_checkpoint
    from longattn.checkpoint.prepared import prepared_model
    from longattn.policy import AttentionPolicy
    box: dict = {}

    def run():
        ck = load_checkpoint(model_name, progress=False, read_weights=False)
        model = prepared_model(ck, "auto", progress=False)
        box["tok_s"] = decode_rate(model, ck.tokenizer, AttentionPolicy.from_config(ck.config), ids, new, "bf16",
                                   compile=compile)
    th = threading.Thread(target=run)
    th.start()
    th.join()
    return box["tok_s"]


def one_arm(args) -> None:
    """The child: one measurement of ``args.arm``, printed as JSON."""
    torch.set_num_threads(args.threads)
    ids = json.loads(Path(args.ids).read_text())
    if args.arm.startswith("generate"):  # on the main thread, as `longattn generate` runs
        from longattn.checkpoint import load_checkpoint
        from longattn.checkpoint.prepared import prepared_model
        ck = load_checkpoint(args.model, progress=False, read_weights=False)
        tps = run_generate(ck, prepared_model(ck, "auto", progress=False), ids, args.new,
                           static=args.arm == "generate-static")
    else:
        tps = run_serve(args.model, ids, args.new, "aot" if args.arm == "serve" else "none")
    print(json.dumps({"arm": args.arm, "tok_s": tps}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # the child's role
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_vs_generate.json"))
    args = ap.parse_args()
    if args.arm:
        one_arm(args)
        return 0
    import tempfile

    from common import write_result
    from weights_quality import passages

    from longattn.checkpoint import load_checkpoint
    ck = load_checkpoint(args.model, progress=False)
    texts = passages(ck.tokenizer, args.tokens, args.rounds)
    rates: dict = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        def measure(arm: str, ids: list) -> float:
            path = Path(tmp) / "ids.json"
            path.write_text(json.dumps(ids))
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--ids", str(path), "--model", args.model,
                                  "--new", str(args.new), "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True)
            return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]

        for arm in ARMS:  # build (or load) every package once before anything is timed
            measure(arm, texts[0][1][:32])
        for r in range(args.rounds):
            ids = texts[r % len(texts)][1]
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                rates[arm].append(measure(arm, ids))
                print(f"round {r} {arm:12s} {rates[arm][-1]:.1f} tok/s", flush=True)
    med = {a: statistics.median(v) for a, v in rates.items()}
    ratios = {"serve_over_generate": med["serve"] / med["generate"],
              "serve_over_serve_eager": med["serve"] / med["serve-eager"],
              "generate_over_generate_static": med["generate"] / med["generate-static"]}
    print("median tok/s: " + ", ".join(f"{a} {v:.1f}" for a, v in med.items()))
    print("serve / generate %.3f, serve / serve-eager %.3f, generate / generate-static %.3f"
          % (ratios["serve_over_generate"], ratios["serve_over_serve_eager"], ratios["generate_over_generate_static"]))
    print("wrote", write_result(args.out, {"model": args.model, "prompt_tokens": args.tokens, "new_tokens": args.new,
                                           "threads": args.threads, "rounds": rates, "median_tok_s": med,
                                           **ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
