"""The fixed-shape decode step (engine/static_step.py StaticDecoder), eager and compiled, in each
weight format: it agrees with the float64 reference as the eager paths do (within twice the
plain full forward's error), across a ring wrap and with sinks; batched streams equal each
alone; and compiling traces one graph that never recompiles while decoding."""

import uuid

import pytest
import torch

from conftest import tiny_formats
from longattn.errors import LongattnError
from longattn.ops import linear
from longattn.ops import native
from longattn.policy import AttentionPolicy
from longattn.engine.static_step import StaticDecoder
from model_paths import ids_for
from tolerance import LOGIT_FLOOR, derived_tolerance, max_err


tiny = tiny_formats


def policy_for(cfg, window, sinks):
    return AttentionPolicy.from_config(cfg) if window is None else \
        AttentionPolicy.build(cfg, "window", window=window, sinks=sinks)


def decode_logits(dec, ids, n_prompt):
    """Logits ``[B, T - n_prompt + 1, V]``: after the prompt, then after each fed token."""
    out = [dec.prefill(ids[:, :n_prompt])[:, 0]]
    for t in range(n_prompt, ids.shape[1]):
        out.append(dec.step(ids[:, t]))
    return torch.stack(out, 1)


def reference_and_tol(m, m64, pol, ids, n):
    """Float64 logits from position n-1 on, and twice the full forward's error against them."""
    ref = m64(ids, policy=pol)[:, n - 1:]
    full = m(ids, policy=pol)[:, n - 1:]
    return ref, derived_tolerance(full, ref, floor=LOGIT_FLOOR)


CASES = [("llama", 5, 2, "f32", False, "matmul"), ("llama", 5, 2, "int8", False, "matmul"),
         ("gemma3", None, 0, "bf16", False, "matmul"), ("qwen3", 3, 0, "int8", False, "matmul"),
         ("qwen2", None, 0, "f32", False, "matmul"), ("llama", 5, 2, "int8", True, "matmul"),
         ("gemma3", None, 0, "f32", True, "matmul"),
         # ATen's flash kernel reading the buffers: rings with sinks, hybrid groups, bf16, compiled
         ("llama", 5, 2, "f32", False, "flash"), ("gemma3", None, 0, "bf16", False, "flash"),
         ("qwen2", None, 0, "int8", False, "flash"), ("llama", 5, 2, "int8", True, "flash"),
         ("gemma3", None, 0, "f32", True, "flash"),
         # longattn's fused C++ kernel (the default): f32 and int8 (f32 buffers), rings with
         # sinks, hybrid groups, compiled; bf16 buffers fall back to matmul
         ("llama", 5, 2, "f32", False, "fused"), ("llama", 5, 2, "int8", True, "fused"),
         ("gemma3", None, 0, "f32", False, "fused"), ("gemma3", None, 0, "int8", True, "fused"),
         ("qwen3", 3, 0, "int8", False, "fused"), ("qwen2", None, 0, "bf16", False, "fused"),
         # int4 weights (activations rounded per block of 32 at decode): eager and compiled
         ("llama", 5, 2, "int4", False, "fused"), ("gemma3", None, 0, "int4", True, "fused"),
         ("qwen2", None, 0, "int4", False, "matmul"),
         # gpt-oss's learned sink logits on every buffer read, with its trained windows and an
         # imposed ring with sinks, eager and compiled
         ("gpt_oss", None, 0, "f32", False, "fused"), ("gpt_oss", 5, 2, "int8", False, "fused"),
         ("gpt_oss", None, 0, "f32", False, "matmul"), ("gpt_oss", 5, 2, "f32", False, "flash"),
         ("gpt_oss", None, 0, "int8", True, "fused")]


@pytest.mark.parametrize("family,window,sinks,weights,compiled,attention", CASES)
def test_static_decode_agrees_with_reference(monkeypatch, family, window, sinks, weights, compiled, attention):
    monkeypatch.setattr(linear, "WIDEN_ROWS", 1 << 30)  # bf16's forward = its decode arithmetic
    m, m64 = tiny(family, weights)
    pol = policy_for(m.config, window, sinks)
    ids = ids_for(2, T=24, seed=3)
    n = 6  # 18 decode steps: rings of 5 or 8 slots wrap more than once
    ref, tol = reference_and_tol(m, m64, pol, ids, n)
    if compiled:
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
    dec = StaticDecoder(m, pol, batch=2, max_len=32, compile=compiled, attention=attention)
    if attention == "fused":  # the C++ kernel really runs where it is built
        assert all(op.kernel == "fused" for op in dec._policy.ops) == native.available()
    out = decode_logits(dec, ids, n)
    err = max_err(out, ref)
    assert err <= tol, f"{err:.2e} > {tol:.2e}"
    if compiled:
        assert counters["stats"]["unique_graphs"] == 1  # one graph for all 18 steps, no recompiles


@pytest.mark.parametrize("options", [None, {}], ids=["cpp-wrapper", "inductor-defaults"])
def test_compiled_step_never_recompiles_past_the_first(options):
    torch._dynamo.reset()
    m, _ = tiny("llama", "f32")
    dec = StaticDecoder(m, policy_for(m.config, 4, 1), max_len=64, compile=True, inductor_options=options)
    ids = ids_for(1, T=20, seed=9)
    dec.prefill(ids[:, :3])
    dec.step(ids[:, 3])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(4, 20):  # positions change, the ring wraps, inputs are new tensors
            dec.step(ids[:, t])


