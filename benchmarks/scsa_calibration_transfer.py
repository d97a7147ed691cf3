"""SCSA: does a tau calibrated on one text meet its tolerance on another? Counted, not timed.

On qwen2.5-0.5b (bfloat16 weights, as scsa_quality.py): one dense prefill of ``--context`` book
tokens, then an SCSA policy calibrates on the next ``--calib`` book tokens (teacher-forced) and
retunes to ``--tolerance``; those taus are then frozen and every SCSA call is checked against the
exact attention output of the same call:
  * book: ``--book-steps`` further book tokens;
  * vt: the answer steps of ``--samples`` variable-tracking prompts (lab/tasks.py, ``--context``
    tokens, needle at half the length), teacher-forced with the dense arm's greedy answer.
Per call and KV head: the output error in the calibration metric (group), and the largest tau of
the grid that would have met the tolerance at that very call (the "needed" tau; 0 when none).
Reported per text: median / p90 / max error, the fraction of head-calls over the tolerance and
the fraction whose calibrated tau is looser than the needed one, plus per-layer medians and the
heads that attend exactly (SCSAConfig.exact_when_unmet; their calls are not sparse and not
counted). By construction calibration picks the largest tau whose *median* error over its steps
meets the tolerance, so about half the calls on the same text may exceed it; the question is
how much worse another kind of text is.

    python benchmarks/scsa_calibration_transfer.py --threads 2       # ~8 minutes here

Writes benchmarks/results/scsa_calibration_transfer.json. Progress on stderr.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longattn.cache import KVCache  # noqa: E402
from longattn.checkpoint import load_checkpoint  # noqa: E402
from longattn.data import all_books_text  # noqa: E402
from longattn.lab import tasks as T  # noqa: E402
from longattn.models import build_model  # noqa: E402
from longattn.policy import AttentionPolicy  # noqa: E402
from longattn.sparse import SCSAConfig  # noqa: E402
from longattn.sparse.calibrate import group_error  # noqa: E402
from longattn.sparse.layer import SCSALayer  # noqa: E402
from longattn.sparse_policy import build_sparse_policy, preset_taus, retune  # noqa: E402
from scsa_quality import RESULTS, step, truncate  # noqa: E402


class CallChecker:
    """Wraps SCSALayer.attend: after calibration, each sparse call's error against the exact
    output and the largest grid tau that would have met the tolerance at that call."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance, self.tag, self.records = tolerance, None, []
        self._attend = SCSALayer.attend
        checker = self

        def attend(layer, q, k, v, scale):
            out = checker._attend(layer, q, k, v, scale)
            if checker.tag is not None and layer.calibrated and not layer.runs_exact and layer.indexes \
                    and layer.indexes[0].num_clusters:
                checker.check(layer, q, k, v, scale, out)
            return out
        SCSALayer.attend = attend

    def close(self) -> None:
        SCSALayer.attend = self._attend

    def check(self, layer, q, k, v, scale, out) -> None:
        shape = (layer.num_kv_heads, layer.group, layer.head_dim)
        exact = layer._dense(q, k, v, scale)[0, :, 0].float().view(shape)
        err = group_error(out[0, :, 0].float().view(shape), exact, "group").tolist()
        index = layer.indexes[0]
        prep = layer._prepare(index, q[0, :, 0], k[0], v[0], scale)
        table = layer.replay_errors(index, prep, exact, scale)  # [T, Hkv], the layer's own replay
        grid = layer.calibrator.grid.float().tolist()  # the float32 values the layer's taus take
        need = [max([t for t, e in zip(grid, table[:, h].tolist()) if e <= self.tolerance], default=0.0)
                for h in range(layer.num_kv_heads)]
        self.records.append({"text": self.tag, "layer": layer.layer_index, "error": err,
                             "tau": layer.taus.tolist(), "needed_tau": need})


