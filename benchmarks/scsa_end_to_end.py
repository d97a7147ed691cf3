"""What `generate --policy sparse` costs a user, end to end: process start to the n-th new token,
dense against sparse, same prompt, default weights, alternated runs.

Each run is a fresh process: ``longattn generate --model M --prompt-file F --max-new-tokens N
--policy dense|sparse --threads T --json --token-trace``. ``--token-times`` reports each new
token's time since process start, so one run of the largest N gives the wall time a user asking
for any smaller n would wait (the same prefill, the same first n steps; the process exits as
soon as its output is flushed). Agreement is the share of the first n tokens generated before
the sparse run's first greedy pick that differs from the dense run of the same round.

Before the timed rounds, one sparse run calibrates and keeps its taus in the cache (its own
figures are reported as ``sparse-first-run``); the timed sparse runs reuse them, as every run
after a user's first does. Each run's JSON carries the sparse layers' index time inside the
prefill and the decode, and the calibration time.

    python benchmarks/scsa_end_to_end.py --threads 2 --contexts 16384 --new-tokens 64 256 1024

Writes benchmarks/results/scsa_end_to_end.json. Never run it beside tests or builds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, write_result


def run(cmd: list, env: dict) -> dict:
    """One generate process: its JSON summary (the last stdout line)."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed ({p.returncode}): {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def tokens_of(tok, text: str) -> list:
    return tok(text)["input_ids"]


def _agreed_prefix(dense: list, sparse: list, n: int) -> float:
    """The share of the first n tokens both runs generate before their first different greedy
    pick (free-running: after a difference each continues its own text, so later positions
    are not comparable)."""
    same = 0
    for a, b in zip(dense[:n], sparse[:n]):
        if a != b:
            break
        same += 1
    return same / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--contexts", nargs="+", type=int, default=[16384])
    ap.add_argument("--new-tokens", nargs="+", type=int, default=[64, 256, 1024])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="timed (dense, sparse) pairs per context")
    ap.add_argument("--out", default=str(RESULTS / "scsa_end_to_end.json"))
    args = ap.parse_args()

    from longattn.checkpoint import load_checkpoint
    from longattn.data import all_books_text
    ck = load_checkpoint(args.model, progress=False, read_weights=False)
    text = all_books_text()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    longattn_bin = str(Path(sys.executable).with_name("longattn"))
    n_max = max(args.new_tokens)
    work = Path(tempfile.mkdtemp(prefix="scsa-e2e-"))
    rows = []
    try:
        for T in args.contexts:
            ids = tokens_of(ck.tokenizer, text[: T * 8])[:T]
            f = work / f"prompt-{T}.txt"
            f.write_text(ck.tokenizer.decode(ids, skip_special_tokens=True), encoding="utf-8")

            def cmd(policy, n, *extra):
                return [longattn_bin, "generate", "--model", args.model, "--prompt-file", str(f),
                        "--max-new-tokens", str(n), "--policy", policy, "--threads", str(args.threads),
                        "--json", "--token-trace", *extra]
            first = run(cmd("sparse", 40, "--sparse-calibrate"), env)  # calibrates, keeps the taus
            print(f"T={T} sparse first run: prefill {first['prefill_s']:.1f} s, {first['sparse']}", flush=True)
            got = {"dense": [], "sparse": []}
            for r in range(args.rounds):
                for policy in ("dense", "sparse"):
                    doc = run(cmd(policy, n_max), env)
                    got[policy].append(doc)
                    print(f"T={T} {policy} round {r}: prefill {doc['prefill_s']:.1f} s, decode "
                          f"{doc['decode_tok_s']:.1f} tok/s, {doc.get('sparse', '')}", flush=True)
            row = {"context": T, "prompt_tokens": first["prompt_tokens"], "sparse_first_run": first, "by_n": {}}
            for n in args.new_tokens:
                cell = {}
                for policy, docs in got.items():
                    walls = [d["token_times_s"][n - 1] for d in docs if len(d["token_times_s"]) >= n]
                    cell[policy] = {"wall_to_token_n_s": statistics.median(walls) if walls else None}
                agree = [_agreed_prefix(d["token_ids"], s["token_ids"], n) for d, s in zip(got["dense"], got["sparse"])]
                w = {p: c["wall_to_token_n_s"] for p, c in cell.items()}
                cell["sparse_over_dense_wall"] = w["sparse"] / w["dense"] if w["sparse"] and w["dense"] else None
                cell["agreed_prefix"] = agree
                row["by_n"][n] = cell
                print(f"T={T} n={n}: dense {w['dense']:.1f} s, sparse {w['sparse']:.1f} s, "
                      f"ratio {cell['sparse_over_dense_wall']:.3f}", flush=True)
            for policy, docs in got.items():
                row[policy] = [{k: v for k, v in d.items() if k not in ("text", "token_times_s", "token_ids")}
                               for d in docs]
                row[policy + "_token_times_s"] = [d["token_times_s"] for d in docs]
                row[policy + "_text"] = [d["text"] for d in docs]
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, {"model": args.model, "threads": args.threads, "rounds": args.rounds, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
