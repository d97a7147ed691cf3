"""A conversation about one long document on `longattn serve`: dense against `--policy sparse`.

The document is book text (the bundled public-domain books, as RULER's essay haystack) with
``--facts`` needles ``One of the special magic numbers for {key} is: {value}.`` (RULER's niah
needle) at evenly spread depths. The first turn sends the document and asks for the first key's
number; each later turn appends the reply and asks for the next key. The server keeps the
conversation's blocks, so a later turn prefills only its question and decodes its answer over
the whole document: the turns where SCSA's decode should pay.

Two servers run side by side on loopback, the checkpoint's dense attention and ``--policy
sparse``, each with ``--threads`` threads; turn by turn the same message goes to one, then the
other (alternated), so both arms see the same machine. Per turn and arm: wall seconds, time to
first token, completion tokens, the answer, whether it holds the fact's number; and whether the
two arms' answers agree. The sparse server's SCSA counters come from its /metrics. A run whose
sparse server has no calibrated taus yet (no earlier `generate --policy sparse` or served
conversation on the model) calibrates during its first turn; ``--warmup`` runs one short
conversation first so the measured one starts from kept taus.

    python benchmarks/serve_doc_chat.py --model qwen2.5-0.5b --tokens 16000 --facts 6
    python benchmarks/serve_doc_chat.py --model qwen2.5-0.5b --tokens 32000 --facts 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from common import RESULTS, write_result
from serve_load import Server, free_port, peak_rss_mib, stop

QUESTION = "What is the special magic number for {key} mentioned in the document? Answer with the number only."


def document(tok, tokens: int, facts: int, seed: int):
    """(text of at most ``tokens`` tokens, needles included, [(key, value)] in document order):
    the most consecutive book sentences that fit, found by bisection on their count."""
    from longattn.lab.tasks import NIAH_NEEDLE, WORD_KEYS, essay_sentences
    rng = random.Random(seed)
    keys = rng.sample(WORD_KEYS, facts)
    values = [str(rng.randint(10 ** 6, 10 ** 7 - 1)) for _ in keys]
    pool, _ = essay_sentences(rng, max(8, tokens // 4), book=None)  # a sentence is > 4 tokens

    def text(count: int) -> str:
        sents = list(pool[:count])
        for i, (key, value) in reversed(list(enumerate(zip(keys, values)))):
            sents.insert(int(count * (i + 0.5) / facts), NIAH_NEEDLE.format(type_v="numbers", key=key, value=value))
        return " ".join(sents)

    lo, hi = 1, len(pool)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode(text(mid))) <= tokens else (lo, mid - 1)
    return text(lo), list(zip(keys, values))


def ask(client, model: str, msgs: list, max_tokens: int, ignore_eos: bool = False) -> dict:
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True} if ignore_eos else None)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    return {"turn_s": t1 - t0, "ttft_s": (first or t1) - t0, "answer": "".join(parts),
            # the reply's tokens after the first, each one decode step over the whole conversation
            "decode_ms_per_token": 1e3 * (t1 - (first or t1)) / (n - 1) if n > 1 else None,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cached_tokens": getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)}


def sparse_counters(base: str) -> dict:
    """``longattn_sparse_total{counter=...}`` samples of a server's /metrics."""
    import urllib.request
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("longattn_sparse_total{"):
            name = line.split('counter="')[1].split('"')[0]
            out[name] = float(line.split()[-1])
    return out


