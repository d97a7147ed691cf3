"""/metrics in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations


def _family(name: str, kind: str, help_: str, samples: list) -> list:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{lab} {value}")
    return lines


def render_metrics(engine) -> str:
    """The engine's counters and gauges as Prometheus text."""
    m, snap = engine.metrics, engine.snapshot()
    out: list = []
    out += _family("longattn_requests_total", "counter", "Completion requests by outcome.",
                   [({"outcome": k}, v) for k, v in sorted(m.requests.items())])
    out += _family("longattn_refused_requests_total", "counter", "Requests refused before any route ran "
                   "(Host, API key, body type or size), by reason.",
                   [({"reason": k}, v) for k, v in sorted(m.refused.items())])
    out += _family("longattn_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [({}, m.prompt_tokens)])
    out += _family("longattn_generation_tokens_total", "counter", "Tokens generated.", [({}, m.generation_tokens)])
    out += _family("longattn_queue_depth", "gauge", "Requests waiting for admission.", [({}, snap["queue"])])
    out += _family("longattn_running_requests", "gauge", "Requests admitted (prefilling or decoding).",
                   [({}, snap["running"])])
    out += _family("longattn_kv_blocks_used", "gauge", "KV pool blocks in use (running and retained streams).",
                   [({}, snap["blocks_used"])])
    out += _family("longattn_kv_blocks_free", "gauge", "KV pool blocks free.", [({}, snap["blocks_free"])])
    out += _family("longattn_kv_blocks_retained", "gauge", "KV pool blocks held by finished streams kept "
                   "for prefix reuse.", [({}, snap["blocks_retained"])])
    out += _family("longattn_kv_block_bytes", "gauge", "Bytes of keys and values one block holds.",
                   [({}, engine.pool.block_bytes)])
    out += _family("longattn_kv_pool_bytes", "gauge", "Bytes of the whole KV pool, by storage format.",
                   [({"format": engine.config.kv}, engine.pool.block_bytes * engine.pool.num_blocks)])
    out += _family("longattn_prefix_cache_queries_total", "counter", "Admissions that looked for a reusable prefix.",
                   [({}, m.prefix_queries)])
    out += _family("longattn_prefix_cache_hits_total", "counter", "Admissions that reused a cached prefix.",
                   [({}, m.prefix_hits)])
    out += _family("longattn_prefix_cache_tokens_total", "counter", "Prompt tokens not prefilled thanks to reuse.",
                   [({}, m.prefix_tokens)])
    out += _family("longattn_sparse_total", "counter", "SCSA's work over the finished requests' sparse layers "
                   "(calls; key rows read exactly, opened in clusters, scored as clusters; index rebuilds).",
                   [({"counter": k}, v) for k, v in sorted(m.sparse.items())])
    out += [
        "# HELP longattn_step_seconds Engine step time (a batched decode step and a prefill chunk).",
        "# TYPE longattn_step_seconds summary",
        f"longattn_step_seconds_sum {m.step_seconds:.6f}",
        f"longattn_step_seconds_count {m.steps}",
    ]
    out += _family("longattn_decode_batch_size", "gauge", "Requests in the latest batched decode step.",
                   [({}, m.decode_batch)])
    out += _family("longattn_last_step_seconds", "gauge", "The latest engine step's time.",
                   [({}, f"{m.last_step_seconds:.6f}")])
    return "\n".join(out) + "\n"
