"""Decode and prefill speed grid: longattn (weight formats x eager/compiled x policies) against
transformers and llama.cpp (when ``llama-cpp-python`` is installed), with a roofline column.

For each model and context T (book tokens):
  * one f32 prefill per policy builds the cache every longattn arm decodes from (a deep copy
    each time; decode cost depends on the cache's size, not its values). At T <= --prefill-max
    every format's prefill is timed again inside each repeat, alternated with the other arms,
    and the median is reported (a first, cold prefill ran up to 1.7x slower); above it, the
    f32 prefill that built the cache is the figure (the model has run smaller T by then);
  * decode arms, alternated inside every repeat, medians of per-step times:
      eager-{f32,bf16,int8,int4}  Session.step (int4 only when listed in --formats)
      compiled-{int8,int4}   StaticDecoder (torch.compile, static shapes: one graph per model,
                             policy and T, compiled before timing, compile time reported)
                             reading its buffers by --static-attention (fused C++ kernel by
                             default; more names add A/B arms compiled-int8-<name>)
      compiled-f32           the same on the dense policy at T <= --hf-max (same weights as
                             the transformers arm)
  * policies: "dense" = the checkpoint's attention (Gemma 3: its trained 512-token local
    windows); "window" = window 1,024 + 4 sinks on the layers the checkpoint leaves global;
    "sparse" (T >= --sparse-min) = SCSA on those layers (q8_0, tolerance 0.025, group metric),
    every eager and compiled arm with a fresh index and 32 untimed calibration steps first,
    from the dense loop's prefilled cache;
  * transformers f32 (its own prefill) at T <= --hf-max; llama.cpp on the same GGUF file (timed
    in every policy's loop, alternated with its arms) and thread count at every T; above
    --llamacpp-prefill-max it prefills once and later repeats restore that state.
Roofline: bytes one decode step must read (every weight matrix in its stored format; the K/V
that the policy lets the step read, in float32) / step time, against this machine's memory
bandwidth, measured here by summing a 1 GiB tensor (``--bandwidth`` to override).

    python benchmarks/decode_speed.py --threads 2                 # full grid (~40 min)
    python benchmarks/decode_speed.py --quick                     # smollm2, T=128, no compile

Writes benchmarks/results/decode_speed.json and .png. Never run it beside tests or builds.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


from longattn.checkpoint import load_checkpoint
from longattn.data import all_books_text
from longattn.host import cpu_description
from longattn.models import build_model
from longattn.models.weights import parse_recipe
from longattn.ops import linear
from longattn.policy import AttentionPolicy
from longattn.engine.sampling import greedy
from longattn.engine.session import Session
from longattn.engine.static_step import StaticDecoder

from common import RESULTS, write_result
WINDOW, SINKS = 1024, 4
SCSA_CALIB = 32  # SCSAConfig.calib_steps: untimed steps before a sparse arm's timed ones


def measure_bandwidth(mb: int = 1024, repeats: int = 7) -> float:
    """Read bandwidth in bytes/s: a sum over a tensor far larger than the caches (a decode
    step mostly reads), with the current threads; the best of ``repeats``."""
    a = torch.ones(mb * 2**20 // 4)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        ts.append(time.perf_counter() - t0)
    return a.nbytes / min(ts)


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matrix in its stored format (the head
    reads the whole table; an untied embedding only a row, left out)."""
    n = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        if model.lm_head is not None and "embed_tokens" in name:
            continue
        n += t.numel() * t.element_size()
    return n


def read_kv_bytes(cfg, policy, T: int) -> int:
    """K and V (float32) that a step at position T may read under ``policy``."""
    per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    return sum(per_tok * (T + 1 if lp.window is None else min(T + 1, lp.window + lp.sinks))
               for lp in policy.layers)


def sparse_policy(cfg) -> AttentionPolicy:
    """SCSA on the checkpoint's global layers (every layer of Qwen and SmolLM2), a fresh index
    and calibration each time: library defaults but for the group error metric (the SCSA
    tables' setting) and no minimum context."""
    from longattn.sparse import SCSAConfig
    from longattn.sparse.policy import build_sparse_policy
    return build_sparse_policy(cfg, SCSAConfig(min_context=0, calib_metric="group"))


