"""Quality cost of each weight format: bits/token against float32 weights on the bundled books.

    python benchmarks/weights_quality.py --threads 2 [--models ...] [--tokens 1024] [--passages 3]
        [--formats auto bf16 int8 int4 int5] [--keep-int8 qkv gate_up]

For every model and format (``auto``: the default, resolved for each checkpoint), bits/token of next-token prediction over ``--passages`` passages of
``--tokens`` tokens (one from each of the first bundled books, from 20% into the book body).
The quantized formats (auto, int8, int4, int5) have one arithmetic for prefill and decode
(activations rounded to int8 per block of 32, ``ops/csrc/quant_gemm.cpp``): one arm each,
``kernel``. bf16 has two: ``prefill`` (the weight widened to float32) and ``decode`` (bf16
products, as each generated token is computed).

``--keep-int8 qkv ...`` adds int4 arms that keep one kind of matrix in int8.

Writes benchmarks/results/weights_quality.json (or --out). Quality only: nothing here is timed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import write_result


from longattn.checkpoint import load_checkpoint
from longattn.data import book_body, book_names
from longattn.lab.plots import progress_bar
from longattn.models import build_model
from longattn.ops import linear
from longattn.checkpoint.prepared import resolve_recipe
from longattn.lab.stream import nll_bits


def passages(tok, n_tokens: int, count: int) -> list:
    """``count`` token lists of ``n_tokens``, one per book (books in name order), from 20% in."""
    out = []
    for name in book_names():
        body = book_body(name)
        ids = tok.encode(body[len(body) // 5:len(body) // 5 + 12 * n_tokens])
        if len(ids) >= n_tokens:
            out.append((name, ids[:n_tokens]))
        if len(out) == count:
            break
    return out


def bits_per_token(model, ids: list) -> float:
    x = torch.tensor([ids])
    return nll_bits(model(x)[0, :-1], x[0, 1:]).mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--formats", nargs="*", default=["auto", "bf16", "int8", "int4", "int5"])
    ap.add_argument("--keep-int8", nargs="*", default=[],
                    help="extra int4 arms, each keeping the matrices whose module name contains "
                         "this fragment in int8 (e.g. qkv, gate_up, down_proj, o_proj, embed)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--passages", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "weights_quality.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"tokens": args.tokens, "models": {}}
    widen = linear.WIDEN_ROWS
    for name in args.models:
        ck = load_checkpoint(name)
        texts = passages(ck.tokenizer, args.tokens, args.passages)
        rows = {}
        arms = [("f32", "prefill")] + [(f, a) for f in args.formats
                                       for a in (("prefill", "decode") if f == "bf16" else ("kernel",))]
        arms += [(f"int4+int8:{frag}", "kernel") for frag in args.keep_int8]
        bar = progress_bar(len(arms) * len(texts), desc=name, unit="passage")
        for fmt, arith in arms:
            # what a run with this recipe builds: auto resolved for the checkpoint, and int4/int5
            # on the file's own groups where it stores them (as prepared weights are)
            weights, kinds, stored = resolve_recipe(ck, fmt)
            model = build_model(ck.config, ck.state_dict, weights=weights, kinds=kinds, stored=stored)
            if fmt == "auto":
                print(f"{name}: auto is {model.weights}")
            # bf16 "decode": every matmul in bf16, as a generated token's are
            linear.WIDEN_ROWS = 1 << 30 if arith == "decode" else widen
            try:
                bits = []
                for _, ids in texts:
                    bits.append(bits_per_token(model, ids))
                    bar.update()
            finally:
                linear.WIDEN_ROWS = widen
            rows[f"{fmt}/{arith}"] = {"format": fmt, "arithmetic": arith, "bits": bits,
                                      "mean_bits": sum(bits) / len(bits)}
            del model
        bar.close()
        f32_bits = rows["f32/prefill"]["mean_bits"]
        for r in rows.values():
            r["delta_vs_f32"] = r["mean_bits"] - f32_bits
        results["models"][name] = {"passages": [n for n, _ in texts], "rows": rows}
        for key, r in rows.items():
            print(f"{name:14s} {key:14s} {r['mean_bits']:.4f} bits/token  ({r['delta_vs_f32']:+.4f} vs f32)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
