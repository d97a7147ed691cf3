"""How long `longattn serve` keeps other clients waiting while one client sends a huge request.

    python benchmarks/serve_health.py --threads 2 [--model smollm2-135m]

Starts the server (default flags but ``--threads``), then for each request below sends it from
one client while another polls ``/health`` every 10 ms until the request is answered, and
records the health checks' median and worst latency against an idle baseline:

- a 10 MB completion body (refused by ``--max-body`` before it is read);
- a ~4 MB completion prompt (tokenized, then refused by ``--max-prompt-tokens``);
- a ~4 MB chat message (templated and tokenized, then refused likewise);
- a completion prompt of one million token ids (checked, then refused likewise).

Writes benchmarks/results/serve_health.json. A stall of the event loop shows as a worst
latency near the request's own time; a server that keeps serving shows milliseconds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from common import write_result
from serve_load import Server, free_port, stop


def health(port: int) -> float:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t = time.perf_counter()
    c.request("GET", "/health")
    c.getresponse().read()
    c.close()
    return time.perf_counter() - t


def post(port: int, path: str, body: bytes):
    """The status of one POST. The body goes out in chunks over a raw socket, so a server that
    answers 413 and closes before reading it all still has its status read."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
        s.sendall(head)
        try:
            for i in range(0, len(body), 1 << 16):
                s.sendall(body[i:i + (1 << 16)])
        except OSError:
            pass  # refused early; its answer is already waiting to be read
        reply = b""
        try:
            while b"\r\n" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError as e:
            return type(e).__name__
    parts = reply.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else "no reply"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_health.json"))
    args = ap.parse_args()
    port = free_port()
    server = Server("longattn", [sys.executable, "-m", "longattn.cli.main", "serve", "--model", args.model,
                                 "--port", str(port), "--threads", str(args.threads)], port, metrics=True)
    m = args.model
    cases = [("10 MB completion body", "/v1/completions", {"model": m, "prompt": "word " * 2_000_000}),
             ("4 MB completion prompt", "/v1/completions", {"model": m, "prompt": "The tide. " * 400_000,
                                                            "max_tokens": 1}),
             ("4 MB chat message", "/v1/chat/completions",
              {"model": m, "messages": [{"role": "user", "content": "The tide. " * 400_000}]}),
             ("1M token ids", "/v1/completions", {"model": m, "prompt": [5] * 1_000_000})]
    rows = []
    try:
        idle = [health(port) for _ in range(50)]
        for name, path, body in cases:
            raw = json.dumps(body).encode()
            out = {}
            t0 = time.perf_counter()
            th = threading.Thread(target=lambda: out.setdefault("status", post(port, path, raw)))
            th.start()
            lat = []
            while th.is_alive():
                lat.append(health(port))
                time.sleep(0.01)
            took = time.perf_counter() - t0
            row = {"request": name, "bytes": len(raw), "status": out["status"], "request_s": took,
                   "health_checks": len(lat), "health_median_ms": statistics.median(lat) * 1e3 if lat else None,
                   "health_worst_ms": max(lat) * 1e3 if lat else None}
            rows.append(row)
            print(f"{name:24s} {len(raw):>9d} B  status {row['status']}  took {took:6.2f} s  /health: "
                  f"{row['health_checks']} checks, median {row['health_median_ms'] or 0:.1f} ms, "
                  f"worst {row['health_worst_ms'] or 0:.1f} ms", flush=True)
    finally:
        stop(server.proc)
    print(f"idle /health median {statistics.median(idle) * 1e3:.1f} ms")
    print("wrote", write_result(args.out, {"model": args.model, "idle_health_median_ms": statistics.median(idle) * 1e3,
                                           "requests": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