def policies(cfg, T: int, names, sparse_min: int) -> dict:
    out = {"dense": AttentionPolicy.from_config(cfg)}
    if T > WINDOW:
        out["window"] = AttentionPolicy.build(cfg, "global", window=WINDOW, sinks=SINKS)
    if T >= sparse_min:
        out["sparse"] = sparse_policy(cfg)
    return {k: v for k, v in out.items() if k in names}


def calibrated(step, first, steps: int):
    """``step`` after ``steps`` untimed greedy steps (SCSA's calibration, exact attention)."""
    tok = first
    for _ in range(steps):
        tok = greedy(step(tok))
    return step


def time_decode(prefill, step, steps: int) -> tuple:
    """``(prefill seconds, per-step seconds)``: ``prefill() -> first token``, then ``steps``
    greedy steps ``step(token) -> next token``, each timed alone. One loop for every engine,
    so the arms are timed alike."""
    t0 = time.perf_counter()
    tok = prefill()
    prefill_s, ts = time.perf_counter() - t0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = step(tok)
        ts.append(time.perf_counter() - t0)
    return prefill_s, ts


def time_steps(step, first, steps: int) -> list:
    """Per-step seconds of ``steps`` greedy longattn steps (``step(tokens [B]) -> logits``),
    picking with longattn's greedy (sampling.greedy: argmax's result, chunked: torch's argmax
    over one 262K row costs 0.6 ms, as much as a Gemma 3 layer)."""
    return time_decode(lambda: first, lambda tok: greedy(step(tok)), steps)[1]


@torch.inference_mode()
def time_hf(hf, ids, steps):
    from transformers import DynamicCache
    state = {}

    def run(x, past):
        out = hf(x, past_key_values=past, use_cache=True)
        state["past"] = out.past_key_values
        return out.logits[:, -1].argmax(-1, keepdim=True)
    return time_decode(lambda: run(torch.tensor([ids]), DynamicCache(config=hf.config)),
                       lambda tok: run(tok, state["past"]), steps)