def summary(records: list, tolerance: float) -> dict:
    errs = [e for r in records for e in r["error"]]
    loose = [t > n for r in records for t, n in zip(r["tau"], r["needed_tau"])]
    per_layer = collections.defaultdict(list)
    for r in records:
        per_layer[r["layer"]] += r["error"]
    return {"head_calls": len(errs), "median_error": statistics.median(errs),
            "p90_error": sorted(errs)[int(0.9 * len(errs))], "max_error": max(errs),
            "fraction_over_tolerance": sum(e > tolerance for e in errs) / len(errs),
            "fraction_tau_looser_than_needed": sum(loose) / len(loose),
            "median_error_per_layer": {li: statistics.median(v) for li, v in sorted(per_layer.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--book-steps", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="variable-tracking prompts")
    ap.add_argument("--answer-steps", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=0.025)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "scsa_calibration_transfer.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L = args.context
    ck = load_checkpoint(args.model)
    model = build_model(ck.config, ck.state_dict, dtype=torch.bfloat16)
    tok = ck.tokenizer
    encode = lambda s: tok(s)["input_ids"]  # noqa: E731
    dense = AttentionPolicy.from_config(ck.config)
    cfg = SCSAConfig(min_context=0, calib_steps=args.calib, tolerance=args.tolerance, calib_metric="group",
                     outliers=0)  # as its committed records (session 11)
    ids = encode(all_books_text())
    checker = CallChecker(args.tolerance)
    answers = []
    try:
        with torch.inference_mode():
            cache = KVCache(ck.config, 1)
            for c in range(0, L, 1024):
                model(torch.tensor([ids[c:min(L, c + 1024)]]), cache=cache, policy=dense, logits="none")
            pol = build_sparse_policy(ck.config, cfg)
            for i in range(args.calib):
                step(model, cache, pol, ids[L + i])
                print(f"\rcalibrate {i + 1}/{args.calib}", end="", file=sys.stderr, flush=True)
            taus = retune(pol, args.tolerance)
            checker.tag = "book"
            for i in range(args.book_steps):
                step(model, cache, pol, ids[L + args.calib + i])
            checker.tag = None
            del cache
            for s in range(args.samples):
                smp = T.make_sample("vt", encode, L // 2, L, 42 + s)
                pid = encode(smp.prompt)
                cache = KVCache(ck.config, 1)
                n0 = len(pid) - 1
                for c in range(0, n0, 1024):
                    model(torch.tensor([pid[c:min(n0, c + 1024)]]), cache=cache, policy=dense, logits="none")
                ans, t = [], pid[-1]
                for _ in range(args.answer_steps):
                    t = int(step(model, cache, dense, t).argmax())
                    ans.append(t)
                truncate(cache, n0)
                sp = build_sparse_policy(ck.config, cfg)
                preset_taus(sp, ck.config, taus)
                checker.tag = "vt"
                agree = sum(int(step(model, cache, sp, x).argmax()) == ans[i]
                            for i, x in enumerate([pid[-1]] + ans[:-1]))
                checker.tag = None
                answers.append({"seed": 42 + s, "dense_answer": tok.decode(ans), "teacher_forced_agreement": agree,
                                "steps": len(ans)})
                print(f"\rvt #{s}: teacher-forced agreement {agree}/{len(ans)}", file=sys.stderr, flush=True)
                del cache
    finally:
        checker.close()
    exact_layers = sorted(li for li, t in taus.items() if any(x is None for x in t))
    out = {"model": args.model, "context": L, "tolerance": args.tolerance, "calib_steps": args.calib,
           "taus": taus, "exact_layers": exact_layers, "vt_answers": answers,
           "book": summary([r for r in checker.records if r["text"] == "book"], args.tolerance),
           "vt": summary([r for r in checker.records if r["text"] == "vt"], args.tolerance),
           "records": checker.records}
    for text in ("book", "vt"):
        s = out[text]
        print(f"{text:5s} head-calls {s['head_calls']:5d}  median error {s['median_error']:.4f}  p90 "
              f"{s['p90_error']:.4f}  over tolerance {100 * s['fraction_over_tolerance']:.0f}%  tau looser than "
              f"needed {100 * s['fraction_tau_looser_than_needed']:.0f}%")
    print(f"layers attending exactly (no tau meets the tolerance): {exact_layers}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
