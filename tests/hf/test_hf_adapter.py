"""longattn.hf: transformers' generate with longattn's caches equals longattn's own engine.

Tolerances are derived per case: the float32 error of longattn's own engine against its
float64 run (same policy, same tokens), doubled. Greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_dir, tiny_model

import longattn.hf as lh
from longattn.cache.factory import make_cache
from longattn.errors import LongattnError
from longattn.hf.policy import sink_policy
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session


def hf_model(family: str, **over):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir(family, **over), dtype=torch.float32).eval()


PROMPT = [3, 17, 42, 8, 61, 25, 90, 14, 33, 7, 52, 71, 19, 44]  # 14 tokens: longer than the windows


def hf_greedy(hf, cache, prompt, n):
    """transformers' greedy generate: (new tokens, raw logits ``[n, V]``)."""
    out = hf.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).double()


def engine_logits(model, policy, prompt, forced, cache=None):
    """longattn's engine, teacher-forced: logits ``[len(forced), V]`` predicting each forced token."""
    s = Session(model, policy, cache=cache)
    rows = [s.prefill([prompt])[0, 0]]
    for t in forced[:-1]:
        rows.append(s.step(torch.tensor([t]))[0])
    return torch.stack(rows).double()


def engine_greedy(model, policy, prompt, n, cache=None):
    s = Session(model, policy, cache=cache)
    logits, toks = s.prefill([prompt])[:, 0], []
    for _ in range(n):
        toks.append(int(logits.argmax(-1)))
        logits = s.step(torch.tensor(toks[-1:]))
    return toks


def assert_matches_engine(family, hf_cache_fn, policy_fn, n=24, engine_cache_fn=None, floor_fn=None):
    """HF generate with the longattn cache vs longattn's engine (float32 and float64).
    ``floor_fn(m32, pol32, tokens)``: an error source the float32 comparison does not show, as
    ``tolerance.derived_bound``'s floor."""
    hf = hf_model(family)
    tokens, hf_logits = hf_greedy(hf, hf_cache_fn(hf), PROMPT, n)
    lh.detach(hf)
    m32, m64 = tiny_model(family), tiny_model(family, dtype=torch.float64)
    pol32, pol64 = policy_fn(m32.config), policy_fn(m64.config)
    fresh = engine_cache_fn or (lambda model, policy: None)
    assert engine_greedy(m32, pol32, PROMPT, n, fresh(m32, pol32)) == tokens
    c32, c64 = fresh(m32, pol32), fresh(m64, pol64)
    ref = engine_logits(m64, pol64, PROMPT, tokens, c64)
    err32 = (engine_logits(m32, pol32, PROMPT, tokens, c32) - ref).abs().max().item()
    err_hf = (hf_logits - ref).abs().max().item()
    floor = floor_fn(m32, pol32, tokens) if floor_fn else 0.0
    assert err_hf <= 2 * err32 + floor, f"{family}: HF {err_hf:.3e} vs engine float32 {err32:.3e} (+ {floor:.3e})"
    return err_hf, err32


@pytest.mark.parametrize("family,window,sinks", [("llama", 5, 2), ("llama", 6, 0), ("qwen3", 4, 1),
                                                 ("qwen2", 7, 3), ("gemma3", 6, 2), ("mistral", 5, 2),
                                                 ("phi3", 6, 1), ("gemma2", 5, 2), ("gpt_oss", 6, 2)])
def test_sink_cache_generate_equals_engine(family, window, sinks):
    """Window + sinks on every layer, across many ring wraps (24 steps, rings of 4-7)."""
    assert_matches_engine(
        family, lambda hf: lh.apply(hf, window=window, sinks=sinks, layers="all"),
        lambda cfg: AttentionPolicy.build(cfg, "window", window=window, sinks=sinks))


