"""gpt-oss from a tiny random checkpoint saved by transformers: learned per-head sink logits
in every softmax denominator, the top-k routed MoE MLP, alternating windows and yarn rope;
logits within 1e-4 of transformers on the full forward, chunked prefill and step decode.
The sinks hold on the banded prefill, the static step and SCSA as well."""

import pytest
import torch

from conftest import three_ways, tiny_dir

CASES = {"windowed": ({}, [8, None, 8]), "full": ({"sliding_window": 4096}, [4096, None, 4096])}


def _pair(over):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = tiny_dir("gpt_oss", **over)
    ck = load_checkpoint(d, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return build_model(ck.config, ck.state_dict), hf


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_oss_matches_transformers(name):
    over, windows = CASES[name]
    ours, hf = _pair(over)
    cfg = ours.config
    assert cfg.layer_windows == windows and cfg.learned_sinks and cfg.num_experts == 4
    assert cfg.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(8))
    a, b = three_ways(ours, ids), three_ways(hf, ids, hf=True)
    for mode in a:
        err = (a[mode] - b[mode]).abs().max().item()
        assert err < 1e-4, f"gpt_oss {name} {mode}: max |delta logit| {err:.2e}"
    # the learned sinks matter: without them (logit -inf) the logits move
    for blk in ours.model.layers:
        blk.self_attn.sinks.data.fill_(-1e30)
    assert (ours(ids) - a["full"]).abs().max() > 1e-3


def test_gpt_oss_sparse_decode_with_learned_sinks():
    """SCSA on gpt-oss's global layer: at tau 0 (every cluster opened, f32 rows) sparse decode
    equals dense decode within the derived bound, eager and in the static step."""
    from longattn.engine.session import Session
    from longattn.engine.static_step import StaticDecoder
    from longattn.policy import AttentionPolicy
    from longattn.sparse import SCSAConfig
    from longattn.sparse.policy import build_sparse_policy, stream_layers
    from conftest import tiny_model
    from tolerance import LOGIT_FLOOR, assert_within_derived
    m, m64 = tiny_model("gpt_oss"), tiny_model("gpt_oss", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, m.config.vocab_size, (1, 300), generator=g)
    steps = torch.randint(0, m.config.vocab_size, (8,), generator=g)
    scsa = SCSAConfig(cluster_size=16, rebuild_interval=64, block_size=128, recent=8, sink=2, min_context=0,
                      outliers=0, dense_when_cheaper=False, packing="f32", calib_steps=0, tau_default=0.0)

    def decode(model, policy, keep=None):
        s = Session(model, policy)
        out = [s.prefill(prompt)[:, 0]]
        out += [s.step(t.view(1)) for t in steps]
        if keep is not None:
            keep.append(s.cache)
        return torch.cat(out)

    # the checkpoint's windows stay on its windowed layers; its global layer goes sparse
    ref, dense = decode(m64, AttentionPolicy.from_config(m64.config)), decode(m, AttentionPolicy.from_config(m.config))
    pol = build_sparse_policy(m.config, scsa)
    caches = []
    sparse = decode(m, pol, caches)
    ran = stream_layers(caches[0])
    assert ran and all(sc.counters["opened_rows"] > 0 for sc in ran.values())  # SCSA really ran
    assert_within_derived(sparse, dense, ref, floor=LOGIT_FLOOR, what="eager sparse")
    dec = StaticDecoder(m, build_sparse_policy(m.config, scsa), max_len=320, compile=False)
    out = [dec.prefill(prompt)[:, 0]] + [dec.step(t.view(1)) for t in steps]
    assert_within_derived(torch.cat(out), dense, ref, floor=LOGIT_FLOOR, what="static sparse")


def test_gpt_oss_banded_prefill_with_learned_sinks():
    """A long windowed prefill takes the banded kernel, learned sinks included: equal to the
    masked path within the derived bound."""
    from longattn.engine.session import Session
    from longattn.policy import AttentionPolicy
    from conftest import tiny_model
    from tolerance import LOGIT_FLOOR, assert_within_derived
    m, m64 = tiny_model("gpt_oss"), tiny_model("gpt_oss", dtype=torch.float64)
    ids = torch.randint(0, m.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    banded = AttentionPolicy.build(m.config, "window", window=24, sinks=2, banded_min_tokens=64)
    masked = AttentionPolicy.build(m.config, "window", window=24, sinks=2, banded_min_tokens=None)
    ref = m64(ids, policy=AttentionPolicy.build(m64.config, "window", window=24, sinks=2))
    out = Session(m, banded).prefill(ids, chunk=0, logits="all")
    assert_within_derived(out, m(ids, policy=masked), ref, floor=LOGIT_FLOOR)


def test_gpt_oss_moe_gathered_equals_routed_loop():
    """The compiled step's MoE form (each token's k experts' weights gathered, no loop over the
    chosen experts) computes the eager loop's mixture, within the derived bound."""
    from conftest import tiny_model
    from tolerance import assert_within_derived
    m, m64 = tiny_model("gpt_oss"), tiny_model("gpt_oss", dtype=torch.float64)
    x = torch.randn(6, 1, m.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for layer, layer64 in zip(m.model.layers, m64.model.layers):
        mlp, mlp64 = layer.mlp, layer64.mlp
        h = x.reshape(-1, x.shape[-1])
        top, idx = torch.topk(mlp.router(h), mlp.top_k, dim=-1)
        gathered = mlp._gathered(h, idx, torch.softmax(top, -1))
        assert_within_derived(gathered, mlp(x).reshape_as(h), mlp64(x.double()).reshape_as(h))
