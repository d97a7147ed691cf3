"""What a user waits for: process start to last token, longattn with default flags against
llama.cpp on the same GGUF file, alternated in one run.

Each run is a fresh process, as a user starts it:
  * longattn: ``longattn generate --model M --prompt-file F --max-new-tokens N --threads T --json``
    with no other flag (the default weights, policy and step);
  * llama.cpp: a Python process importing llama-cpp-python (``--llamacpp-python``, a venv
    where it is installed: the ``bench`` extra), loading the same GGUF with the same threads,
    evaluating the prompt and sampling greedily.
Both report (from inside) time to first token counted from process start, prefill and decode
tok/s; the driver measures wall time (spawn to exit) and peak RSS (``wait4``) itself. Prompts
are book text cut to ``--prompts`` tokens (longattn's tokenizer; llama.cpp tokenizes the same
text itself, so its count is reported beside). A first untimed run of each arm per model
warms the page cache and longattn's prepared-weights cache: the figures are warm starts;
``--cold`` times one run per model with an empty ``$LONGATTN_CACHE`` first (after building
the C++ kernels into the environment where they are not, as ``make setup`` does). ``--window W``
adds an arm on prompts longer than W: longattn with ``--policy global --window W --sinks 4``
(the layers the checkpoint leaves global read W keys and 4 sinks; trained windows stay).
The default step is the one built ahead of time: the untimed round 0 builds it (``--cold``
includes its build), so the timed runs load it. ``--eager`` adds an arm decoding with the
eager step (``--compile none``), ``--kv F ...`` an arm per KV pool format (``--kv F``).

    python benchmarks/first_token.py --threads 2 --llamacpp-python /path/to/venv/bin/python

Writes benchmarks/results/first_token.json. Never run it beside tests or builds.
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
import time
from pathlib import Path

from common import RESULTS, write_result

# Run by the llama.cpp arm's interpreter: argv = gguf, prompt file, new tokens, threads, n_ctx
# (the context it allocates: the prompt and the new tokens plus a margin, as a user sizes -c;
# n_ctx=0 would allocate the model's whole trained context and inflate its RSS).
LLAMACPP_DRIVER = r"""
import json, os, sys, time
def age():
    up = float(open("/proc/uptime").read().split()[0])
    start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    return up - start / os.sysconf("SC_CLK_TCK")
import llama_cpp
gguf, prompt_file, n, threads, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
text = open(prompt_file, encoding="utf-8").read()
t0 = time.perf_counter()
llm = llama_cpp.Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512, verbose=False)
ids = llm.tokenize(text.encode(), add_bos=True)
llm.n_ctx() >= len(ids) + n or sys.exit("prompt too long")
load_s = time.perf_counter() - t0
t0 = time.perf_counter()
llm.eval(ids)
tok = llm.sample(temp=0.0)
prefill_s = time.perf_counter() - t0
first = age()
t0 = time.perf_counter()
new = 1
while new < n and tok != llm.token_eos():
    llm.eval([tok])
    tok = llm.sample(temp=0.0)
    new += 1
decode_s = time.perf_counter() - t0
print(json.dumps({"prompt_tokens": len(ids), "new_tokens": new, "load_s": load_s, "prefill_s": prefill_s,
                  "decode_s": decode_s, "prefill_tok_s": len(ids) / prefill_s,
                  "decode_tok_s": (new - 1) / decode_s if decode_s > 0 else None,
                  "first_token_after_start_s": first}))
"""


def run_measured(cmd: list, env: dict) -> dict:
    """Run ``cmd``: its last stdout line as JSON, plus wall seconds (spawn to exit) and the
    child's own peak RSS (wait4)."""
    t0 = time.perf_counter()
    out_f = tempfile.TemporaryFile(mode="w+")
    err_f = tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    p.returncode = code  # reaped here: Popen must not wait for it again
    out_f.seek(0), err_f.seek(0)
    out, err = out_f.read(), err_f.read()
    if code:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed ({code}): {err.strip()[-500:]}")
    doc = json.loads(out.strip().splitlines()[-1])
    doc.pop("text", None)
    doc["wall_s"] = wall
    doc["peak_rss_bytes"] = usage.ru_maxrss * 1024
    return doc


def prompt_file(tok, text: str, n: int, d: Path, name: str) -> Path:
    """A file holding the first ``n`` tokens of ``text`` (as text)."""
    ids = tok(text[: n * 8])["input_ids"][:n]
    p = d / f"{name}-{n}.txt"
    p.write_text(tok.decode(ids, skip_special_tokens=True), encoding="utf-8")
    return p


