"""Render benchmarks/results/decode_speed.json as the README's markdown table.

    python benchmarks/decode_table.py [path/to/decode_speed.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "decode_speed.json"


def _f(v, fmt):
    return "–" if v is None else format(v, fmt)


def table(doc: dict) -> str:
    head = ("| model | T | policy | arm | decode tok/s | × transformers | × llama.cpp | prefill tok/s "
            "| prefill × transformers | prefill × llama.cpp | % of roofline (tok/s) |")
    lines = [head, "|" + "---|" * 11]
    for r in doc["rows"]:
        roof = (f"{100 * r['fraction_of_roofline']:.0f}% of {r['roofline_tok_s']:.0f}"
                if "fraction_of_roofline" in r else "–")
        lines.append(" | ".join([
            f"| {r['model']}", str(r["T"]), r["policy"], r["arm"], _f(r["decode_tok_s"], ".1f"),
            _f(r.get("decode_vs_transformers"), ".2f"), _f(r.get("decode_vs_llamacpp"), ".2f"),
            _f(r.get("prefill_tok_s"), ".0f"), _f(r.get("prefill_vs_transformers"), ".2f"),
            _f(r.get("prefill_vs_llamacpp"), ".2f"), roof]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT).read_text())))
