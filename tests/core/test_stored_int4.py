"""A GGUF's own 4-bit groups run as int4 exactly, and ``auto`` picks int4 only for them.

Q4_1 is int4's layout byte for byte and Q4_0 is ``d * (u - 8)``: read as stored, the int4
matrices are the file's weights bit for bit (``torch.equal`` against the float32 conversion),
so the default format costs nothing against the checkpoint beyond int4 decode's rounding of
activations (llama.cpp rounds them the same way).
"""

from __future__ import annotations

import json

import pytest
import torch

from longattn.checkpoint import load_checkpoint
from longattn.checkpoint.gguf_file import load_gguf, read_int4_blocks
from longattn.checkpoint.prepared import RECIPE_FILE, prepared_model, resolve_recipe
from longattn.models import build_model
from longattn.models.transformer import Linear
from longattn.models.weights import auto_recipe, parse_recipe
from longattn.ops.linear import dequantize_int4
from tiny_gguf import write_tiny_gguf

IDS = torch.tensor([[3, 17, 42, 5, 88, 61, 9, 30, 2, 77, 14]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_blocks_are_the_files_weights_bit_for_bit(tmp_path, kind):
    f = write_tiny_gguf(tmp_path / "m.gguf", seed=3, mlp_type=kind, attn_type=kind)
    _, sd = load_gguf(f)
    blocks = read_int4_blocks(f)
    # every projection, llama's permuted q/k rows included; the float32 tables are not blocks
    assert len(blocks) == 2 * 7 and "model.embed_tokens.weight" not in blocks
    for name, parts in blocks.items():
        assert torch.equal(dequantize_int4(*parts), sd[name]), name
        assert torch.equal(dequantize_int4(*parts, dtype=torch.float64).float(), sd[name]), name


def test_other_block_types_are_not_taken_as_int4(tmp_path):
    f = write_tiny_gguf(tmp_path / "m.gguf", mlp_type="Q8_0", attn_type="Q5_0")
    assert read_int4_blocks(f) == {}


def _names(layers=2, tied=True):
    out = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(layers):
        out += [f"model.layers.{i}.{m}.weight" for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return out


def test_auto_recipe_keeps_int8_for_every_kind_not_stored_in_4_bits():
    names = _names()
    projections = set(names[1:])
    assert auto_recipe(names, projections) == "int4+int8:embed"
    assert auto_recipe(names, set(names)) == "int4"
    assert auto_recipe(names, set()) == "int8"
    # one layer's v stored otherwise: the fused qkv of every layer stays int8
    assert auto_recipe(names, projections - {"model.layers.1.self_attn.v_proj.weight"}) == "int4+int8:qkv,embed"
    untied = _names(tied=False)
    assert auto_recipe(untied, set(untied[2:])) == "int4+int8:embed,lm_head"
    # a matrix of a kind the rule does not know (an expert router) makes it plain int8
    assert auto_recipe(names + ["model.layers.0.mlp.router.weight"], set(names)) == "int8"
    assert parse_recipe("AUTO") == ("auto", ())


def test_auto_prepares_the_files_int4_exactly_and_remembers_the_recipe(cache, tmp_path):
    f = write_tiny_gguf(tmp_path / "m.gguf", seed=5, mlp_type="Q4_0", attn_type="Q4_1")
    ck = load_checkpoint(str(f), progress=False)
    fmt, keep, blocks = resolve_recipe(ck, "auto")
    assert (fmt, keep) == ("int4", ("embed", "lm_head"))
    want_model = build_model(ck.config, ck.state_dict, weights=fmt, keep_int8=keep, int4_blocks=blocks)
    want = want_model(IDS)
    first = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "auto", progress=False)
    assert first.weights == "int4+int8:embed,lm_head"
    assert torch.equal(first(IDS), want)
    # the int4 matrices are the file's weights: the fused rows are its q, k, v (gate, up) rows
    fused = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
    for name, mod in first.named_modules():
        if isinstance(mod, Linear) and mod.codes is not None:
            *path, last = name.split(".")
            parts = [f"{'.'.join(path)}.{p}.weight" for p in fused.get(last, (last,))]
            assert torch.equal(mod.effective_weight(), torch.cat([ck.state_dict[p] for p in parts])), name
    (entry,) = (cache / "prepared").iterdir()
    assert json.loads((entry / RECIPE_FILE).read_text())["recipe"] == "int4+int8:embed,lm_head"
    second = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "auto", progress=False)
    assert torch.equal(second(IDS), want) and second.weights == first.weights
    # without the file's groups int4 would quantize them again: Q4_0's grid is not min/max
    requant = build_model(ck.config, ck.state_dict, weights=fmt, keep_int8=keep)
    assert not torch.equal(requant(IDS), want)


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
    fmt, keep, blocks = resolve_recipe(ck, "auto")
    assert (fmt, keep) == ("int4", ("embed",))  # the file's embedding table is Q8_0
    assert len(blocks) == 7 * ck.config.num_layers
    for name, parts in blocks.items():
        assert torch.equal(dequantize_int4(*parts), ck.state_dict[name]), name
