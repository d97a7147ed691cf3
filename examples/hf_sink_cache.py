"""A transformers model's own `generate` with longattn's window + sinks ring cache.

Loads the bundled SmolLM2-135M-Instruct with transformers (longattn's cached float32 copy
of the GGUF), routes its attention through longattn, and generates with a cache that holds
`sinks + window` tokens per layer however long the output grows.

    python examples/hf_sink_cache.py --window 64 --sinks 4 --max-new-tokens 200
"""

from __future__ import annotations

import argparse

import torch

import longattn.hf
from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.oracle import oracle_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--window", type=int, default=64, help="keys per query, itself included")
    p.add_argument("--sinks", type=int, default=4, help="first positions every query keeps reading")
    p.add_argument("--max-new-tokens", type=int, default=120)
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper who collects storms.")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    tok = load_checkpoint("smollm2-135m", progress=False).tokenizer
    model = oracle_model("smollm2-135m")  # transformers' AutoModelForCausalLM, float32, eval
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])

    cache = longattn.hf.apply(model, window=args.window, sinks=args.sinks)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print(f"\n[{out.shape[1]} tokens seen; cache {cache.nbytes() / 2**20:.2f} MiB, "
          f"{max(cache.tokens())} slots per layer = {args.sinks} sinks + {args.window} window]")


if __name__ == "__main__":
    main()