def time_llamacpp(llm, ids, steps, saved=None):
    """``(prefill seconds, per-step seconds)`` of llama.cpp. With ``saved`` (a dict) it
    prefills once, keeps that state there, and later calls restore it instead (their
    prefill figure is the first one): a 32K prefill takes llama.cpp minutes."""
    def step(_):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    if saved is not None and "state" in saved:
        llm.load_state(saved["state"])
        return saved["prefill_s"], time_decode(lambda: None, step, steps)[1]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    if saved is not None:
        saved.update(state=llm.save_state(), prefill_s=prefill_s)
    return prefill_s, time_decode(lambda: None, step, steps)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 2048, 8192])
    ap.add_argument("--formats", nargs="+", default=["f32", "bf16", "int8"])
    ap.add_argument("--compiled", nargs="*", default=["int8"], help="formats with a compiled arm")
    ap.add_argument("--compiled-dense", nargs="*", default=["f32"],
                    help="formats with a compiled arm on the dense policy at T <= --hf-max only "
                         "(the same-weights comparison with transformers)")
    ap.add_argument("--policies", nargs="+", default=["dense", "window"], choices=["dense", "window", "sparse"])
    ap.add_argument("--compiled-policies", nargs="+", default=["dense", "window"], choices=["dense", "window", "sparse"],
                    help="policies with compiled arms (each compiles its own graph per T)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-max", type=int, default=2048, help="largest T for the transformers arm")
    ap.add_argument("--prefill-max", type=int, default=2048, help="largest T for per-format prefill")
    ap.add_argument("--llamacpp-prefill-max", type=int, default=8192,
                    help="above this T llama.cpp prefills once and restores that state for later repeats")
    ap.add_argument("--sparse-min", type=int, default=8192,
                    help="smallest T for the sparse policy (--policies sparse)")
    ap.add_argument("--static-attention", nargs="+", default=["fused"], choices=["fused", "matmul", "flash"],
                    help="how compiled arms read their K/V buffers (StaticDecoder attention=); the "
                         "first is arm compiled-<format>, others compiled-<format>-<name> (an A/B)")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: measured)")
    ap.add_argument("--quick", action="store_true", help="smollm2, T=128, one repeat, 4 steps, no compile")
    ap.add_argument("--out", default=str(RESULTS / "decode_speed.json"))
    args = ap.parse_args()
    if args.quick:
        args.models, args.contexts, args.repeats, args.steps = ["smollm2-135m"], [128], 1, 4
        args.compiled, args.compiled_dense = [], []
    torch.set_num_threads(args.threads)
    bandwidth = args.bandwidth or measure_bandwidth()
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (read, {args.threads} threads)", flush=True)
    try:
        import llama_cpp
    except ImportError as e:
        llama_cpp = None
        if e.name != "llama_cpp":  # installed but broken (e.g. --no-deps left out diskcache)
            print(f"llama.cpp arm skipped: llama_cpp does not import ({e})", file=sys.stderr, flush=True)
    book = all_books_text()
    rows, compile_s = [], {}
    for name in args.models:
        ck = load_checkpoint(name, progress=True)
        cfg = ck.config
        ids_all = ck.tokenizer(book)["input_ids"]
        models = {}
        for w in args.formats:  # "int4+int8:qkv": int4 with the q/k/v projections kept in int8
            fmt, kinds = parse_recipe(w)
            models[w] = build_model(cfg, ck.state_dict, weights=fmt, kinds=kinds)
        hf = None
        if min(args.contexts) <= args.hf_max:
            from longattn.checkpoint.oracle import oracle_model
            hf = oracle_model(name)
        decoders = {}  # (format, policy) -> StaticDecoder for the current T
        for T in args.contexts:
            decoders.clear()  # static shapes: each T compiles its own graphs
            if T + args.steps + 1 > cfg.max_context:
                T = cfg.max_context - args.steps - 1  # the longest prompt the model allows
                print(f"{name}: context {cfg.max_context}, running T={T}", flush=True)
            ids = ids_all[:T]
            first = torch.tensor([ids_all[T]])
            llm = llama_cpp.Llama(str(ck.source), n_threads=args.threads, n_threads_batch=args.threads,
                                  n_ctx=T + args.steps + 8, n_batch=512, verbose=False) if llama_cpp else None
            llm_saved = {} if T > args.llamacpp_prefill_max else None
            dense_base = None
            for pname, pol in policies(cfg, T, args.policies, args.sparse_min).items():
                # the shared prefilled cache (f32 prefill timed as longattn's prefill figure); the
                # sparse loop reuses the dense one's (SCSA changes decode only: same cache)
                prefill = {}
                if pname == "sparse" and dense_base is not None:
                    base = dense_base
                else:
                    base = Session(models.get("f32") or build_model(cfg, ck.state_dict), pol)
                    t0 = time.perf_counter()
                    base.prefill([ids], chunk=512)
                    prefill = {"eager-f32": time.perf_counter() - t0}
                if pname == "dense":
                    dense_base = base
                # sparse arms: fresh indexes, SCSA_CALIB untimed calibration steps, then timed
                calib = SCSA_CALIB if pname == "sparse" else 0
                room = T + calib + args.steps + 1
                arms = {}
                for w, m in models.items():
                    arms[f"eager-{w}"] = (m, lambda m=m: calibrated(Session(
                        m, sparse_policy(cfg) if pname == "sparse" else pol,  # sparse: a fresh index
                        cache=copy.deepcopy(base.cache)).step, first, calib))
                    if (w in args.compiled and pname in args.compiled_policies) or \
                            (w in args.compiled_dense and pname == "dense" and T <= args.hf_max):
                        for n_att, att in enumerate(args.static_attention):
                            key, arm = (w, pname, att), f"compiled-{w}" + (f"-{att}" if n_att else "")
                            if key not in decoders:
                                decoders[key] = StaticDecoder(m, pol, max_len=room, attention=att)
                                t0 = time.perf_counter()
                                decoders[key].warmup()
                                label = f"{name}/{w}/{pname}" + (f"/{att}" if n_att else "")
                                compile_s[label] = time.perf_counter() - t0
                                print(f"  compiled {label} in {compile_s[label]:.0f} s", flush=True)

                            def make(dec=decoders[key]):
                                if dec.sparse is not None:
                                    dec.sparse.clear()  # fresh indexes and calibration
                                dec.reset(room)
                                dec.load_cache(copy.deepcopy(base.cache))
                                return calibrated(dec.step, first, calib)
                            arms[arm] = (m, make)
                samples = {a: [] for a in arms}
                other, prefills = {}, {}
                for r in range(args.repeats + 1):  # round 0 warms up and is dropped
                    for arm, (m, make) in arms.items():
                        if T <= args.prefill_max and arm.startswith("eager-"):
                            t0 = time.perf_counter()
                            Session(m, pol).prefill([ids], chunk=512)
                            if r:
                                prefills.setdefault(arm, []).append(time.perf_counter() - t0)
                        ts = time_steps(make(), first, args.steps)
                        if r:
                            samples[arm] += ts
                    if pname == "dense" and hf is not None and T <= args.hf_max:
                        p, ts = time_hf(hf, ids, args.steps)
                        if r:
                            other.setdefault("transformers-f32", ([], []))[0].append(p)
                            other["transformers-f32"][1].extend(ts)
                    if llm is not None:  # every policy's loop: its ratios come from interleaved samples
                        p, ts = time_llamacpp(llm, ids, args.steps, llm_saved)
                        if r:
                            other.setdefault("llama.cpp", ([], []))[0].append(p)
                            other["llama.cpp"][1].extend(ts)
                for arm, ts in samples.items():
                    w = arm.split("-")[1]  # eager-int8, compiled-int8-matmul
                    row = {"model": name, "T": T, "policy": pname, "arm": arm,
                           "decode_tok_s": 1 / statistics.median(ts)}
                    if arm in prefills:
                        row["prefill_tok_s"] = T / statistics.median(prefills[arm])
                    elif arm in prefill:
                        row["prefill_tok_s"] = T / prefill[arm]
                    if w in models:
                        need = weight_bytes(models[w]) + read_kv_bytes(cfg, pol, T)
                        row["bytes_per_step"] = need
                        row["roofline_tok_s"] = bandwidth / need
                        row["fraction_of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
                    rows.append(row)
                for arm, (ps, ts) in other.items():
                    rows.append({"model": name, "T": T, "policy": pname, "arm": arm,
                                 "decode_tok_s": 1 / statistics.median(ts),
                                 "prefill_tok_s": T / statistics.median(ps)})
                report(rows, name, T, pname)
            del llm
        del models, hf, decoders
    add_ratios(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"threads": args.threads, "steps": args.steps, "repeats": args.repeats,
           "bandwidth_bytes_s": bandwidth, "compile_seconds": compile_s,
           "int8_kernel": linear.kernel_name(), "static_attention": args.static_attention,
           "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "cpu": cpu_description(), "llama_cpp": getattr(llama_cpp, "__version__", None), "rows": rows}
    write_result(args.out, doc)
    plot(doc, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def add_ratios(rows) -> None:
    """Each row's decode speed against transformers and llama.cpp at the same model and T.

    llama.cpp always runs its own (the checkpoint's) attention; it is timed inside every
    policy's loop, alternated with that policy's arms, and a row is compared with the
    llama.cpp samples of its own loop (the dense loop's where there are none)."""
    ref = {(r["model"], r["T"], r["policy"], r["arm"]): r for r in rows}
    for r in rows:
        for other, key in (("transformers-f32", "vs_transformers"), ("llama.cpp", "vs_llamacpp")):
            o = ref.get((r["model"], r["T"], r["policy"], other)) or ref.get((r["model"], r["T"], "dense", other))
            if o:
                r[f"decode_{key}"] = r["decode_tok_s"] / o["decode_tok_s"]
                if "prefill_tok_s" in r:
                    r[f"prefill_{key}"] = r["prefill_tok_s"] / o["prefill_tok_s"]


def report(rows, name, T, pname) -> None:
    for r in rows:
        if (r["model"], r["T"], r["policy"]) == (name, T, pname):
            pre = f"prefill {r['prefill_tok_s']:7.1f} tok/s" if "prefill_tok_s" in r else " " * 21
            roof = f"  {100 * r['fraction_of_roofline']:4.0f}% of roofline" if "fraction_of_roofline" in r else ""
            print(f"{name:<13} T={T:<6} {pname:<7} {r['arm']:<17} decode {r['decode_tok_s']:7.2f} tok/s  "
                  f"{pre}{roof}", flush=True)


def plot(doc, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in doc["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, mname in zip(axes[0], models):
        rs = [r for r in doc["rows"] if r["model"] == mname]
        for arm in sorted({(r["arm"], r["policy"]) for r in rs}):
            pts = sorted((r["T"], r["decode_tok_s"]) for r in rs if (r["arm"], r["policy"]) == arm)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{arm[0]} ({arm[1]})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context T")
        ax.set_ylabel("decode tok/s")
        ax.set_title(mname)
        ax.legend(fontsize=6)
    fig.suptitle(f"decode speed, {doc['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
