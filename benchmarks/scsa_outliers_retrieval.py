"""SCSA prototype: each cluster's 8 keys farthest from its centroid read exactly, on variable tracking.

A float32 prototype of the lead from scsa_rules.py (rule outliers_8), not the library's operator:
SCSALayer.attend is replaced by a PyTorch version over the same maintained cluster index that (a)
takes each cluster's ``--outliers`` farthest members out as rows read exactly on every call (like
the sink rows), summarising, ranking and tailing the cluster without them, and (b) reads opened
clusters in float32. With ``--outliers 0`` it is the current rule in float32 (the control).
Per arm, taus are calibrated on 32 book steps after a ``--context``-token book prefix (tolerance
0.025, group metric, as scsa_quality.py); then each variable-tracking prompt (lab/tasks.py, needle at
half the length) is answered greedily by dense attention and by each arm from the same cache.

    python benchmarks/scsa_outliers_retrieval.py --threads 2        # ~8 minutes here

Writes benchmarks/results/scsa_outliers_retrieval.json.
"""
import argparse
import json
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
from longattn.sparse.index import ClusterIndex  # noqa: E402
from longattn.sparse.layer import SCSALayer  # noqa: E402
from longattn.sparse_policy import build_sparse_policy, preset_taus, retune  # noqa: E402
from scsa_quality import RESULTS, greedy, sparse_ops, step, truncate  # noqa: E402
from scsa_rules import outlier_call, outlier_output, without_outliers  # noqa: E402

N_OUT = [0]  # keys per cluster read exactly, set per arm


def attend(layer, q, k, v, scale):
    """The prototype's SCSALayer.attend (batch 1): calibration replays the grid, then sparse."""
    B, H, _, D = q.shape
    hkv, g = layer.num_kv_heads, layer.group
    layer.counters["calls"] += 1
    if layer.runs_exact:
        return layer._dense(q, k, v, scale)
    if not layer.indexes:
        layer.indexes = [ClusterIndex(layer.cfg, hkv, D)]
    ix = layer.indexes[0]
    kf, vf = k[0].float(), v[0].float()
    built = ix.update(kf, vf)
    if ix.num_clusters == 0:
        return layer._dense(q, k, v, scale)
    if built or getattr(ix, "_wo", None) is None:
        ix._wo = without_outliers(ix, kf, vf, N_OUT[0])
    wo = ix._wo
    qg = q[0, :, 0].float().view(hkv, g, D)
    s_all = torch.bmm(qg, kf.transpose(1, 2)) * scale
    call = outlier_call(ix, wo, qg, s_all, scale)  # with no outliers: the current rule in float32

    def out_at(taus):  # opened_rows: rows read beyond those read on every call
        out, read = outlier_output(call, wo, s_all, vf, taus)
        layer.counters["opened_rows"] += int(read.sum() - call["base"].sum())
        layer.counters["exact_rows"] += int(call["base"].sum())
        return out
    if not layer.calibrated:
        exact = layer._dense(q, k, v, scale)
        o_ex = exact[0, :, 0].float().view(hkv, g, D)
        table = torch.stack([group_error(out_at(t.expand(hkv)), o_ex, layer.cfg.calib_metric)
                             for t in layer.calibrator.grid.float()])
        layer.calibrator.record([table])
        if layer.calibrator.done:
            layer.set_taus(layer.choose_taus())
        return exact
    return out_at(layer.taus).reshape(1, H, 1, D).to(q.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--outliers", type=int, default=8, help="keys per cluster read exactly (the other arm: 0)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "scsa_outliers_retrieval.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L, CAL, TOL = args.context, 32, 0.025
    original, SCSALayer.attend = SCSALayer.attend, attend
    try:
        return run(args, L, CAL, TOL)
    finally:
        SCSALayer.attend = original


def run(args, L: int, CAL: int, TOL: float) -> int:
    ck = load_checkpoint(args.model)
    model = build_model(ck.config, ck.state_dict, dtype=torch.bfloat16)
    tok = ck.tokenizer
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    dec = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    dense = AttentionPolicy.from_config(ck.config)
    stop = set(ck.config.eos_token_ids)
    nop = lambda *a, **kw: None  # noqa: E731
    ARMS = (0, args.outliers)
    with torch.inference_mode():
        ids = enc(all_books_text())
        cache = KVCache(ck.config, 1)
        for c in range(0, L, 1024):
            model(torch.tensor([ids[c:c + 1024]]), cache=cache, policy=dense, logits="none")
        taus = {}
        for no in ARMS:
            N_OUT[0] = no
            truncate(cache, L)
            # outliers=0: this prototype takes its own outliers out (the operator's predate it)
            pol = build_sparse_policy(ck.config, SCSAConfig(min_context=0, calib_steps=CAL, tolerance=TOL,
                                                            calib_metric="group", outliers=0))
            for i in range(CAL):
                step(model, cache, pol, ids[L + i])
            taus[no] = retune(pol, TOL)
            ex = sorted(li for li, t in taus[no].items() if None in t)
            print(f"n_out {no}: exact layers {ex}", flush=True)
        del cache
        res = {no: 0 for no in ARMS}
        records = []
        for s in range(args.samples):
            smp = T.make_sample("vt", enc, L // 2, L, 42 + s)
            pid = enc(smp.prompt)
            cache = KVCache(ck.config, 1)
            n0 = len(pid) - 1
            for c in range(0, n0, 1024):
                model(torch.tensor([pid[c:min(n0, c + 1024)]]), cache=cache, policy=dense, logits="none")
            settle = lambda out: T.settled(smp, dec(out))  # noqa: E731
            d = greedy(model, cache, dense, pid[-1], smp.max_new_tokens, "", nop, stop, settle)
            truncate(cache, n0)
            line = f"vt #{s}: dense {dec(d)!r} score {T.score(smp, dec(d))}"
            rec = {"seed": 42 + s, "dense": dec(d), "dense_score": T.score(smp, dec(d))}
            for no in ARMS:
                N_OUT[0] = no
                pol = build_sparse_policy(ck.config, SCSAConfig(min_context=0, calib_steps=0, tolerance=TOL,
                                                                calib_metric="group", outliers=0))
                preset_taus(pol, ck.config, taus[no])
                a = greedy(model, cache, pol, pid[-1], smp.max_new_tokens, "", nop, stop, settle)
                truncate(cache, n0)
                res[no] += a == d
                rec[f"outliers_{no}"] = {"answer": dec(a), "score": T.score(smp, dec(a)), "identical": a == d}
                op = sum(o.scsa.counters["opened_rows"] for o in sparse_ops(pol) if o.scsa is not None)
                line += f" | n_out {no}: {dec(a)!r} score {T.score(smp, dec(a))} identical {a == d} opened_rows {op}"
                rec[f"outliers_{no}"]["opened_rows"] = op
            records.append(rec)
            print(line, flush=True)
            del cache
        print("identical to dense:", {f"outliers {no}": f"{v}/{args.samples}" for no, v in res.items()})
        out = {"model": args.model, "context": L, "tolerance": TOL, "calib_steps": CAL, "arms": list(ARMS),
               "identical": {str(no): v for no, v in res.items()}, "samples": records,
               "taus": {str(no): {str(li): t for li, t in taus[no].items()} for no in ARMS}}
        RESULTS.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
