"""SCSA quality on a real model (qwen2.5-0.5b): what the sparse arm changes, counted, not timed.

Per context L (nested: one dense prefill of the book grows the cache from length to length):
  * reference: the dense arm's greedy continuation from the L-token book prefix
    (--calib + --steps + 1 tokens);
  * calibration, once per packing: the sparse arm runs --calib steps teacher-forced on those
    tokens (exact while calibrating, replaying every tau). Every tolerance is then picked from
    the same recorded errors (``sparse_policy.retune``), so all arms start from one calibrated
    state at context L + calib;
  (a) tolerance sweep x packing: --steps teacher-forced steps; greedy agreement (sparse argmax ==
      dense token) and the fraction of cached keys opened per layer call (opened_rows /
      (calls * kv_heads * context), deterministic counters), per layer too;
  (b) free-running (first packing, --tolerance): from the calibrated state each arm generates
      --free tokens greedily; the dense model scores both continuations (teacher-forced, one
      chunk): NLL delta = mean dense-judged NLL of the sparse continuation minus that of the
      dense one; identical continuations and the first divergence;
  (c) retrieval (passkey, multi-needle niah_multikey_1, variable tracking vt; lab/tasks.py):
      L-token prompts, needle at L/2 tokens from the end, one exact prefill, then each arm
      decodes greedily (sparse with the calibrated taus, preset); identical answers counted.
      ``--retrieval-calib prompt``: SCSA calibrates on the prompt itself instead, its last
      --calib tokens fed as decode steps (in every arm, so the caches stay alike), as a
      deployment would calibrate on the context it serves rather than on other text.
      ``--controls`` adds two arms that open every cluster (tau 0, no tail): f32 packing
      (SCSA's exact path: only the order of float operations differs from the dense arm) and
      q8_0 packing (the packing's rounding alone). If rounding alone changes answers, "identical
      to dense" sits at the noise floor of any different summation, not at SCSA's selection.
      ``--oracle-net K ...`` adds, per K, an arm with the book taus whose every selection also
      opens the clusters holding each query head's K highest exact-scoring member keys (an
      oracle: it scores every key exactly, so it saves no time), plus ``sparse_py``, the plain
      sparse arm on the same PyTorch path. Whether such a key-level net makes the answers
      identical bounds what any cheap approximation of it (a probe) could do. ``--probe-net
      PROBE:R:K`` ranks the keys by an approximation instead (``probe_scores``: R principal
      directions of the keys, or each query's R largest dimensions).

    python benchmarks/scsa_quality.py --contexts 2048 --steps 16 --free 16 --samples 1   # quick check
    python benchmarks/scsa_quality.py --contexts 4096 8192 16384 32768 --threads 2      # full

Writes benchmarks/results/scsa_quality.json (updated after every context). Progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import replace

import torch


from longattn.cache import KVCache
from longattn.checkpoint import load_checkpoint
from longattn.data import all_books_text
from longattn.lab import tasks as T
from longattn.models import build_model
from longattn.policy import AttentionPolicy
from longattn.sparse import SCSAConfig
from longattn.sparse.kernel import Selection
from longattn.sparse.layer import SCSALayer
from longattn.sparse.policy import build_sparse_policy, cache_taus, retune, stream_layers, with_taus

from common import RESULTS, write_result
RETRIEVAL_TASKS = ("passkey", "niah_multikey_1", "vt")


class Progress:
    """One status line on stderr: elapsed time, the stage, and steps done in it."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"\r[{time.perf_counter() - self.t0:7.0f} s] {msg:<100}", end="", file=sys.stderr, flush=True)

    def done(self, msg: str) -> None:
        self(msg)
        print(file=sys.stderr, flush=True)


def truncate(cache: KVCache, n: int) -> None:
    for layer in cache.layers:
        layer.truncate(n)
    cache.next_pos = torch.full_like(cache.next_pos, n)


# id(policy) -> (policy, the op state its arm keeps): the arms share one cache, truncated between
# them, and each keeps its own SCSA state (index, calibration) in it while it runs
_STATES: dict = {}


def bind(cache: KVCache, policy) -> KVCache:
    """``cache`` holding ``policy``'s own op state (made empty on its first use)."""
    cache.op_state = _STATES.setdefault(id(policy), (policy, [{} for _ in cache.layers]))[1]
    return cache


