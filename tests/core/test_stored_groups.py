"""A GGUF's own 4- and 5-bit groups run as int4 and int5 exactly, and ``auto`` picks those
formats only for them.

Q4_1 is int4's layout byte for byte and Q4_0 is ``d * (u - 8)``; Q5_1 is int5's and Q5_0 is
``d * (u - 16)``: read as stored, the matrices are the file's weights bit for bit
(``torch.equal`` against the float32 conversion), so the default format costs nothing against
the checkpoint beyond the decode's rounding of activations (llama.cpp rounds them the same way).
"""

from __future__ import annotations

import json

import pytest
import torch

from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.gguf_file import load_gguf, read_stored_groups
from longattn.checkpoint.prepared import RECIPE_FILE, prepared_model, resolve_recipe
from longattn.models import build_model
from longattn.models.transformer import Linear
from longattn.models.weights import auto_recipe, int4_as_int5, parse_recipe
from longattn.ops.linear import dequantize_int4, dequantize_int5
from tiny_gguf import write_tiny_gguf

IDS = torch.tensor([[3, 17, 42, 5, 88, 61, 9, 30, 2, 77, 14]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("kind,fmt", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q5_0", "int5"), ("Q5_1", "int5")])
def test_stored_groups_are_the_files_weights_bit_for_bit(tmp_path, kind, fmt):
    f = write_tiny_gguf(tmp_path / "m.gguf", seed=3, mlp_type=kind, attn_type=kind)
    _, sd = load_gguf(f)
    stored = read_stored_groups(f)
    # every projection, llama's permuted q/k rows included; the float32 tables are not groups
    assert len(stored) == 2 * 7 and "model.embed_tokens.weight" not in stored
    deq = dequantize_int4 if fmt == "int4" else dequantize_int5
    for name, (got, parts) in stored.items():
        assert got == fmt
        assert torch.equal(deq(*parts), sd[name]), name
        assert torch.equal(deq(*parts, dtype=torch.float64).float(), sd[name]), name
    if fmt == "int5":  # the files' fifth bits are used: dropping them changes the weights
        name, (_, (codes, hbits, d, m)) = next(iter(stored.items()))
        assert bool(hbits.any()) and not torch.equal(dequantize_int5(codes, hbits * 0, d, m), sd[name])


def test_other_block_types_are_not_taken_as_groups(tmp_path):
    f = write_tiny_gguf(tmp_path / "m.gguf", mlp_type="Q8_0")
    assert read_stored_groups(f) == {}


def _names(layers=2, tied=True):
    out = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(layers):
        out += [f"model.layers.{i}.{m}.weight" for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return out


def test_auto_recipe_keeps_int8_for_every_kind_not_stored_in_4_or_5_bits():
    names = _names()
    projections = {n: "int4" for n in names[1:]}
    assert auto_recipe(names, projections) == "int4+int8:embed"
    assert auto_recipe(names, dict.fromkeys(names, "int4")) == "int4"
    assert auto_recipe(names, {}) == "int8"
    # one layer's v stored otherwise: the fused qkv of every layer stays int8
    v1 = "model.layers.1.self_attn.v_proj.weight"
    assert auto_recipe(names, {n: f for n, f in projections.items() if n != v1}) == "int4+int8:qkv,embed"
    # ... or in 5 bits: qkv takes int5, which holds both exactly
    assert auto_recipe(names, {**projections, v1: "int5"}) == "int4+int8:embed+int5:qkv"
    untied = _names(tied=False)
    assert auto_recipe(untied, dict.fromkeys(untied[2:], "int4")) == "int4+int8:embed,lm_head"
    # a file of 5-bit groups with an 8-bit head (Qwen2.5's GGUF is mostly so)
    five = dict.fromkeys(untied, "int5")
    del five["lm_head.weight"]
    assert auto_recipe(untied, five) == "int5+int8:lm_head"
    # a matrix of a kind the rule does not know (an expert router) makes it plain int8
    assert auto_recipe(names + ["model.layers.0.mlp.router.weight"], dict.fromkeys(names, "int4")) == "int8"
    assert parse_recipe("AUTO") == ("auto", ())


@pytest.mark.parametrize("mlp,attn,recipe", [("Q4_0", "Q4_1", "int4+int8:embed,lm_head"),
                                             ("Q5_0", "Q4_1", "int4+int8:embed,lm_head+int5:gate_up,down_proj"),
                                             ("Q5_1", "Q5_0", "int5+int8:embed,lm_head")])
def test_auto_prepares_the_files_groups_exactly_and_remembers_the_recipe(cache, tmp_path, mlp, attn, recipe):
    f = write_tiny_gguf(tmp_path / "m.gguf", seed=5, mlp_type=mlp, attn_type=attn)
    ck = load_checkpoint(str(f), progress=False)
    fmt, kinds, stored = resolve_recipe(ck, "auto")
    assert (fmt, kinds) == parse_recipe(recipe)
    want_model = build_model(ck.config, ck.state_dict, weights=fmt, kinds=kinds, stored=stored)
    want = want_model(IDS)
    first = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "auto", progress=False)
    assert first.weights == recipe
    assert torch.equal(first(IDS), want)
    # the int4 and int5 matrices are the file's weights: the fused rows are its q, k, v (gate, up) rows
    fused = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
    for name, mod in first.named_modules():
        if isinstance(mod, Linear) and mod.codes is not None:
            *path, last = name.split(".")
            parts = [f"{'.'.join(path)}.{p}.weight" for p in fused.get(last, (last,))]
            assert torch.equal(mod.effective_weight(), torch.cat([ck.state_dict[p] for p in parts])), name
    (entry,) = (cache / "prepared").iterdir()
    assert json.loads((entry / RECIPE_FILE).read_text())["recipe"] == recipe
    second = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "auto", progress=False)
    assert torch.equal(second(IDS), want) and second.weights == first.weights
    # without the file's groups they would be quantized again: Q4_0's and Q5_0's grids are
    # not min/max
    requant = build_model(ck.config, ck.state_dict, weights=fmt, kinds=kinds)
    assert not torch.equal(requant(IDS), want)


def test_a_kind_stored_in_4_and_5_bits_runs_as_int5_with_the_files_values(tmp_path):
    """A fused matrix whose parts are stored in 4 and 5 bits takes int5, the 4-bit parts
    widened exactly (fifth bits 0)."""
    f = write_tiny_gguf(tmp_path / "m.gguf", seed=7, mlp_type="Q4_1", attn_type="Q4_1")
    ck = load_checkpoint(str(f), progress=False)
    stored = read_stored_groups(f)
    v1 = "model.layers.1.self_attn.v_proj.weight"
    stored[v1] = ("int5", int4_as_int5(*stored[v1][1]))
    matrices = [k for k, t in ck.state_dict.items() if t.dim() == 2]
    fmt, kinds = parse_recipe(auto_recipe(matrices, {k: f for k, (f, _) in stored.items()}))
    assert (fmt, kinds) == ("int4", (("embed", "int8"), ("lm_head", "int8"), ("qkv", "int5")))
    m = build_model(ck.config, ck.state_dict, weights=fmt, kinds=kinds, stored=stored)
    for i, layer in enumerate(m.model.layers):
        qkv = layer.self_attn.qkv
        assert qkv.hbits is not None and layer.mlp.gate_up.hbits is None
        want = torch.cat([ck.state_dict[f"model.layers.{i}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(qkv.effective_weight(), want)


def test_a_damaged_recipe_record_is_prepared_again(cache, tmp_path):
    f = write_tiny_gguf(tmp_path / "m.gguf", seed=6, mlp_type="Q4_1", attn_type="Q4_1")
    first = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "auto", progress=False)
    (entry,) = (cache / "prepared").iterdir()
    (entry / RECIPE_FILE).write_text('{"recipe": "int8"}')
    with pytest.warns(UserWarning, match="damaged"):
        again = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "auto", progress=False)
    assert again.weights == first.weights and torch.equal(again(IDS), first(IDS))


@pytest.mark.real
def test_bundled_q4_1_model_runs_its_own_weights():
    ck = load_checkpoint("smollm2-135m", progress=False)
    fmt, kinds, stored = resolve_recipe(ck, "auto")
    assert (fmt, kinds) == ("int4", (("embed", "int8"),))  # the file's embedding table is Q8_0
    assert len(stored) == 7 * ck.config.num_layers
    for name, (got, parts) in stored.items():
        assert got == "int4" and torch.equal(dequantize_int4(*parts), ck.state_dict[name]), name
