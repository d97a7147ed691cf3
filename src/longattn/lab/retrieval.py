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


def retrieval_policies(cfg, window: int, sinks: int, mode: str = "auto") -> list:
    """[(label, AttentionPolicy)]: the checkpoint's own, ``window`` alone, ``window`` + ``sinks``.

    mode: "window" (W on every layer), "global" (W on a hybrid checkpoint's global layers,
    trained windows elsewhere) or "auto" (global when the checkpoint has trained windows).
    """
    from .quality import baseline_label, resolve_mode
    m = resolve_mode(cfg, mode)
    where = "" if m == "window" else " on global layers"
    out = [(baseline_label(cfg), AttentionPolicy.build(cfg, "checkpoint")),
           (f"window {window}{where}", AttentionPolicy.build(cfg, m, window=window))]
    if sinks:
        out.append((f"window {window} + {sinks} sinks{where}", AttentionPolicy.build(cfg, m, window=window,
                                                                                     sinks=sinks)))
    return out


def greedy_continuation(model, policy, ids: Sequence[int], max_new_tokens: int,
                        decode: Callable[[list], str], stop_ids=(), sample: Optional[T.Sample] = None,
                        chunk: int = 512) -> list:
    """Greedy token ids after the prompt ``ids`` under ``policy``.

    Stops at a stop token (not emitted), after ``max_new_tokens``, or -- when ``sample`` is
    given -- as soon as ``tasks.settled(sample, decode(tokens))`` says the score is final.
    """
    from ..engine.session import Session, generate
    settled = None if sample is None else (lambda _stream, toks: T.settled(sample, decode(toks)))
    res = generate(Session(model, policy), [list(ids)], max_new_tokens, stop_ids=set(stop_ids or ()),
                   chunk=chunk, stop=settled)
    return res.tokens[0]


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
    for t in tasks:
        if t not in T.TASKS:
            raise LongattnError(f"unknown task '{t}'; known: {', '.join(T.TASKS)}")
    if samples < 1:
        raise LongattnError("--samples must be >= 1")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise LongattnError("--max-new-tokens must be >= 1")
    records = []
    for task in tasks:
        for dist in distances:
            for i in range(samples):
                smp = T.make_sample(task, encode, int(dist), length, seed + i)
                ids = encode(smp.prompt)
                budget = smp.max_new_tokens if max_new_tokens is None else min(max_new_tokens, smp.max_new_tokens)
                for label, pol in policies:
                    gen = greedy_continuation(model, pol, ids, budget, decode, stop_ids, smp, chunk)
                    pred = decode(gen)
                    records.append({"task": task, "policy": label, "distance": int(dist), "seed": seed + i,
                                    "needle_distance": smp.needle_distance, "prompt_tokens": len(ids),
                                    "outputs": smp.outputs, "prediction": pred,
                                    "generated_tokens": len(gen), "score": T.score(smp, pred)})
                    if progress:
                        progress(f"{task} d={dist} {label}")
    rows = []
    for task in tasks:
        for label, _ in policies:
            for dist in distances:
                rs = [r for r in records if r["task"] == task and r["policy"] == label and r["distance"] == dist]
                rows.append({"task": task, "policy": label, "distance": int(dist),
                             "score": round(100.0 * sum(r["score"] for r in rs) / len(rs), 2), "n": len(rs),
                             "mean_needle_distance": sum(r["needle_distance"] for r in rs) / len(rs),
                             "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs)})
    cfg = model.config
    return {"experiment": "retrieval", "model": cfg.name, "length": length, "samples": samples, "seed": seed,
            "tasks": list(tasks), "distances": [int(d) for d in distances],
            "policies": [label for label, _ in policies],
            "windows": {label: pol.windows for label, pol in policies},
            "scoring": "passkey: first integer == key; RULER tasks: string_match_all x100; greedy",
            "distance_definition": "prompt tokens from the needle's first token to the end of the prompt",
            "haystack": HAYSTACK_NOTE, "rows": rows, "records": records}


def plot_retrieval(result: dict, path) -> None:
    """Score vs needle distance, one panel per task, one line per policy."""
    from .plots import new_figure, save_figure
    tasks = result["tasks"]
    fig, _ = new_figure(width=max(5.0, 4.2 * len(tasks)), height=3.8)
    fig.clf()
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        for label in result["policies"]:
            rs = sorted((r for r in result["rows"] if r["task"] == task and r["policy"] == label),
                        key=lambda r: r["distance"])
            ax.plot([r["distance"] for r in rs], [r["score"] for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ds = sorted(set(result["distances"]))
        ax.set_xticks(ds, [str(d) for d in ds])
        if result.get("window"):
            ax.axvline(result["window"], color="grey", linestyle=":", lw=1)
            ax.text(result["window"], 50, " W", color="grey", fontsize=8)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("needle distance from prompt end (tokens)")
        ax.set_ylabel("score (%)")
        ax.set_title(f"{task} ({result['samples']} samples)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['model']}: prompts of <= {result['length']} tokens; book haystack", fontsize=9)
    save_figure(fig, path)