def step(model, cache, policy, tok: int) -> torch.Tensor:
    bind(cache, policy)
    return model(torch.tensor([[tok]]), cache=cache, policy=policy, logits="all")[0, -1]


def greedy(model, cache, policy, first: int, n: int, label: str, progress, stop=(), settle=None) -> list:
    """Feed ``first``, then ``n - 1`` greedy tokens; returns the ``n`` tokens chosen after each feed
    (fewer when a stop token comes or ``settle(tokens)`` says more cannot change the answer)."""
    out, tok = [], first
    for i in range(n):
        tok = int(step(model, cache, policy, tok).argmax())
        progress(f"{label} {i + 1}/{n}")
        if tok in stop:
            break
        out.append(tok)
        if settle is not None and settle(out):
            break
    return out


def counters(cache, policy) -> dict:
    return {i: dict(sc.counters) for i, sc in stream_layers(bind(cache, policy)).items()}


def opened_fraction(before: dict, after: dict, kv_heads: int, context_sum: int) -> dict:
    """Per layer and overall: opened rows / (kv_heads * sum of cache lengths over the calls)."""
    per = {li: (after[li]["opened_rows"] - before.get(li, {}).get("opened_rows", 0)) / (kv_heads * context_sum)
           for li in after}
    return {"overall": sum(per.values()) / len(per), "per_layer": per}


def sparse_cfg(args, packing: str, calib: int) -> SCSAConfig:
    return SCSAConfig(min_context=args.min_context, calib_steps=calib, tolerance=args.tolerance,
                      calib_quantile=args.calib_quantile, packing=packing, calib_metric=args.metric,
                      cluster_size=args.cluster_size,
                      outliers=args.outliers, refine=args.refine, probe_dims=args.probe_dims,
                      probe_keys=args.probe_keys)


def nll(model, cache, policy, first: int, cont: list) -> float:
    """Mean NLL of ``cont`` after feeding ``first`` under ``policy`` (teacher-forced, one chunk)."""
    ids = torch.tensor([[first] + cont[:-1]])
    logits = model(ids, cache=bind(cache, policy), policy=policy, logits="all")[0].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(cont)))