# gpt-oss is left out: transformers' float64 run of it fails (its experts' grouped matmul has no
# float64 kernel); test_sink_cache_generate_equals_engine covers it against the engine.
@pytest.mark.parametrize("family", ["gemma3", "mistral", "phi3", "gemma2"])
def test_trained_windows_equal_transformers_default_cache(family):
    """The families trained with windows (window 8: Gemma 3 on 4 of 6 layers, Mistral and Phi-3
    on every layer, Gemma 2 on alternate ones): SinkCache without sinks keeps the trained
    windows (rings on the windowed layers, global ones growing) and gives transformers'
    default cache's tokens, its logits within twice the default's error against transformers'
    float64 run (float32 summation-order error)."""
    from longattn.hf.policy import model_config
    hf = hf_model(family)
    prompt, n = PROMPT + PROMPT[:6], 16  # 20 tokens: past the trained window of 8
    ref_tokens, ref32 = hf_greedy(hf, None, prompt, n)
    cache = lh.apply(hf, sinks=0)
    tokens, ours = hf_greedy(hf, cache, prompt, n)
    windows = model_config(hf.config).layer_windows
    kinds = [type(l.inner).__name__ for l in cache.layers]
    assert kinds == ["RingLayerCache" if w else "GrowingLayerCache" for w in windows]
    assert any(windows)
    assert cache.tokens() == [8 if w else len(prompt) + n - 1 for w in windows]
    lh.detach(hf)
    assert tokens == ref_tokens
    hf64 = hf_model(family).double()
    x = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        ref64 = hf64(x).logits[0, len(prompt) - 1:].double()
    err_default = (ref32 - ref64).abs().max().item()
    err_ours = (ours - ref64).abs().max().item()
    assert err_ours <= 2 * err_default, f"ours {err_ours:.3e} vs default cache {err_default:.3e}"


class _Bytes:
    """Stopping criterion that records the cache's bytes and filled slots after every step."""

    def __init__(self, cache):
        self.cache, self.seen = cache, []

    def __call__(self, input_ids, scores, **kw):
        self.seen.append((self.cache.nbytes(), max(self.cache.tokens())))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_ring_cache_bytes_constant_over_long_generation():
    """20,000 generated tokens (past the tiny model's 4,096 positions, as a stream runs): a
    SinkCache's bytes never change and its layers hold sinks + window slots, while
    transformers' default cache grows with every token."""
    from transformers import DynamicCache, StoppingCriteriaList
    hf = hf_model("llama", num_hidden_layers=1)
    n, W, S = 20_000, 16, 4
    cache = lh.apply(hf, window=W, sinks=S)
    rec = _Bytes(cache)
    hf.generate(torch.tensor([PROMPT]), past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, stopping_criteria=StoppingCriteriaList([rec]))
    lh.detach(hf)
    assert len(rec.seen) == n
    kv = 2 * hf.config.num_key_value_heads * hf.config.head_dim * 4  # K + V bytes per slot, float32
    assert {b for b, _ in rec.seen} == {(W + S) * kv}
    assert rec.seen[-1][1] == W + S
    default = DynamicCache(config=hf.config)
    hf.generate(torch.tensor([PROMPT]), past_key_values=default, max_new_tokens=64, min_new_tokens=64,
                do_sample=False)
    assert default.get_seq_length() == len(PROMPT) + 63 > W + S


def _reindexed(model, policy):
    return make_cache(model.config, policy, model=model, reindex=True, dtype=model.activation_dtype)


@pytest.mark.parametrize("family,window,sinks", [("llama", 5, 2), ("gemma3", 6, 3)])
def test_shifting_sink_cache_equals_engine_reindex(family, window, sinks):
    """StreamingLLM's position shift: ShiftingSinkCache equals longattn's re-indexing ring
    (sink keys re-rotated on read) across the wraps."""
    assert_matches_engine(
        family, lambda hf: lh.apply(hf, window=window, sinks=sinks, layers="all", shift=True),
        lambda cfg: AttentionPolicy.build(cfg, "window", window=window, sinks=sinks),
        engine_cache_fn=_reindexed)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
@pytest.mark.parametrize("family,window,sinks,shift", [("llama", 5, 2, False), ("gemma3", 6, 3, False),
                                                       ("qwen2", 7, 3, True)])
def test_kv_formats_equal_engine_caches_of_the_same_format(kv, family, window, sinks, shift):
    """apply(kv=...): the cache stores keys and values as longattn's own caches of that format do
    (int8 keys rotated, queries turned with them; shifted sinks re-rotated through the storage
    rotation), so transformers' generate gives the engine's tokens on a cache of the same format.

    Logits: a key within float32 rounding of a bfloat16 or q8 rounding boundary may round either
    way in two float32 implementations, so the floor is the format's whole effect on the engine's
    logits (format against f32 storage, same tokens); a query left unturned, or rows stored in
    another format, costs far more than that."""
    from longattn.cache.kv_format import KV_FORMATS

    def engine_cache(model, policy, dtype=KV_FORMATS[kv]):
        return make_cache(model.config, policy, model=model, reindex=shift, dtype=dtype)

    def format_effect(m32, pol32, tokens):
        fmt = engine_logits(m32, pol32, PROMPT, tokens, engine_cache(m32, pol32))
        f32 = engine_logits(m32, pol32, PROMPT, tokens, engine_cache(m32, pol32, torch.float32))
        return (fmt - f32).abs().max().item()
    assert_matches_engine(
        family, lambda hf: lh.apply(hf, window=window, sinks=sinks, layers="all", shift=shift, kv=kv),
        lambda cfg: AttentionPolicy.build(cfg, "window", window=window, sinks=sinks),
        engine_cache_fn=engine_cache, floor_fn=format_effect)


