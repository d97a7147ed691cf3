"""Time to first token of a chat's second turn, after a long first turn: `longattn serve` against
llama.cpp's OpenAI server on the same GGUF.

Each round is a fresh conversation: the first user message is a book passage of ``--tokens``
tokens (a different passage every round, so nothing carries over between rounds) and a
question; the reply streams; then the second turn appends the reply and a short question and
its time to first token is taken. A server that reuses the conversation's cache prefills only
the new tokens; one that cannot re-prefills the whole conversation. On a sliding-window model
(Gemma 3) that reuse is what llama.cpp's users report missing. Rounds alternate between the
servers (both stay up); medians are reported.

``--users N`` holds N such conversations at once, as a server with N users does: every user's
first turn, then every user's second turn, the first user's timed. Between the first user's two
turns the others' long first turns have run, so a server that keeps one conversation's cache
(llama-cpp-python keeps the last request's) prefills the first user's whole conversation
again; one that keeps each conversation's blocks prefills only the new tokens.

    python benchmarks/serve_second_turn.py --model gemma3-270m --tokens 4096 --rounds 3 \\
        --llamacpp-python VENV/bin/python
    python benchmarks/serve_second_turn.py --model gemma3-270m --tokens 4096 --users 1,2 ...
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import RESULTS, write_result
from serve_load import Server, free_port, stop


def passage(tokenizer, tokens: int, round_: int) -> str:
    """``tokens`` tokens of the bundled book text, a different stretch for every round."""
    from longattn.data import book_body
    ids = tokenizer.encode(book_body())
    start = round_ * tokens
    if start + tokens > len(ids):
        raise SystemExit(f"the bundled text holds {len(ids)} tokens: fewer rounds or tokens")
    return tokenizer.decode(ids[start:start + tokens])


def turn(client, model: str, msgs: list, max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed token, the reply's text)."""
    t0 = time.perf_counter()
    first, parts = None, []
    for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                             stream=True):
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
    if first is None:
        raise RuntimeError("empty reply")
    return first, "".join(parts)


def conversations(base: str, model: str, texts: list, max_tokens: int) -> dict:
    """One conversation per text, turn by turn: every first turn, then every second turn; the
    first conversation's times to first token."""
    import openai
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1200)
    chats = [[{"role": "user", "content": t + "\n\nWho is this passage about? Answer in one sentence."}]
             for t in texts]
    firsts = []
    for msgs in chats:
        t1, reply = turn(c, model, msgs, max_tokens)
        firsts.append(t1)
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And where does it happen?"}]
    seconds = [turn(c, model, msgs, max_tokens)[0] for msgs in chats]
    return {"first_turn_ttft_s": firsts[0], "second_turn_ttft_s": seconds[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="bundled model name or .gguf path")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the first turn's passage")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", default="1", help="comma-separated conversations held at once (see above)")
    ap.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-python", default=None,
                    help="interpreter with llama-cpp-python[server] installed (default: this one)")
    ap.add_argument("--out", default=str(RESULTS / "serve_second_turn.json"))
    args = ap.parse_args()

    from longattn.checkpoint import load_checkpoint
    from longattn.checkpoint.bundled import resolve_model
    name, src = resolve_model(args.model)
    tok = load_checkpoint(args.model, progress=False).tokenizer
    users = [int(u) for u in args.users.split(",")]
    if min(users) < 1:
        raise SystemExit("--users takes counts of at least 1")
    texts, used = {}, 0  # a different passage for every conversation of the run
    for u in users:
        texts[u] = [[passage(tok, args.tokens, used + r * u + i) for i in range(u)] for r in range(args.rounds)]
        used += args.rounds * u
    llama_py = args.llamacpp_python or sys.executable
    if subprocess.run([llama_py, "-c", "import llama_cpp.server"], capture_output=True).returncode != 0:
        raise SystemExit(f"{llama_py} cannot import llama_cpp.server (pip install 'llama-cpp-python[server]')")
    servers = {}
    rows = {u: {"longattn": [], "llama.cpp": []} for u in users}
    try:
        port = free_port()
        servers["longattn"] = Server("longattn", [
            sys.executable, "-m", "longattn.cli.main", "serve", "--model", args.model, "--port", str(port),
            "--threads", str(args.threads), "--served-name", name], port, metrics=True)
        port = free_port()
        servers["llama.cpp"] = Server("llama.cpp", [
            llama_py, "-m", "llama_cpp.server", "--model", str(src), "--model_alias", name, "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--n_ctx", str(2 * args.tokens + 1024)], port, metrics=False)
        for u in users:
            for r, group in enumerate(texts[u]):
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                for n, srv in order:
                    res = conversations(srv.base, name, group, args.max_tokens)
                    rows[u][n].append(res)
                    print(f"users {u} round {r} {n:9s} first turn {res['first_turn_ttft_s']:7.2f} s  second turn "
                          f"{res['second_turn_ttft_s']:7.3f} s", flush=True)
    finally:
        for srv in servers.values():
            stop(srv.proc)
    med = {u: {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in rows[u].items()} for u in users}
    ratio = {u: med[u]["llama.cpp"]["second_turn_ttft_s"] / med[u]["longattn"]["second_turn_ttft_s"] for u in users}
    for u in users:
        print(f"second turn after {args.tokens} tokens, {u} user(s): llama.cpp / longattn time to first token "
              f"{ratio[u]:.1f}x")
    write_result(args.out, {"model": name, "source": str(src), "tokens": args.tokens, "rounds": args.rounds,
                            "max_tokens": args.max_tokens, "users": users, "rows": rows, "medians": med,
                            "second_turn_speedup": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