def conversation(clients: dict, model: str, doc: str, facts: list, max_tokens: int, label: str,
                 ignore_eos: bool = False) -> list:
    """Every turn to each arm in turn (alternating which goes first); rows per turn."""
    msgs = {arm: [] for arm in clients}
    rows = []
    for t, (key, value) in enumerate(facts):
        q = QUESTION.format(key=key)
        text = f"Read this document.\n\n{doc}\n\n{q}" if t == 0 else q
        row = {"turn": t, "key": key, "value": value}
        order = list(clients) if t % 2 == 0 else list(reversed(clients))
        for arm in order:
            msgs[arm].append({"role": "user", "content": text})
            r = ask(clients[arm], model, msgs[arm], max_tokens, ignore_eos)
            msgs[arm].append({"role": "assistant", "content": r["answer"]})
            r["correct"] = value in r["answer"]
            row[arm] = r
        if len(clients) == 2:
            row["agree"] = row["dense"]["answer"] == row["sparse"]["answer"]
        print(f"{label} turn {t}: " + "  ".join(
            f"{arm} {row[arm]['turn_s']:6.2f} s (ttft {row[arm]['ttft_s']:6.2f}) "
            f"{'ok ' if row[arm]['correct'] else 'bad'} {row[arm]['answer'][:24]!r}" for arm in clients)
            + f"  agree={row.get('agree')}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=16000, help="document length in tokens")
    ap.add_argument("--facts", type=int, default=6, help="needles in the document, one question each")
    ap.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", action="store_true",
                    help="first one turn over a 9K-token document on the sparse server alone, whose "
                         "40-token reply (end of turn ignored) calibrates the taus the measured "
                         "conversation then starts from")
    ap.add_argument("--out", default=str(RESULTS / "serve_doc_chat.json"))
    args = ap.parse_args()

    import openai
    from longattn.checkpoint import load_checkpoint
    tok = load_checkpoint(args.model, progress=False).tokenizer
    doc, facts = document(tok, args.tokens, args.facts, args.seed)
    servers = {}
    try:
        for arm, policy in (("dense", "checkpoint"), ("sparse", "sparse")):
            port = free_port()
            servers[arm] = Server(arm, [sys.executable, "-m", "longattn.cli.main", "serve", "--model", args.model,
                                        "--port", str(port), "--threads", str(args.threads), "--policy", policy],
                                  port, metrics=True)
        clients = {arm: openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=3600)
                   for arm, s in servers.items()}
        if args.warmup:
            # one turn past min_context whose reply is long enough for every sparse layer to
            # calibrate (SCSAConfig.calib_steps decode calls); the server keeps the taus
            wdoc, wfacts = document(tok, 9000, 1, args.seed + 1)
            conversation({"sparse": clients["sparse"]}, args.model, wdoc, wfacts, 40, "warm-up", ignore_eos=True)
        before = sparse_counters(servers["sparse"].base)
        rows = conversation(clients, args.model, doc, facts, args.max_tokens, "measured")
        after = sparse_counters(servers["sparse"].base)
        rss = {arm: peak_rss_mib(s.proc.pid) for arm, s in servers.items()}
    finally:
        for s in servers.values():
            stop(s.proc)
    later = rows[1:]
    summary = {arm: {"first_turn_s": rows[0][arm]["turn_s"],
                     "later_turn_s_median": statistics.median(r[arm]["turn_s"] for r in later) if later else None,
                     "later_turn_s_sum": sum(r[arm]["turn_s"] for r in later),
                     "later_ttft_s_median": statistics.median(r[arm]["ttft_s"] for r in later) if later else None,
                     "later_decode_ms_per_token_median": statistics.median(
                         r[arm]["decode_ms_per_token"] for r in later if r[arm]["decode_ms_per_token"]) if later else None,
                     "correct": sum(r[arm]["correct"] for r in rows), "peak_rss_mib": rss[arm]}
               for arm in ("dense", "sparse")}
    ratio = summary["sparse"]["later_turn_s_sum"] / summary["dense"]["later_turn_s_sum"] if later else None
    summary["later_turns_sparse_over_dense"] = ratio
    summary["agree"] = sum(r["agree"] for r in rows)
    summary["sparse_counters"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"later turns: decode ms/token dense {summary['dense']['later_decode_ms_per_token_median']:.1f}, sparse "
          f"{summary['sparse']['later_decode_ms_per_token_median']:.1f}; time to first token dense "
          f"{summary['dense']['later_ttft_s_median']:.2f} s, sparse {summary['sparse']['later_ttft_s_median']:.2f} s",
          flush=True)
    print(f"later turns: sparse / dense time {ratio:.2f}x; facts right dense {summary['dense']['correct']}/"
          f"{len(rows)}, sparse {summary['sparse']['correct']}/{len(rows)}; answers agree {summary['agree']}/"
          f"{len(rows)}", flush=True)
    write_result(args.out, {"model": args.model, "tokens": args.tokens, "facts": args.facts,
                            "max_tokens": args.max_tokens, "seed": args.seed, "warmup": args.warmup,
                            "summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