def test_kv_format_cache_holds_its_formats_bytes_and_refuses_an_unknown_format():
    from longattn.cache.kv_format import row_bytes
    hf = hf_model("llama")
    D, Hkv = hf.config.head_dim, hf.config.num_key_value_heads
    for kv, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8)):
        cache = lh.apply(hf, window=6, sinks=2, layers="all", kv=kv)
        hf_greedy(hf, cache, PROMPT, 4)
        assert cache.nbytes() == hf.config.num_hidden_layers * 2 * Hkv * 8 * row_bytes(dtype, D)
    with pytest.raises(LongattnError, match="kv must be one of f32, bf16, int8"):
        lh.apply(hf, window=6, kv="fp8")
    lh.detach(hf)


def _evict_run(step, evict, prompt, span, n, forced=None):
    """Prefill, evict ``span``, then ``n`` greedy (or ``forced``) steps: (tokens, logits ``[n + 1, V]``)."""
    rows = [step(prompt)]
    evict(*span)
    toks = []
    for i in range(n):
        toks.append(int(rows[-1].argmax()) if forced is None else forced[i])
        rows.append(step([toks[-1]]))
    return toks, torch.stack(rows).double()


def test_evict_renumber_equals_engine_evict():
    """SinkCache.evict: forget a span, renumber (re-rotating later keys) and decode on; equals
    longattn's own evict on its engine cache (cache/evict.py)."""
    from longattn.cache.evict import evict
    W, S, span, n = 6, 2, (9, 11), 10
    hf = hf_model("llama")
    cache = lh.apply(hf, window=W, sinks=S)

    def hf_step(ids):
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    tokens, ours = _evict_run(hf_step, cache.evict, PROMPT, span, n)
    lh.detach(hf)
    assert cache.get_seq_length() == len(PROMPT) - 2 + n

    def engine(model, forced=None):
        s = Session(model, AttentionPolicy.build(model.config, "window", window=W, sinks=S))
        def step(ids):
            return (s.prefill([ids])[0, 0] if len(ids) > 1 else s.step(torch.tensor(ids))[0])
        return _evict_run(step, lambda a, b: evict(s.cache, a, b, model), PROMPT, span, n, forced)
    t32, l32 = engine(tiny_model("llama"))
    _, l64 = engine(tiny_model("llama", dtype=torch.float64), tokens)
    assert tokens == t32
    assert (ours - l64).abs().max() <= 2 * (l32 - l64).abs().max()


def _char_tokenizer(vocab):
    """A stand-in tokenizer for the tiny vocabulary: one id per character."""
    def tok(text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [2 + ord(c) % (vocab - 2) for c in text]}
    return tok


def test_stream_score_equals_longattn_stream():
    """longattn.hf.stream_score equals longattn's own stream (same ids, chunks and policy):
    bits/token within twice longattn's float32 error against float64; cache bounded."""
    from conftest import book_text
    from longattn.lab.stream import stream_score
    W, S, chunk = 24, 4, 64
    text = book_text(700)
    tok = _char_tokenizer(96)
    hf = hf_model("qwen3")
    pieces = [text[i:i + 100] for i in range(0, len(text), 100)]
    ours = lh.stream_score(hf, tok, iter(pieces), window=W, sinks=S, chunk=chunk)
    assert hf.config._attn_implementation != "longattn"  # detached again
    ids = torch.tensor(tok(text)["input_ids"])
    res = {}
    for dt in (torch.float32, torch.float64):
        m = tiny_model("qwen3", dtype=dt)
        pol = AttentionPolicy.build(m.config, "window", window=W, sinks=S)
        res[dt] = stream_score(m, ids, pol, make_cache(m.config, pol, dtype=m.activation_dtype), chunk=chunk)
    assert ours.tokens == res[torch.float32].tokens == len(ids) and ours.scored == len(ids) - 1
    ref = res[torch.float64].bits_per_token
    assert abs(ours.bits_per_token - ref) <= 2 * abs(res[torch.float32].bits_per_token - ref)
    assert ours.max_cache_bytes == ours.cache_bytes == res[torch.float32].cache_bytes
    assert ours.max_cache_tokens == W + S


