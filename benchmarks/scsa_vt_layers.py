"""Which layers' sparse reads change a retrieval answer: SCSA on one layer at a time.

For each prompt (RULER-style task, as in scsa_quality.py's retrieval: L-token prompt, needle at
L/2 from the end, one exact prefill), the dense arm decodes greedily; then, for every layer l,
an arm runs SCSA on layer l alone (its book-calibrated taus from a scsa_quality JSON, every other
layer exact) and on all layers. An answer that differs from dense with one sparse layer names a
layer whose selection the answer depends on; no single layer changing it while all layers do
says the errors add up. Counted, not timed (bfloat16 weights, as scsa_quality.py).

``--errors`` adds, per prompt, one more arm that stays in calibration for the whole answer (exact
attention, so the dense answer) while every layer replays its sparse read at every tau of the
grid: each layer's relative output error (the book calibration's metric) at its book-calibrated
tau on the answer's steps, median and worst, to set beside the tolerance the book steps met.

    python benchmarks/scsa_vt_layers.py --taus benchmarks/results/scsa_quality_s14_vt.json \\
        --seeds 42 43 46 48

Writes benchmarks/results/scsa_vt_layers.json. Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from longattn.cache import KVCache  # noqa: E402
from longattn.checkpoint import load_checkpoint  # noqa: E402
from longattn.lab import tasks as T  # noqa: E402
from longattn.models import build_model  # noqa: E402
from longattn.policy import AttentionPolicy  # noqa: E402
from longattn.sparse import SCSAConfig  # noqa: E402
from longattn.sparse_policy import build_sparse_policy, preset_taus, sparse_ops  # noqa: E402
from scsa_quality import Progress, greedy, truncate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def answer_errors(model, ck, cache, pid, smp, n0, taus, metric, args, progress, stop, decode) -> dict:
    """``{layer: {"median": [per KV head], "max": [...], "steps": n}}``: the replayed error (the
    book calibration's ``metric``) at each head's book tau over the exact arm's answer steps (None
    for a head run exactly)."""
    cfg = SCSAConfig(min_context=0, calib_steps=10 ** 9, calib_metric=metric, outliers=args.outliers,
                     refine=args.refine)
    pol = build_sparse_policy(ck.config, cfg)
    greedy(model, cache, pol, pid[-1], smp.max_new_tokens, "errors", progress, stop,
           lambda o: T.settled(smp, decode(o)))
    truncate(cache, n0)
    out = {}
    for op in sparse_ops(pol):
        cal = op.scsa.calibrator
        errs = torch.stack(cal.samples)  # [steps, T, Hkv]
        med, worst = [], []
        for h, t in enumerate(taus[op.layer_index]):
            if t is None:
                med.append(None)
                worst.append(None)
                continue
            i = int((cal.grid - t).abs().argmin())
            med.append(float(errs[:, i, h].median()))
            worst.append(float(errs[:, i, h].max()))
        out[op.layer_index] = {"median": med, "max": worst, "steps": len(cal.samples)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--taus", required=True, help="scsa_quality JSON whose first row holds the calibrated taus")
    ap.add_argument("--taus-key", default=None, help="key in row['taus'] (default: the first)")
    ap.add_argument("--task", default="vt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seeds", nargs="+", type=int, default=[42])
    ap.add_argument("--outliers", type=int, default=SCSAConfig().outliers)
    ap.add_argument("--errors", action="store_true",
                    help="also replay every layer's sparse read on the answer's steps (exact arm)")
    ap.add_argument("--no-single", action="store_true", help="skip the one-sparse-layer arms (dense and all only)")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "scsa_vt_layers.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    book = json.loads(Path(args.taus).read_text())
    row, metric = book["rows"][0], book["metric"]
    args.refine = book.get("refine", 0)  # the stop rule the taus were calibrated for
    key = args.taus_key or next(iter(row["taus"]))
    taus = {int(li): t for li, t in row["taus"][key].items()}
    progress = Progress()
    progress("loading model")
    ck = load_checkpoint(args.model)
    model = build_model(ck.config, ck.state_dict, dtype=torch.bfloat16)
    tok = ck.tokenizer
    encode = lambda s: tok(s)["input_ids"]  # noqa: E731
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    stop = set(ck.config.eos_token_ids)
    dense_pol = AttentionPolicy.from_config(ck.config)
    layers = sorted(taus)
    exact = {li: [None] * len(taus[li]) for li in layers}

    def sparse_arm(only):
        pol = build_sparse_policy(ck.config, SCSAConfig(min_context=0, calib_steps=0, outliers=args.outliers,
                                                        refine=args.refine))
        preset_taus(pol, ck.config, {li: (taus[li] if li in only else exact[li]) for li in layers})
        return pol

    arms = {"all": set(layers), **({} if args.no_single else {f"layer{li}": {li} for li in layers})}
    out = {"model": args.model, "task": args.task, "context": args.context, "taus_from": args.taus, "taus_key": key,
           "outliers": args.outliers, "refine": args.refine, "records": []}
    with torch.inference_mode():
        for seed in args.seeds:
            smp = T.make_sample(args.task, encode, max(1, args.context // 2), args.context, seed)
            pid = encode(smp.prompt)
            cache = KVCache(ck.config, 1)
            n0 = len(pid) - 1
            for c in range(0, n0, args.chunk):
                model(torch.tensor([pid[c:min(n0, c + args.chunk)]]), cache=cache, policy=dense_pol, logits="none")
                progress(f"#{seed} prefill {min(n0, c + args.chunk)}/{len(pid)}")
            answers = {}
            for arm, only in (("dense", set()),) + tuple(arms.items()):
                pol = dense_pol if arm == "dense" else sparse_arm(only)
                gen = greedy(model, cache, pol, pid[-1], smp.max_new_tokens, f"#{seed} {arm}", progress, stop,
                             lambda o: T.settled(smp, decode(o)))
                truncate(cache, n0)
                answers[arm] = {"tokens": gen, "score": T.score(smp, decode(gen))}
            changed = [a for a in arms if answers[a]["tokens"] != answers["dense"]["tokens"]]
            rec = {"seed": seed, "dense_score": answers["dense"]["score"],
                   "dense_prediction": decode(answers["dense"]["tokens"]),
                   "changed_by": changed, "scores": {a: answers[a]["score"] for a in changed}}
            if args.errors:
                rec["answer_errors"] = answer_errors(model, ck, cache, pid, smp, n0, taus, metric, args, progress,
                                                     stop, decode)
            out["records"].append(rec)
            progress.done(f"#{seed}: dense {rec['dense_score']}; answer changed by {changed or 'none'}")
            RESULTS.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
