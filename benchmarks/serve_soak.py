"""Soak: one conversation streamed through `longattn serve` to ``--tokens`` tokens with a window
and sinks on every layer; the server's RSS and KV blocks in use are sampled every ``--every``
tokens and must stay flat once the window is full (the run fails on any error).

    python benchmarks/serve_soak.py --model smollm2-135m --window 1024 --sinks 4 --tokens 1000000
    python benchmarks/serve_soak.py --tokens 300 --window 32 --every 50     # smoke
    python benchmarks/serve_soak.py --random-layers 2 --every 20000        # 1M tokens in ~30 min

``--random-layers N`` serves a random N-layer model with ``--model``'s tokenizer and vocabulary
(hidden size 64) instead of its weights: the server's machinery (paged blocks, sinks, the
stream, the positions) at many times the real model's speed, where 1M real tokens take hours.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import write_result
from serve_load import RESULTS, ROOT, free_port, rss_mib, scrape, start, stop, wait_up


def random_checkpoint(model: str, layers: int, dst: Path) -> str:
    """Save a random Llama of ``layers`` layers (hidden 64) with ``model``'s tokenizer,
    vocabulary and rope into ``dst`` and return it as a ``--model`` argument."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from longattn.checkpoint import load_checkpoint
    ck = load_checkpoint(model, read_weights=False)
    c = ck.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=c.max_context,
                      rope_theta=c.rope_theta, tie_word_embeddings=True, bos_token_id=c.bos_token_id,
                      eos_token_id=c.eos_token_ids[0] if c.eos_token_ids else None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(dst))
    ck.tokenizer.save_pretrained(str(dst))
    return str(dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--every", type=int, default=1000, help="tokens between samples")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random-layers", type=int, default=0,
                    help="serve a random model of this many layers with --model's tokenizer (see above)")
    ap.add_argument("--out", default=str(RESULTS / "serve_soak.json"))
    args = ap.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="longattn-soak-")
    served = random_checkpoint(args.model, args.random_layers, Path(scratch.name)) if args.random_layers else args.model

    import os

    import openai
    port = free_port()
    cmd = [sys.executable, "-m", "longattn.cli.main", "serve", "--model", served, "--port", str(port),
           "--threads", str(args.threads), "--window", str(args.window), "--sinks", str(args.sinks),
           "--served-name", "soak"]
    proc = start(cmd, dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    base = f"http://127.0.0.1:{port}"
    samples, error, n = [], None, 0
    try:
        wait_up(base + "/health", proc)
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=None)
        t0 = time.perf_counter()
        try:
            stream = c.completions.create(model="soak", prompt="Once upon a time", max_tokens=args.tokens,
                                          temperature=0.8, seed=0, stream=True, extra_body={"ignore_eos": True})
            for ch in stream:
                if ch.usage is not None:
                    n = ch.usage.completion_tokens
                if ch.choices and ch.choices[0].text:
                    n += 1  # counts chunks; a chunk carries one token or more, so at least n were generated
                    if n // args.every > len(samples):
                        m = scrape(base + "/metrics")
                        samples.append({"tokens": n, "seconds": time.perf_counter() - t0,
                                        "rss_mib": rss_mib(proc.pid),
                                        "kv_blocks_used": m.get("longattn_kv_blocks_used")})
                        print(f"{n:9d} tokens  rss {samples[-1]['rss_mib']:8.1f} MiB  "
                              f"kv blocks {samples[-1]['kv_blocks_used']}", flush=True)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    finally:
        stop(proc)
        scratch.cleanup()
    kv = [s["kv_blocks_used"] for s in samples]
    doc = {"model": args.model, "random_layers": args.random_layers or None, "window": args.window,
           "sinks": args.sinks, "tokens": n, "error": error,
           "samples": samples,
           # flat: the second half of the run never holds more blocks than the first half did
           "kv_blocks_flat": len(kv) >= 2 and max(kv[len(kv) // 2:]) <= max(kv[:len(kv) // 2])}
    out = write_result(args.out, doc)
    print(f"wrote {out}" + (f"; error: {error}" if error else ""))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