def test_refusals_are_one_clear_line():
    from transformers import DynamicCache, GPT2Config
    from longattn.hf.policy import check_transformers_version
    with pytest.raises(LongattnError, match="longattn.hf serves llama, mistral, .*; this one is 'gpt2'"):
        lh.model_config(GPT2Config())
    with pytest.raises(LongattnError, match="transformers >= 5.23"):
        check_transformers_version("4.57.1")
    with pytest.raises(LongattnError, match="transformers >= 5.23"):
        check_transformers_version("6.0.0")
    hf = hf_model("llama")
    with pytest.raises(LongattnError, match="needs window=W"):
        lh.SinkCache(hf.config)
    cfg = lh.model_config(hf.config)
    with pytest.raises(LongattnError, match="layers; the model has"):
        lh.apply(hf, AttentionPolicy.build(cfg, "window", window=4).__class__([]))
    assert hf.config._attn_implementation != "longattn"  # nothing applied by a refused call
    with pytest.raises(LongattnError, match="call longattn.hf.apply"):
        hf(input_ids=torch.tensor([PROMPT]), past_key_values=lh.SinkCache(hf.config, window=4))
    cache = lh.apply(hf, window=4, sinks=1)
    x = torch.tensor([PROMPT, PROMPT])
    with pytest.raises(LongattnError, match="padded batches"):
        hf(input_ids=x, attention_mask=torch.tensor([[0] + [1] * 13, [1] * 14]), past_key_values=cache)
    with pytest.raises(LongattnError, match="needs past_key_values"):
        hf(input_ids=x, past_key_values=DynamicCache(config=hf.config))
    with pytest.raises(LongattnError, match="position_ids differ"):
        hf(input_ids=x[:, :4], position_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=lh.SinkCache(
            hf.config, window=4))
    with pytest.raises(LongattnError, match="cannot be cropped"):
        cache.crop(-1)
    lh.detach(hf)


def test_detach_restores_transformers_attention_bit_for_bit():
    hf = hf_model("qwen2")
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        before = hf(input_ids=x).logits
        with lh.attached(hf, window=4) as cache:
            windowed = hf(input_ids=x, past_key_values=cache).logits
        after = hf(input_ids=x).logits
    assert torch.equal(before, after)
    assert not torch.allclose(before, windowed)  # the window really changed the function
    assert torch.allclose(before[:, :4], windowed[:, :4], atol=1e-5)  # not before it takes effect


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
def test_real_generate_with_sink_cache_equals_engine(name):
    """The three bundled models: transformers' generate with SinkCache (window 24 + 4 sinks;
    on Gemma 3 in place of its trained windows, its global layers staying global) gives
    longattn's greedy tokens; its logits stay within twice the two implementations' own
    disagreement on the full-attention run of the same tokens."""
    from conftest import book_text, oracle_model, real_checkpoint, real_model
    W, S, n = 24, 4, 24
    ck, ours, hf = real_checkpoint(name), real_model(name), oracle_model(name)
    prompt = ck.tokenizer(book_text(600))["input_ids"][:40]
    cache = lh.apply(hf, window=W, sinks=S)
    tokens, hf_logits = hf_greedy(hf, cache, prompt, n)
    lh.detach(hf)
    pol = sink_policy(ours.config, window=W, sinks=S)
    assert engine_greedy(ours, pol, prompt, n) == tokens
    err = (hf_logits - engine_logits(ours, pol, prompt, tokens)).abs().max().item()
    dense = AttentionPolicy.build(ours.config, "dense")
    with torch.no_grad():
        hf_dense = hf(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].double()
    base = (hf_dense - engine_logits(ours, dense, prompt, tokens)).abs().max().item()
    assert err <= 2 * base, f"windowed {err:.3e} vs dense disagreement {base:.3e}"