@pytest.mark.parametrize("attention", ["fused", "matmul", "flash"])
def test_static_batched_streams_equal_each_alone(attention):
    """Two streams of different lengths decoded together and each alone: both runs of each
    stream within the derived tolerance of its float64 logits."""
    m, m64 = tiny("llama", "f32")
    pol = policy_for(m.config, 4, 2)
    prompts = [ids_for(1, 9, seed=1)[0].tolist(), ids_for(1, 3, seed=2)[0].tolist()]
    cont = ids_for(2, 6, seed=4)
    dec = StaticDecoder(m, pol, batch=2, max_len=32, compile=False, attention=attention)
    out = [dec.prefill(prompts)[:, 0]] + [dec.step(cont[:, t]) for t in range(6)]
    out = torch.stack(out, 1)
    for b in range(2):
        alone = StaticDecoder(m, pol, batch=1, max_len=32, compile=False, attention=attention)
        lone = torch.stack([alone.prefill([prompts[b]])[:, 0]] + [alone.step(cont[b:b + 1, t]) for t in range(6)], 1)
        ref, tol = reference_and_tol(m, m64, pol, torch.tensor([prompts[b] + cont[b].tolist()]), len(prompts[b]))
        for name, got in (("batched", out[b:b + 1]), ("alone", lone)):
            err = max_err(got, ref)
            assert err <= tol, f"stream {b} {name}: {err:.2e} > {tol:.2e}"


def test_static_decoder_rejects_what_it_cannot_run():
    m, _ = tiny("llama", "f32")
    with pytest.raises(LongattnError, match="max_len"):
        StaticDecoder(m, max_len=0, compile=False)
    dec = StaticDecoder(m, max_len=8, compile=False)
    dec.prefill([[1, 2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(LongattnError, match="full at 8"):
        dec.step(torch.tensor([1]))
    with pytest.raises(LongattnError, match="raise max_len"):
        StaticDecoder(m, max_len=4, compile=False).prefill([[1, 2, 3, 4, 5, 6]])
    with pytest.raises(LongattnError, match="attention must be one of"):
        StaticDecoder(m, compile=False, attention="sdpa")


@pytest.mark.parametrize("attention", ["fused", "matmul", "flash"])
def test_warmup_leaves_no_trace(attention):
    """A warm-up step (all streams inactive) writes only bin slots: decoding after it is
    bit-identical to decoding without it."""
    m, _ = tiny("llama", "f32")
    pol = policy_for(m.config, 4, 1)
    ids = ids_for(1, T=10, seed=7)
    cold = StaticDecoder(m, pol, max_len=16, compile=False, attention=attention)
    warm = StaticDecoder(m, pol, max_len=16, compile=False, attention=attention)
    assert warm.warmup() > 0
    assert torch.equal(decode_logits(cold, ids, 4), decode_logits(warm, ids, 4))


def test_dynamic_decoder_reuses_its_graph_across_lengths():
    """reset(max_len) with dynamic=True: a second length runs the same graph (no recompile),
    and the results still agree with the float64 reference."""
    torch._dynamo.reset()
    m, m64 = tiny("llama", "f32")
    pol = policy_for(m.config, None, 0)
    dec = StaticDecoder(m, pol, max_len=16, compile=True, dynamic=True)
    ids = ids_for(1, T=12, seed=11)
    decode_logits(dec, ids, 4)
    dec.reset(24)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = decode_logits(dec, ids, 4)
    ref, tol = reference_and_tol(m, m64, pol, ids, 4)
    assert max_err(out, ref) <= tol


def test_many_decoders_each_get_their_graph():
    """Dynamo's compiled-variant limit is per code object, shared by every decoder in the
    process: more decoders than its default of 8 must still compile, not fail."""
    torch._dynamo.reset()
    m, _ = tiny("llama", "f32")
    # reach the limit quickly; config.patch, not monkeypatch: restoring an aliased dynamo
    # option by setattr left it hidden, and every later compile in the process failed
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(3):
            dec = StaticDecoder(m, policy_for(m.config, 3 + n, 0), max_len=12, compile=True)
            dec.prefill([[1, 2, 3]])
            dec.step(torch.tensor([4]))


def test_compiled_graphs_are_keyed_by_the_kernel_build(monkeypatch):
    """Inductor's on-disk cache keys a graph by its code, not by the custom ops' ABI: a graph
    compiled against another build of longattn's kernels must not be loaded (it would call them
    with the old arguments). The same build hits the cache; another build's tag misses it."""
    from torch._dynamo.utils import counters
    m, _ = tiny("llama", "f32")
    pol = policy_for(m.config, 4, 1)
    ids = ids_for(1, T=8, seed=5)

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        dec = StaticDecoder(m, pol, max_len=16, compile=True)
        decode_logits(dec, ids, 4)
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    compile_once()
    assert compile_once() == (1, 0)  # the same build: loaded from the cache
    other = f"native-another-build-{uuid.uuid4().hex}"  # never compiled for before
    monkeypatch.setattr(native, "build_tag", lambda: other)
    assert compile_once() == (0, 1)  # another build: compiled afresh