def run_context(model, ck, ids, cache, L, args, dense_pol, progress) -> dict:
    kv = ck.config.num_kv_heads
    toks = [ids[L]] + greedy(model, cache, dense_pol, ids[L], args.calib + args.steps, f"L={L} dense reference",
                             progress)
    truncate(cache, L)
    Lc = L + args.calib
    ctx_sum = sum(Lc + i + 1 for i in range(args.steps))  # cache length seen by each timed call
    row = {"context": L, "calib_steps": args.calib, "steps": args.steps, "sweep": [], "taus": {}}
    free_pol = None
    for packing in args.packings:
        pol = build_sparse_policy(ck.config, sparse_cfg(args, packing, args.calib))
        for i in range(args.calib):
            step(model, cache, pol, toks[i])
            progress(f"L={L} calibrate {packing} {i + 1}/{args.calib}")
        for tol in args.tolerances:
            taus = retune(bind(cache, pol), tol)
            before = counters(cache, pol)
            agree = []
            for i in range(args.steps):
                j = args.calib + i
                agree.append(int(step(model, cache, pol, toks[j]).argmax()) == toks[j + 1])
                progress(f"L={L} {packing} tol {tol} {i + 1}/{args.steps} agree {sum(agree)}/{len(agree)}")
            truncate(cache, Lc)
            frac = opened_fraction(before, counters(cache, pol), kv, ctx_sum)
            flat = [t for li in sorted(taus) for t in taus[li] if t is not None] or [0.0]  # None: exact head
            row["sweep"].append({"packing": packing, "tolerance": tol, "agreement": sum(agree) / len(agree),
                                 "opened_fraction": frac["overall"],
                                 "opened_fraction_per_layer": [frac["per_layer"][li] for li in sorted(frac["per_layer"])],
                                 "tau_median": sorted(flat)[len(flat) // 2],
                                 "exact_heads": sum(t is None for li in taus for t in taus[li])})
            row["taus"][f"{packing}@{tol}"] = taus
            progress.done(f"L={L} {packing} tol {tol}: agreement {sum(agree)}/{len(agree)}, "
                          f"opened {100 * frac['overall']:.1f}%")
        if free_pol is None:
            free_pol = pol
        truncate(cache, L)
    # (b) free-running from the calibrated state (cache at L + calib, first packing, --tolerance)
    for i in range(args.calib):  # the calibration tokens, exact, to reach the calibrated state
        step(model, cache, dense_pol, toks[i])
    retune(bind(cache, free_pol), args.tolerance)
    first = toks[args.calib]
    conts = {}
    for arm, pol in (("dense", dense_pol), ("sparse", free_pol)):
        conts[arm] = greedy(model, cache, pol, first, args.free, f"L={L} free-running {arm}", progress)
        truncate(cache, Lc)
    judged = {}
    for arm in conts:
        judged[arm] = nll(model, cache, dense_pol, first, conts[arm])
        truncate(cache, Lc)
    a, b = conts["dense"], conts["sparse"]
    div = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    row["free_running"] = {"packing": args.packings[0], "tolerance": args.tolerance, "tokens": args.free,
                           "identical": a == b, "first_divergence": div,
                           "dense_nll": judged["dense"], "sparse_nll": judged["sparse"],
                           "nll_delta": judged["sparse"] - judged["dense"],
                           "dense_text": ck.tokenizer.decode(a), "sparse_text": ck.tokenizer.decode(b)}
    progress.done(f"L={L} free-running: identical {a == b}, first divergence {div}, "
                  f"NLL delta {judged['sparse'] - judged['dense']:+.4f}")
    truncate(cache, L)
    row["retrieval"] = retrieval(model, ck, L, args, cache_taus(bind(cache, free_pol)), progress)
    return row


# control arm -> packing; both run at tau 0 (every cluster opened, no tail)
CONTROL_ARMS = {"tau0_f32": "f32", "tau0_q8_0": "q8_0"}


def probe_scores(qg: torch.Tensor, keys: torch.Tensor, probe: str, r: int, centres: torch.Tensor) -> torch.Tensor:
    """Scores ``[Hkv, g, N]`` of queries ``qg [Hkv, g, D]`` with keys ``[Hkv, N, D]``: exact
    (``probe == "exact"``), in the top-``r`` principal directions of the keys' second moment
    (``"pca"``: both sides projected, as a low-rank key probe would store them), the same for the
    keys' offsets from their cluster's centroid ``centres [Hkv, N, D]`` plus the exact ``q.c``
    (``"rpca"``), or over each query's ``r`` largest-magnitude dimensions (``"sparq"``; ``"rsparq"``
    the offsets plus ``q.c``; ``"gsparq"``, ``"grsparq"`` with one set of dims per KV head), or
    over its ``r / 4`` runs of four consecutive dimensions with the largest ``sum q_i^2``, offsets
    plus ``q.c`` (``"rruns"``: what a tile scorer reading whole 4-dimension runs could do)."""
    if probe == "rpca":
        off = keys - centres
        basis = torch.linalg.eigh(off.transpose(1, 2) @ off).eigenvectors[..., -r:]  # [Hkv, D, r]
        return qg @ centres.transpose(1, 2) + (qg @ basis) @ (off @ basis).transpose(1, 2)
    if probe == "pca":
        basis = torch.linalg.eigh(keys.transpose(1, 2) @ keys).eigenvectors[..., -r:]  # [Hkv, D, r]
        return (qg @ basis) @ (keys @ basis).transpose(1, 2)
    if probe == "rruns":
        energy = qg.unflatten(-1, (-1, 4)).square().sum(-1)  # [Hkv, g, D / 4]
        keep = torch.zeros_like(energy).scatter_(-1, energy.topk(r // 4, -1).indices, 1.0)
        keep = keep.repeat_interleave(4, -1)
        return qg @ centres.transpose(1, 2) + (qg * keep) @ (keys - centres).transpose(1, 2)
    if probe in ("sparq", "rsparq", "gsparq", "grsparq"):
        # r dims per query head (sparq), or one set per KV head shared by its query heads (g...:
        # the largest sum of |q_i| / |q|); r... scores the offsets from the centroid, plus q.c
        mag = qg.abs()
        if probe.startswith("g"):
            mag = (mag / qg.norm(dim=-1, keepdim=True)).sum(1, keepdim=True).expand_as(qg)
        keep = torch.zeros_like(qg).scatter_(-1, mag.topk(r, -1).indices, 1.0)
        if "r" in probe[:2]:
            return qg @ centres.transpose(1, 2) + (qg * keep) @ (keys - centres).transpose(1, 2)
        return (qg * keep) @ keys.transpose(1, 2)
    return qg @ keys.transpose(1, 2)


@contextlib.contextmanager
def oracle_net(k: int, probe: str = "exact", r: int = 0):
    """While active, every flat SCSA selection also opens, per query head, the clusters that hold
    its ``k`` highest-scoring member keys by ``probe_scores`` (PyTorch path only: set
    ``native=False``)."""
    prepare, select = SCSALayer._prepare, SCSALayer._select
    k_rows = {}  # id(Prepared) -> the row's keys: a selection always follows its row's prepare

    def prepare_keep(self, index, q_row, k_row, v_row, scale, flat_scores=None):
        prep = prepare(self, index, q_row, k_row, v_row, scale, flat_scores)
        k_rows.clear()
        k_rows[id(prep)] = k_row
        return prep

    def select_net(self, index, prep, scale, taus, hierarchical=None):
        sel, tail, v_tail = select(self, index, prep, scale, taus, hierarchical)
        M, cs = index.num_clusters, self.cfg.cluster_size
        slots = index.slots[:, :M].reshape(self.num_kv_heads, -1)  # [Hkv, M * cs], -1 = padding
        keys = k_rows[id(prep)].float().gather(1, slots.clamp(min=0).unsqueeze(-1).expand(-1, -1, self.head_dim))
        centres = index.live_summ[:, :, 0].repeat_interleave(cs, 1)  # [Hkv, M * cs, D]
        s = probe_scores(prep.qg, keys, probe, r, centres).masked_fill((slots < 0).unsqueeze(1), float("-inf"))
        top = s.topk(min(k, s.shape[-1]), -1).indices // cs  # [Hkv, g, k] cluster ids
        opened = sel.opened.clone().scatter_(1, top.flatten(1), True)
        return Selection(opened, sel.tail_ids, ~opened, sel.scored), tail, v_tail

    SCSALayer._prepare, SCSALayer._select = prepare_keep, select_net
    try:
        yield
    finally:
        SCSALayer._prepare, SCSALayer._select = prepare, select


def retrieval(model, ck, L, args, taus, progress) -> dict:
    tok = ck.tokenizer
    encode = lambda s: tok(s)["input_ids"]  # noqa: E731
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    stop = set(ck.config.eos_token_ids)
    dense_pol = AttentionPolicy.from_config(ck.config)
    kv = ck.config.num_kv_heads
    nets = {f"net{k}": (k, "exact", 0) for k in args.oracle_net}  # arm -> oracle_net's arguments
    for spec in args.probe_net:  # PROBE:R:K
        probe, r, k = spec.split(":")
        nets[f"{probe}{r}net{k}"] = (int(k), probe, int(r))
    extra = (tuple(CONTROL_ARMS) if args.controls else ()) + (("sparse_py",) + tuple(nets) if nets else ())
    records = []
    for task in args.tasks:
        for s in range(args.samples):
            smp = T.make_sample(task, encode, max(1, L // 2), L, args.seed + s)
            pid = encode(smp.prompt)
            cache = KVCache(ck.config, 1)
            # the prompt's last `fed` tokens are decode steps of every arm: one (its last), or
            # with --retrieval-calib prompt the calibration steps too
            fed = 1 + (args.calib if args.retrieval_calib == "prompt" else 0)
            n0 = len(pid) - fed
            for c in range(0, n0, args.chunk):  # the rest of the prompt, exact
                model(torch.tensor([pid[c:min(n0, c + args.chunk)]]), cache=cache, policy=dense_pol, logits="none")
                progress(f"L={L} {task} #{s} prefill {min(n0, c + args.chunk)}/{len(pid)}")
            answers = {}
            for arm in ("dense", "sparse") + extra:
                pol = dense_pol
                net = contextlib.nullcontext()
                if arm == "sparse" and args.retrieval_calib == "prompt":  # calibrates on this prompt
                    pol = build_sparse_policy(ck.config, sparse_cfg(args, args.packings[0], args.calib))
                elif arm == "sparse":
                    pol = with_taus(build_sparse_policy(ck.config, sparse_cfg(args, args.packings[0], 0)), taus)
                elif arm in CONTROL_ARMS:  # everything opened: only rounding differs from dense
                    pol = with_taus(build_sparse_policy(ck.config, sparse_cfg(args, CONTROL_ARMS[arm], 0)),
                                    {li: [0.0] * len(t) for li, t in taus.items()})
                elif arm == "sparse_py" or arm in nets:  # the book taus on the PyTorch path
                    pol = with_taus(build_sparse_policy(ck.config, replace(sparse_cfg(args, args.packings[0], 0),
                                                                           native=False)), taus)
                    if arm in nets:
                        net = oracle_net(*nets[arm])
                before = counters(cache, pol)
                for i, t in enumerate(pid[n0:-1]):  # calibration steps (exact attention in every arm)
                    step(model, cache, pol, t)
                    progress(f"L={L} {task} #{s} {arm} prompt step {i + 1}/{fed - 1}")
                # the last prompt token is a decode step of each arm (sparse from here on)
                with net:
                    gen = greedy(model, cache, pol, pid[-1], smp.max_new_tokens, f"L={L} {task} #{s} {arm}",
                                 progress, stop, lambda out: T.settled(smp, decode(out)))
                truncate(cache, n0)
                answers[arm] = {"tokens": gen, "prediction": decode(gen), "score": T.score(smp, decode(gen))}
                after = counters(cache, pol)
                if after and arm not in CONTROL_ARMS:  # opened rows / (calls * kv heads * prompt length)
                    d = {n: sum(after[li][n] - before[li][n] for li in after) for n in ("opened_rows", "calls")}
                    answers[arm]["opened_fraction"] = d["opened_rows"] / max(1, d["calls"] * kv * len(pid))
            del cache
            rec = {"task": task, "seed": args.seed + s, "prompt_tokens": len(pid),
                   "needle_distance": smp.needle_distance, "outputs": smp.outputs,
                   "identical": answers["dense"]["tokens"] == answers["sparse"]["tokens"],
                   **{f"{arm}_identical": answers["dense"]["tokens"] == answers[arm]["tokens"]
                      for arm in answers if arm not in ("dense", "sparse")},
                   **{f"{arm}_{k}": v for arm in answers for k, v in answers[arm].items() if k != "tokens"}}
            records.append(rec)
            progress.done(f"L={L} {task} #{s}: identical {rec['identical']}, score dense {rec['dense_score']} "
                          f"sparse {rec['sparse_score']}" + "".join(
                              f", {arm} identical {rec[arm + '_identical']} score {rec[arm + '_score']}"
                              for arm in answers if arm not in ("dense", "sparse")))
    summary = {"identical": sum(r["identical"] for r in records), "prompts": len(records)}
    for arm in (a for a in records[0] if a.endswith("_identical")) if records else ():
        summary[arm] = sum(r[arm] for r in records)
    return {**summary, "records": records}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096])
    ap.add_argument("--steps", type=int, default=64, help="teacher-forced steps per sweep arm")
    ap.add_argument("--calib", type=int, default=32, help="calibration steps")
    ap.add_argument("--free", type=int, default=64, help="free-running tokens per arm")
    ap.add_argument("--tolerances", nargs="+", type=float, default=[0.0125, 0.025, 0.05, 0.1])
    ap.add_argument("--tolerance", type=float, default=0.025, help="for free-running and retrieval")
    ap.add_argument("--packings", nargs="+", default=["q8_0", "f16"])
    ap.add_argument("--metric", choices=["head", "group"], default="head", help="SCSAConfig.calib_metric")
    ap.add_argument("--calib-quantile", type=float, default=SCSAConfig().calib_quantile,
                    help="SCSAConfig.calib_quantile (0.5: each head's median calibration error meets the tolerance)")
    ap.add_argument("--cluster-size", type=int, default=128)
    ap.add_argument("--outliers", type=int, default=SCSAConfig().outliers,
                    help="SCSAConfig.outliers (keys per cluster read exactly)")
    ap.add_argument("--min-context", type=int, default=0)
    ap.add_argument("--refine", type=int, default=SCSAConfig().refine,
                    help="SCSAConfig.refine: re-decisions of the stop rule after the read")
    ap.add_argument("--probe-dims", type=int, default=SCSAConfig().probe_dims,
                    help="SCSAConfig.probe_dims (every sparse arm, calibration included)")
    ap.add_argument("--probe-keys", type=int, default=SCSAConfig().probe_keys, help="SCSAConfig.probe_keys")
    ap.add_argument("--tasks", nargs="*", default=list(RETRIEVAL_TASKS))
    ap.add_argument("--samples", type=int, default=2, help="retrieval prompts per task")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--controls", action="store_true",
                    help="retrieval: two more arms at tau 0 (f32 and q8_0 packing), rounding only")
    ap.add_argument("--oracle-net", nargs="*", type=int, default=[],
                    help="retrieval arms whose selections also open each query head's K best keys' clusters")
    ap.add_argument("--probe-net", nargs="*", default=[],
                    help="as --oracle-net with approximate scores, PROBE:R:K (PROBE pca, rpca, sparq, rsparq, gsparq, grsparq, rruns; R dims)")
    ap.add_argument("--retrieval-calib", choices=["book", "prompt"], default="book",
                    help="retrieval: SCSA's taus from the book's calibration (preset), or calibrated on the "
                         "prompt itself (its last --calib tokens fed as decode steps in every arm)")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "scsa_quality.json"))
    args = ap.parse_args()
    if args.steps < 1 or args.calib < 1 or args.free < 1 or args.samples < 0 or args.threads < 1:
        ap.error("--steps, --calib, --free, --threads must be >= 1 and --samples >= 0")
    if args.tolerance not in args.tolerances:
        ap.error("--tolerance must be one of --tolerances")
    torch.set_num_threads(args.threads)
    progress = Progress()
    progress("loading model")
    ck = load_checkpoint(args.model)
    model = build_model(ck.config, ck.state_dict, dtype=torch.bfloat16)
    ids = ck.tokenizer(all_books_text())["input_ids"]
    dense_pol = AttentionPolicy.from_config(ck.config)
    cache = KVCache(ck.config, 1)
    out = {"model": args.model, "dtype": "bfloat16", "metric": args.metric, "calib_quantile": args.calib_quantile,
           "cluster_size": args.cluster_size,
           "outliers": args.outliers, "refine": args.refine, "probe_dims": args.probe_dims,
           "probe_keys": args.probe_keys,
           "tolerances": args.tolerances, "packings": args.packings, "min_context": args.min_context,
           "retrieval_calib": args.retrieval_calib, "controls": args.controls, "oracle_net": args.oracle_net,
           "probe_net": args.probe_net,
           "opened_fraction_definition": "opened_rows / (calls * kv_heads * cache length), after calibration",
           "rows": []}
    filled = 0
    with torch.inference_mode():
        for L in sorted(args.contexts):
            while filled < L:
                e = min(L, filled + args.chunk)
                model(torch.tensor([ids[filled:e]]), cache=cache, policy=dense_pol, logits="none")
                filled = e
                progress(f"prefill {filled}/{L}")
            out["rows"].append(run_context(model, ck, ids, cache, L, args, dense_pol, progress))
            RESULTS.mkdir(parents=True, exist_ok=True)
            write_result(args.out, out)
    for r in out["rows"]:
        for s in r["sweep"]:
            print(f"L={r['context']:>6} {s['packing']:5s} tol {s['tolerance']:<7} agreement "
                  f"{100 * s['agreement']:5.1f}%  opened {100 * s['opened_fraction']:5.1f}%  tau median "
                  f"{s['tau_median']:.3f}")
        f = r["free_running"]
        print(f"L={r['context']:>6} free-running {f['tokens']} tokens: identical {f['identical']}, "
              f"NLL delta {f['nll_delta']:+.4f}; retrieval identical {r['retrieval']['identical']}/"
              f"{r['retrieval']['prompts']}" + "".join(
                  f", {arm} {r['retrieval'][arm + '_identical']}/{r['retrieval']['prompts']}"
                  for arm in (a[:-len("_identical")] for a in r["retrieval"] if a.endswith("_identical"))))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
