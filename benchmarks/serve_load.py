"""Load on `longattn serve`: N concurrent clients, each holding a multi-turn chat.

For each client count, every client streams ``--turns`` chat turns (each turn appends the
reply and a new user message, so later turns share a growing prefix with the earlier ones)
and the run records: aggregate decode tokens/s (completion tokens of all clients over the
wall time), p50/p99 time to first token and inter-token latency, the server's peak RSS, its
prefix-cache hit rate (from /metrics) and errors (any failed request counts).

The same load runs against llama.cpp's OpenAI server (``python -m llama_cpp.server``,
llama-cpp-python, the ``bench`` extra) on the same GGUF in the same run when llama_cpp
imports (or in ``--llamacpp-python``'s interpreter); otherwise that arm is skipped with a note in
the JSON. Both servers run on loopback, started and stopped by this script, and stay up for the
whole run: each client count's load runs against one, then the other (alternated), so a drift
of the machine falls on both arms alike.

    python benchmarks/serve_load.py --model smollm2-135m --clients 1,4,16 --turns 3
    python benchmarks/serve_load.py --clients 1 --turns 2 --max-tokens 4   # smoke
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]

TOPICS = ["the sea", "a lighthouse", "winter in a small town", "the first train", "a lost key",
          "an old map", "the night market", "a letter never sent"]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"server at {url} did not come up in {seconds:.0f} s")


def rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` (Linux), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib(pid: int) -> float:
    """VmHWM of ``pid`` (Linux), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(url: str) -> dict:
    """The unlabelled samples of a Prometheus text page (name -> value)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def client_chat(base: str, model: str, turns: int, max_tokens: int, topic: str, rec: dict, lock) -> None:
    """One client's conversation, streamed turn by turn; records latencies into ``rec``."""
    import openai
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    msgs = [{"role": "user", "content": f"Tell me a short story about {topic}."}]
    for turn in range(turns):
        t0 = time.perf_counter()
        first, last, parts, usage = None, None, [], None
        gaps = []
        try:
            for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
                now = time.perf_counter()
                if ch.choices and ch.choices[0].delta.content:
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    parts.append(ch.choices[0].delta.content)
                usage = ch.usage or usage
        except Exception as e:  # every failure is counted, none stops the run
            with lock:
                rec["errors"].append(f"{type(e).__name__}: {e}")
            return
        with lock:
            if first is None:  # an answer without text is a failure too (e.g. a cancelled request)
                rec["errors"].append("empty reply")
                return
            rec["ttft"].append(first - t0)
            rec["ttft_by_turn"].setdefault(turn, []).append(first - t0)
            rec["itl"].extend(gaps)
            rec["tokens"] += usage.completion_tokens if usage else len(parts)
        msgs += [{"role": "assistant", "content": "".join(parts)},
                 {"role": "user", "content": "Go on, and keep it short."}]