def test_equal_length_streams_batched_each_equal_engine():
    """Two streams in one generate call: each gives the engine's single-stream tokens."""
    W, S, n = 5, 2, 12
    hf = hf_model("llama")
    prompts = [PROMPT, PROMPT[::-1]]
    out = hf.generate(torch.tensor(prompts), past_key_values=lh.apply(hf, window=W, sinks=S),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False)
    lh.detach(hf)
    m = tiny_model("llama")
    pol = AttentionPolicy.build(m.config, "window", window=W, sinks=S)
    assert [engine_greedy(m, pol, p, n) for p in prompts] == out[:, len(PROMPT):].tolist()


def test_banded_prefill_served_through_the_attention_function(monkeypatch):
    """A policy whose banded threshold a prefill reaches runs longattn's banded O(T*W) op
    inside transformers, within twice the masked path's float32 error against float64."""
    import longattn.ops.banded as banded
    calls = []
    real = banded.banded_attention
    monkeypatch.setattr(banded, "banded_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    W, S, ids = 6, 2, (PROMPT * 3)[:40]
    hf = hf_model("qwen3")
    cfg = lh.model_config(hf.config)
    cache = lh.apply(hf, AttentionPolicy.build(cfg, "window", window=W, sinks=S, banded_min_tokens=16))
    with torch.no_grad():
        ours = hf(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0].double()
    lh.detach(hf)
    assert len(calls) == cfg.num_layers
    calls.clear()
    full = {}
    for dt in (torch.float32, torch.float64):
        m = tiny_model("qwen3", dtype=dt)
        pol = AttentionPolicy.build(m.config, "window", window=W, sinks=S, banded_min_tokens=None)
        full[dt] = Session(m, pol).prefill([ids], logits="all")[0].double()
    assert not calls
    ref = full[torch.float64]
    assert (ours - ref).abs().max() <= 2 * (full[torch.float32] - ref).abs().max()


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_sparse_scsa_cache_served_through_the_attention_function(family):
    """SCSA decode inside transformers: with tau 0 it equals the checkpoint's attention within
    the sparse model test's bound (twice the dense float32 error against float64, plus 1e-6),
    and it really read through clusters, in the cache apply() returned. gpt-oss:
    SCSA on its global layer, transformers' learned sink logits passed through to it."""
    from longattn.sparse import SCSAConfig
    from longattn.sparse.policy import build_sparse_policy, stream_layers
    small = dict(cluster_size=16, rebuild_interval=64, block_size=256, recent=8, sink=2, min_context=0,
                 outliers=2, dense_when_cheaper=False, packing="f32", calib_steps=0, tau_default=0.0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (300,), generator=g).tolist()
    hf = hf_model(family)
    pol = build_sparse_policy(lh.model_config(hf.config), SCSAConfig(**small))
    cache = lh.apply(hf, pol)
    tokens, ours = hf_greedy(hf, cache, prompt, 8)
    ran = stream_layers(cache)
    assert ran and all(sc.counters["opened_rows"] > 0 for sc in ran.values())
    lh.detach(hf)
    dense = {}
    for dt in (torch.float32, torch.float64):
        m = tiny_model(family, dtype=dt)
        dense[dt] = engine_logits(m, AttentionPolicy.from_config(m.config), prompt, tokens)
    ref = dense[torch.float64]
    assert (ours - ref).abs().max() <= 2 * (dense[torch.float32] - ref).abs().max() + 1e-6


def test_second_turn_reuses_the_cache_like_one_long_prefill():
    """A chat's second generate call on the same cache feeds only the new tokens and continues
    as the engine does over the whole conversation at once (the ring wrapped in between)."""
    W, S = 6, 2
    hf = hf_model("llama")
    cache = lh.apply(hf, window=W, sinks=S)
    first = hf.generate(torch.tensor([PROMPT]), past_key_values=cache, max_new_tokens=8, min_new_tokens=8,
                        do_sample=False)
    convo = first[0].tolist() + PROMPT[:5]
    tokens, ours = hf_greedy(hf, cache, convo, 4)
    lh.detach(hf)
    assert cache.get_seq_length() == len(convo) + 3
    res = {}
    for dt in (torch.float32, torch.float64):
        m = tiny_model("llama", dtype=dt)
        res[dt] = engine_logits(m, AttentionPolicy.build(m.config, "window", window=W, sinks=S), convo, tokens)
    assert tokens == res[torch.float32].argmax(-1).tolist()
    ref = res[torch.float64]
    assert (ours - ref).abs().max() <= 2 * (res[torch.float32] - ref).abs().max()