def med(rows: list, key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 8000], help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each arm (alternated)")
    ap.add_argument("--llamacpp-python", default=None,
                    help="interpreter with llama-cpp-python installed (default: skip that arm)")
    ap.add_argument("--cold", action="store_true",
                    help="first time one run per model with an empty LONGATTN_CACHE")
    ap.add_argument("--window", type=int, default=None,
                    help="add a window + 4 sinks arm on prompts longer than this window")
    ap.add_argument("--eager", action="store_true",
                    help="add an arm decoding with the eager step (--compile none)")
    ap.add_argument("--kv", nargs="*", default=[], choices=["f32", "bf16", "int8"],
                    help="add an arm per KV pool format (generate --kv F)")
    ap.add_argument("--out", default=str(RESULTS / "first_token.json"))
    args = ap.parse_args()

    from longattn.checkpoint import load_checkpoint
    from longattn.data import all_books_text
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    longattn_bin = str(Path(sys.executable).with_name("longattn"))
    text = all_books_text()
    rows, cold = [], {}
    if args.cold:  # a cold run starts from an installed environment: its kernels built at set-up
        subprocess.run([sys.executable, "-m", "longattn.ops.native"], env=env, check=False)
    work = Path(tempfile.mkdtemp(prefix="first-token-"))
    try:
        for name in args.models:
            ck = load_checkpoint(name, progress=False, read_weights=False)
            if args.cold:
                cache = work / "cold-cache"
                cold_env = dict(env, LONGATTN_CACHE=str(cache))
                f = prompt_file(ck.tokenizer, text, args.prompts[0], work, name)
                cold[name] = run_measured([longattn_bin, "generate", "--model", name, "--prompt-file", str(f),
                                           "--max-new-tokens", str(args.new_tokens), "--threads",
                                           str(args.threads), "--json"], cold_env)
                shutil.rmtree(cache, ignore_errors=True)
                print(f"{name}: cold first run {cold[name]['wall_s']:.1f} s", flush=True)
            for n in args.prompts:
                n = min(n, ck.config.max_context - args.new_tokens - 16)
                f = prompt_file(ck.tokenizer, text, n, work, name)
                arms = {"longattn": [longattn_bin, "generate", "--model", name, "--prompt-file", str(f),
                                     "--max-new-tokens", str(args.new_tokens), "--threads", str(args.threads),
                                     "--json"]}
                for kv in args.kv:
                    arms[f"longattn-kv-{kv}"] = arms["longattn"][:-1] + ["--kv", kv, "--json"]
                if args.eager:
                    arms["longattn-eager"] = arms["longattn"][:-1] + ["--compile", "none", "--json"]
                if args.window and n > args.window:
                    arms["longattn-window"] = arms["longattn"][:-1] + [
                        "--policy", "global", "--window", str(args.window), "--sinks", "4", "--json"]
                if args.llamacpp_python:
                    arms["llama.cpp"] = [args.llamacpp_python, "-c", LLAMACPP_DRIVER, str(ck.source), str(f),
                                         str(args.new_tokens), str(args.threads), str(n + args.new_tokens + 64)]
                got = {a: [] for a in arms}
                for r in range(args.rounds + 1):  # round 0 warms the caches and is dropped
                    for arm, cmd in arms.items():
                        doc = run_measured(cmd, env)
                        if r:
                            got[arm].append(doc)
                        print(f"{name} T={n} {arm} round {r}: wall {doc['wall_s']:.2f} s, decode "
                              f"{doc['decode_tok_s']:.1f} tok/s, rss {doc['peak_rss_bytes'] / 2**30:.2f} GiB",
                              flush=True)
                row = {"model": name, "prompt_tokens": n, "arms": {}}
                for arm, docs in got.items():
                    row["arms"][arm] = {k: med(docs, k) for k in
                                        ("wall_s", "first_token_after_start_s", "load_s", "prefill_tok_s",
                                         "decode_tok_s", "peak_rss_bytes", "prompt_tokens", "new_tokens")}
                    row["arms"][arm]["runs"] = docs
                if "llama.cpp" in row["arms"]:
                    b = row["arms"]["llama.cpp"]
                    for arm in [a for a in row["arms"] if a.startswith("longattn")]:
                        a = row["arms"][arm]
                        ratios = {  # longattn / llama.cpp; > 1 is better for tok/s, worse for s and bytes
                            k: a[k] / b[k] for k in ("wall_s", "first_token_after_start_s", "prefill_tok_s",
                                                     "decode_tok_s", "peak_rss_bytes") if a[k] and b[k]}
                        row["ratios" if arm == "longattn" else f"ratios_{arm}"] = ratios
                        print(f"{name} T={n} {arm}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()),
                              flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, {"threads": args.threads, "new_tokens": args.new_tokens, "rounds": args.rounds,
                            "cold_first_run": cold, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