def pct(xs: list, q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_load(base: str, model: str, pid: int, clients: int, turns: int, max_tokens: int,
             metrics_url: str | None) -> dict:
    before = scrape(metrics_url) if metrics_url else {}
    rec = {"ttft": [], "itl": [], "tokens": 0, "errors": [], "ttft_by_turn": {}}
    lock = threading.Lock()
    ths = [threading.Thread(target=client_chat, args=(base, model, turns, max_tokens,
                                                      TOPICS[i % len(TOPICS)], rec, lock)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    after = scrape(metrics_url) if metrics_url else {}
    out = {"clients": clients, "turns": turns, "max_tokens": max_tokens, "wall_s": wall,
           "completion_tokens": rec["tokens"], "decode_tok_s": rec["tokens"] / wall if wall > 0 else float("nan"),
           "ttft_p50_s": pct(rec["ttft"], 0.5), "ttft_p99_s": pct(rec["ttft"], 0.99),
           "itl_p50_s": pct(rec["itl"], 0.5), "itl_p99_s": pct(rec["itl"], 0.99),
           "ttft_p50_by_turn_s": {t: pct(v, 0.5) for t, v in sorted(rec["ttft_by_turn"].items())},
           "peak_rss_mib": peak_rss_mib(pid), "errors": len(rec["errors"]), "error_samples": rec["errors"][:3]}
    if metrics_url:
        q = after.get("longattn_prefix_cache_queries_total", 0) - before.get("longattn_prefix_cache_queries_total", 0)
        h = after.get("longattn_prefix_cache_hits_total", 0) - before.get("longattn_prefix_cache_hits_total", 0)
        out["prefix_hit_rate"] = h / q if q else float("nan")
        out["kv_blocks_used_after"] = after.get("longattn_kv_blocks_used")
    return out


def start(cmd: list, env: dict) -> subprocess.Popen:
    # the server's log goes to a file: a pipe nobody reads fills up (llama.cpp logs ~100 KB while
    # loading) and blocks the server
    log = tempfile.TemporaryFile(mode="w+")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, text=True)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Server:
    """One server process on a loopback port, started and stopped by this script."""

    def __init__(self, name: str, cmd: list, port: int, metrics: bool):
        self.name, self.metrics = name, metrics
        self.base = f"http://127.0.0.1:{port}"
        self.proc = start(cmd, dict(os.environ, PYTHONPATH=str(ROOT / "src")))
        wait_up(self.base + ("/health" if metrics else "/v1/models"), self.proc)

    def load(self, model_id: str, clients: int, args) -> dict:
        r = run_load(self.base, model_id, self.proc.pid, clients, args.turns, args.max_tokens,
                     self.base + "/metrics" if self.metrics else None)
        print(f"{self.name:9s} clients={clients:3d} decode {r['decode_tok_s']:8.1f} tok/s  ttft p50 "
              f"{r['ttft_p50_s'] * 1e3:7.0f} ms p99 {r['ttft_p99_s'] * 1e3:7.0f} ms  itl p50 "
              f"{r['itl_p50_s'] * 1e3:6.1f} ms  rss {r['peak_rss_mib']:7.0f} MiB  errors {r['errors']}",
              flush=True)
        return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or .gguf path")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64, help="reply tokens per turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=None, help="serve with this window on every layer")
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--skip-llama", action="store_true", help="run longattn's arm only")
    ap.add_argument("--llamacpp-python", default=None,
                    help="interpreter with llama-cpp-python[server] installed (default: this one)")
    ap.add_argument("--out", default=str(RESULTS / "serve_load.json"))
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]

    from longattn.checkpoint.bundled import resolve_model
    name, src = resolve_model(args.model)
    doc = {"model": name, "source": str(src), "threads": args.threads, "window": args.window, "sinks": args.sinks,
           "clients": args.clients, "turns": args.turns, "max_tokens": args.max_tokens, "arms": {}}

    port = free_port()
    cmd = [sys.executable, "-m", "longattn.cli.main", "serve", "--model", args.model, "--port", str(port),
           "--threads", str(args.threads), "--max-batch", str(max(args.clients)),
           "--served-name", name]
    if args.window:
        cmd += ["--window", str(args.window), "--sinks", str(args.sinks)]
    servers = {}
    try:
        servers["longattn"] = Server("longattn", cmd, port, metrics=True)
        llama_py = args.llamacpp_python or sys.executable
        has_llama = subprocess.run([llama_py, "-c", "import llama_cpp.server"], capture_output=True).returncode == 0
        if args.skip_llama:
            doc["arms"]["llama.cpp"] = {"skipped": "--skip-llama"}
        elif not has_llama or src.suffix != ".gguf":
            why = (f"{llama_py} cannot import llama_cpp.server (pip install 'llama-cpp-python[server]')"
                   if not has_llama else f"{src} is not a single GGUF file")
            print(f"llama.cpp arm skipped: {why}", file=sys.stderr)
            doc["arms"]["llama.cpp"] = {"skipped": why}
        else:
            port = free_port()
            servers["llama.cpp"] = Server("llama.cpp", [
                llama_py, "-m", "llama_cpp.server", "--model", str(src), "--model_alias", name,
                "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads),
                "--n_threads_batch", str(args.threads), "--n_ctx", "8192",
                # by default a new request cancels the running one: concurrent clients would
                # then get empty replies; queued, each gets its answer
                "--interrupt_requests", "False"], port, metrics=False)
        # both servers stay up (idle between loads); each client count runs on one, then the other
        runs = {n: [] for n in servers}
        for clients in args.clients:
            for n, srv in servers.items():
                runs[n].append(srv.load(name, clients, args))
        for n in servers:
            doc["arms"][n] = {"runs": runs[n]}
    finally:
        for srv in servers.values():
            stop(srv.proc)
    if "llama.cpp" in servers:
        ours, theirs = doc["arms"]["longattn"]["runs"], doc["arms"]["llama.cpp"]["runs"]
        doc["ratios"] = [{"clients": a["clients"], "decode_tok_s": a["decode_tok_s"] / b["decode_tok_s"]
                          if b["decode_tok_s"] else float("nan"),
                          "ttft_p50": a["ttft_p50_s"] / b["ttft_p50_s"] if b["ttft_p50_s"] else float("nan")}
                         for a, b in zip(ours, theirs)]
        for r in doc["ratios"]:
            print(f"clients={r['clients']:3d}: longattn / llama.cpp decode throughput {r['decode_tok_s']:.2f}x, "
                  f"ttft p50 {r['ttft_p50']:.2f}x")

    out = write_result(args.out, doc)  # with the date, command, CPU and threads beside the figures
    print(f"wrote {out}")
    errors = sum(r["errors"] for a in doc["arms"].values() for r in a.get("runs", []))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
