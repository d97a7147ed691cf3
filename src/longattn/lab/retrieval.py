"""Retrieval accuracy vs needle distance for full attention, a window, and a window + sinks.

Each sample (lab/tasks.py: passkey, RULER niah_*, vt) puts its needle a controlled number
of tokens before the end of the prompt; the same samples go through every policy (paired),
greedy decoding produces at most the task's published number of tokens, and the published
metric scores the continuation (passkey: first integer == key; RULER: ``string_match_all``,
reported x100). Decoding stops early only once more tokens cannot change the score
(``tasks.settled``), so scores equal those of the full-length continuation.

With a window W on every layer a needle at distance d is directly readable from the last
prompt token only when d <= W, but L stacked layers reach L*(W-1) tokens back.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence


from ..errors import LongattnError
from ..policy import AttentionPolicy
from . import tasks as T

HAYSTACK_NOTE = ("essay haystack = sentences of public-domain books shipped with longattn "
                 "(RULER uses Paul Graham essays, not available here)")


def retrieval_policy_specs(cfg, window: int, sinks: int, mode: str = "auto", scsa: bool = False) -> list:
    """[(label, spec)]: the checkpoint's own, ``window`` alone, ``window`` + ``sinks`` and, with
    ``scsa``, SCSA (default settings) on the checkpoint's global layers. Specs are JSON
    (``sweep.build_policy`` makes the policy).

    mode: "window" (W on every layer), "global" (W on a hybrid checkpoint's global layers,
    trained windows elsewhere) or "auto" (global when the checkpoint has trained windows).
    """
    from .quality import baseline_label, resolve_mode
    m = resolve_mode(cfg, mode)
    where = "" if m == "window" else " on global layers"
    out = [(baseline_label(cfg), {"mode": "checkpoint"}),
           (f"window {window}{where}", {"mode": m, "window": window})]
    if sinks:  # sinks go on every windowed layer, trained local windows included (AttentionPolicy.build)
        label = f"window {window} + {sinks} sinks" if m == "window" else \
            f"window {window} on global layers, {sinks} sinks on every windowed layer"
        out.append((label, {"mode": m, "window": window, "sinks": sinks}))
    if scsa:
        out.append(("SCSA", {"mode": "sparse"}))
    return out


def retrieval_policies(cfg, window: int, sinks: int, mode: str = "auto") -> list:
    """[(label, AttentionPolicy)] of ``retrieval_policy_specs`` (without SCSA)."""
    from .sweep import build_policy
    return [(label, build_policy(cfg, spec)) for label, spec in retrieval_policy_specs(cfg, window, sinks, mode)]


def greedy_continuation(model, policy, ids: Sequence[int], max_new_tokens: int,
                        decode: Callable[[list], str], stop_ids=(), sample: Optional[T.Sample] = None,
                        chunk: int = 512, kv: str = "f32") -> list:
    """Greedy token ids after the prompt ``ids`` under ``policy``, on caches of format ``kv``.

    Stops at a stop token (not emitted), after ``max_new_tokens``, or -- when ``sample`` is
    given -- as soon as ``tasks.settled(sample, decode(tokens))`` says the score is final.
    """
    from ..engine.session import Session, generate
    settled = None if sample is None else (lambda _stream, toks: T.settled(sample, decode(toks)))
    from ..cache.kv_format import KV_FORMATS
    res = generate(Session(model, policy, kv_dtype=KV_FORMATS[kv]), [list(ids)], max_new_tokens, stop_ids=set(stop_ids or ()),
                   chunk=chunk, stop=settled)
    return res.tokens[0]


def retrieval_record(model, encode, decode, task: str, distance: int, length: int, seed: int, policy,
                     max_new_tokens: Optional[int] = None, stop_ids=(), chunk: int = 512, kv: str = "f32") -> dict:
    """Generate and score the prompt ``make_sample(task, encode, distance, length, seed)`` under
    ``policy`` -> ``{needle_distance, prompt_tokens, outputs, prediction, generated_tokens, score}``."""
    smp = T.make_sample(task, encode, int(distance), length, seed)
    ids = encode(smp.prompt)
    budget = smp.max_new_tokens if max_new_tokens is None else min(max_new_tokens, smp.max_new_tokens)
    gen = greedy_continuation(model, policy, ids, budget, decode, stop_ids, smp, chunk, kv)
    pred = decode(gen)
    return {"needle_distance": smp.needle_distance, "prompt_tokens": len(ids), "outputs": smp.outputs,
            "prediction": pred, "generated_tokens": len(gen), "score": T.score(smp, pred)}


def run_cell(ctx, params: dict) -> dict:
    """Sweep cell: one prompt under one policy (params: task, distance, length, seed, policy
    spec, max_new_tokens, chunk) on ``ctx`` (a ``sweep.ModelContext``)."""
    from .sweep import build_policy
    return retrieval_record(ctx.model, ctx.encode, ctx.decode, params["task"], params["distance"],
                            params["length"], params["seed"], build_policy(ctx.config, params["policy"]),
                            params.get("max_new_tokens"), ctx.stop_ids, params.get("chunk", 512),
                            params.get("kv", "f32"))


def check_settings(tasks, samples: int, max_new_tokens: Optional[int]) -> None:
    for t in tasks:
        if t not in T.TASKS:
            raise LongattnError(f"unknown task '{t}'; known: {', '.join(T.TASKS)}")
    if samples < 1:
        raise LongattnError("--samples must be >= 1")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise LongattnError("--max-new-tokens must be >= 1")


def retrieval_sweep(model, encode: Callable[[str], list], decode: Callable[[list], str],
                    tasks: Sequence[str], distances: Sequence[int], policies: list, samples: int = 2,
                    length: int = 1024, seed: int = 42, max_new_tokens: Optional[int] = None,
                    stop_ids=(), chunk: int = 512,
                    progress: Optional[Callable[[str], None]] = None) -> dict:
    """Score ``samples`` prompts per (task, distance) under every policy.

    Args:
        model: a Transformer; encode/decode: its tokenizer (text <-> ids, BOS as it adds it).
        tasks: names from ``tasks.TASKS``; distances: needle distances in tokens.
        policies: ``[(label, AttentionPolicy)]`` (see ``retrieval_policies``).
        samples: prompts per (task, distance); sample i uses seed ``seed + i``.
        length: prompt tokens at most (the haystack before the needle fills it).
        max_new_tokens: cap on generated tokens (None = the task's published count).
        stop_ids: token ids that end generation (the model's EOS).
    Returns:
        dict with ``rows`` (task, policy, distance, score 0-100, n, mean measured needle
        distance and prompt length) and ``records`` (every prompt's prediction and score).
    """
    check_settings(tasks, samples, max_new_tokens)
    records = []
    for task in tasks:
        for dist in distances:
            for i in range(samples):
                for label, pol in policies:
                    rec = retrieval_record(model, encode, decode, task, dist, length, seed + i, pol,
                                           max_new_tokens, stop_ids, chunk)
                    records.append({"task": task, "policy": label, "distance": int(dist), "seed": seed + i, **rec})
                    if progress:
                        progress(f"{task} d={dist} {label}")
    return retrieval_result(model.config.name, tasks, distances, [(label, pol.windows) for label, pol in policies],
                            records, length, samples, seed)


def retrieval_result(model_name: str, tasks, distances, arms: list, records: list, length: int, samples: int,
                     seed: int) -> dict:
    """The retrieval document from per-prompt ``records`` (task, policy, distance, seed, score...).

    ``arms``: ``[(label, windows)]``, the first the baseline. Each row holds the mean score
    (x100) with its 95% interval (Wilson for 0/1 scores, else bootstrap over prompts) and the
    paired bootstrap interval of its difference from the baseline on the same prompts.
    """
    from .stats import paired_delta_interval, score_interval
    by = {(r["task"], r["policy"], r["distance"], r["seed"]): r for r in records}
    base = arms[0][0]
    rows = []
    for task in tasks:
        for label, _ in arms:
            for dist in distances:
                rs = [r for r in records if r["task"] == task and r["policy"] == label and r["distance"] == dist]
                scores = [float(r["score"]) for r in rs]
                lo, hi, method = score_interval(scores)
                base_scores = [float(by[(task, base, r["distance"], r["seed"])]["score"]) for r in rs]
                ones = [1.0] * len(rs)
                dlo, dhi = paired_delta_interval(base_scores, ones, scores, ones)
                rows.append({"task": task, "policy": label, "distance": int(dist),
                             "score": round(100.0 * sum(scores) / len(rs), 2), "n": len(rs),
                             "score_lo": round(100.0 * lo, 2), "score_hi": round(100.0 * hi, 2),
                             "interval": method,
                             "delta_vs_baseline": round(100.0 * (sum(scores) - sum(base_scores)) / len(rs), 2),
                             "delta_lo": round(100.0 * dlo, 2), "delta_hi": round(100.0 * dhi, 2),
                             "mean_needle_distance": sum(r["needle_distance"] for r in rs) / len(rs),
                             "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs)})
    return {"experiment": "retrieval", "model": model_name, "length": length, "samples": samples, "seed": seed,
            "tasks": list(tasks), "distances": [int(d) for d in distances],
            "policies": [label for label, _ in arms],
            "windows": {label: windows for label, windows in arms},
            "scoring": "passkey: first integer == key; RULER tasks: string_match_all x100; greedy",
            "intervals": "95%: Wilson for 0/1 scores, else percentile bootstrap over prompts; delta_vs_baseline: "
                         "paired bootstrap over the same prompts (score points)",
            "distance_definition": "prompt tokens from the needle's first token to the end of the prompt",
            "haystack": HAYSTACK_NOTE, "rows": rows, "records": records}


def retrieval_cells(model: str, weights: str, tasks, distances, specs: list, samples: int, length: int,
                    seed: int, max_new_tokens: Optional[int], chunk: int, kv: str = "f32") -> list:
    """``[(Cell, meta)]``: one cell per (task, distance, sample, policy); ``meta`` holds the
    record's task, policy label, distance and seed. ``specs``: ``[(label, policy spec)]``."""
    from .sweep import Cell
    out = []
    for task in tasks:
        for dist in distances:
            for i in range(samples):
                for label, spec in specs:
                    params = {"task": task, "distance": int(dist), "length": length, "seed": seed + i,
                              "policy": spec, "max_new_tokens": max_new_tokens, "chunk": chunk}
                    if kv != "f32":  # absent for f32: cells measured before formats existed keep their keys
                        params["kv"] = kv
                    out.append((Cell("retrieval", model, params, weights),
                                {"task": task, "policy": label, "distance": int(dist), "seed": seed + i}))
    return out


def markdown_rows(result: dict) -> tuple:
    """(headers, rows) of the retrieval table for Markdown: score and delta with intervals."""
    heads = ["task", "policy", "distance", "n", "score % [95% CI]", "vs baseline [95% CI]"]
    rows = [[r["task"], r["policy"], r["distance"], r["n"], f"{r['score']:.1f} [{r['score_lo']:.1f}, {r['score_hi']:.1f}]",
             f"{r['delta_vs_baseline']:+.1f} [{r['delta_lo']:+.1f}, {r['delta_hi']:+.1f}]"] for r in result["rows"]]
    return heads, rows


def plot_retrieval(result: dict, path) -> None:
    """Score vs needle distance, one panel per task, one line per policy, 95% intervals as bars."""
    from .plots import new_figure, save_figure
    tasks = result["tasks"]
    fig, _ = new_figure(width=max(5.0, 4.2 * len(tasks)), height=3.8)
    fig.clf()
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        for label in result["policies"]:
            rs = sorted((r for r in result["rows"] if r["task"] == task and r["policy"] == label),
                        key=lambda r: r["distance"])
            err = [[r["score"] - r.get("score_lo", r["score"]) for r in rs],
                   [r.get("score_hi", r["score"]) - r["score"] for r in rs]]
            ax.errorbar([r["distance"] for r in rs], [r["score"] for r in rs], yerr=err, marker="o", capsize=3,
                        label=label)
        ax.set_xscale("log", base=2)
        ds = sorted(set(result["distances"]))
        ax.set_xticks(ds, [str(d) for d in ds])
        if result.get("window"):
            ax.axvline(result["window"], color="grey", linestyle=":", lw=1)
            ax.text(result["window"], 50, " W", color="grey", fontsize=8)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("needle distance from prompt end (tokens)")
        ax.set_ylabel("score (%)")
        ax.set_title(f"{task} ({result['samples']} samples, 95% CI)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['model']}: prompts of <= {result['length']} tokens; book haystack", fontsize=9)
    save_figure(fig, path)
