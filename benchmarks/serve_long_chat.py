"""A chat through `longattn serve` with window + sinks, turn after turn, until the conversation
holds ``--tokens`` tokens: the server's resident memory and KV blocks must stay flat.

serve_soak.py streams one long generation (decode-bound: about a token a step); this grows the
conversation the way a chat does, by user turns (prefill-bound, so 100K tokens take minutes).

Each turn sends the whole conversation (the OpenAI API is stateless) with a new user message
of ``--turn-tokens`` tokens of book text, and a short reply streams back; the server reuses the
held blocks of the conversation's prefix, so each turn prefills only its new tokens. After every
turn the script records the conversation's length (the reply's ``usage.prompt_tokens``), the
server's current and peak RSS, its KV blocks in use and the turn's time to first token.

    python benchmarks/serve_long_chat.py --tokens 100000 --window 1024 --sinks 4
    python benchmarks/serve_long_chat.py --tokens 20000 --turn-tokens 1000     # quicker
"""

from __future__ import annotations

import argparse
import sys
import time

from common import RESULTS, write_result
from serve_load import Server, free_port, peak_rss_mib, rss_mib, scrape, stop



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=100_000, help="stop once the conversation holds this many")
    ap.add_argument("--turn-tokens", type=int, default=2000, help="book text tokens in each user message")
    ap.add_argument("--max-tokens", type=int, default=8, help="reply tokens per turn")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "serve_long_chat.json"))
    args = ap.parse_args()

    import openai
    from longattn.checkpoint import load_checkpoint
    from longattn.data import book_body
    tok = load_checkpoint(args.model, progress=False).tokenizer
    book = tok.encode(book_body())
    port = free_port()
    srv = Server("longattn", [sys.executable, "-m", "longattn.cli.main", "serve", "--model", args.model,
                              "--port", str(port), "--threads", str(args.threads), "--window", str(args.window),
                              "--sinks", str(args.sinks)], port, metrics=True)
    rows, errors = [], []
    try:
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=1200)
        msgs, held, turn, at = [], 0, 0, 0
        t_start = time.perf_counter()
        while held < args.tokens:
            if at + args.turn_tokens > len(book):
                at = 0  # the text starts over; the conversation goes on growing
            msgs.append({"role": "user", "content": tok.decode(book[at:at + args.turn_tokens]) + "\n\nGo on."})
            at += args.turn_tokens
            t0 = time.perf_counter()
            first, parts, usage = None, [], None
            try:
                for ch in c.chat.completions.create(model=args.model, messages=msgs, max_tokens=args.max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
                    if ch.choices and ch.choices[0].delta.content:
                        first = first or time.perf_counter() - t0
                        parts.append(ch.choices[0].delta.content)
                    usage = ch.usage or usage
            except Exception as e:  # recorded; the soak stops at the first failure
                errors.append(f"turn {turn}: {type(e).__name__}: {e}")
                break
            msgs.append({"role": "assistant", "content": "".join(parts)})
            held = usage.prompt_tokens + usage.completion_tokens
            m = scrape(srv.base + "/metrics")
            rows.append({"turn": turn, "tokens": held, "rss_mib": rss_mib(srv.proc.pid),
                         "peak_rss_mib": peak_rss_mib(srv.proc.pid), "kv_blocks_used": m.get("longattn_kv_blocks_used"),
                         "ttft_s": first, "turn_s": time.perf_counter() - t0,
                         "prefix_tokens_reused": m.get("longattn_prefix_cache_tokens_total")})
            r = rows[-1]
            print(f"turn {turn:4d}  {held:8d} tokens  rss {r['rss_mib']:7.0f} MiB (peak {r['peak_rss_mib']:7.0f})  "
                  f"kv blocks {r['kv_blocks_used']}  ttft {r['ttft_s'] or float('nan'):6.2f} s", flush=True)
            turn += 1
        wall = time.perf_counter() - t_start
    finally:
        stop(srv.proc)
    tenth = next((r for r in rows if r["tokens"] >= args.tokens / 10), rows[0] if rows else None)
    doc = {"model": args.model, "window": args.window, "sinks": args.sinks, "tokens": args.tokens,
           "turn_tokens": args.turn_tokens, "max_tokens": args.max_tokens, "turns": len(rows),
           "wall_s": wall if rows else None, "errors": errors, "rows": rows,
           "rss_growth_after_first_tenth_mib": (rows[-1]["rss_mib"] - tenth["rss_mib"]) if rows else None,
           "kv_blocks_max": max((r["kv_blocks_used"] or 0) for r in rows) if rows else None}
    write_result(args.out, doc)
    print(f"{len(rows)} turns, {rows[-1]['tokens'] if rows else 0} tokens, errors {len(errors)}; RSS growth after "
          f"the first tenth {doc['rss_growth_after_first_tenth_mib']:.0f} MiB, KV blocks at most {doc['kv_blocks_max']}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
