"""A quantized model rebuilt around its saved tensors, without the float32 weights.

``build_model`` reads float32 matrices, fuses and quantizes them: for Qwen2.5-0.5B that holds
~2 GB of float32 to produce ~0.6 GB of int8. ``from_prepared`` builds the same model from the
state a quantized model holds (``model.state_dict()``: packed int8/int4/int5 matrices, their scales,
norms and biases): the module tree is built, fused and converted to the quantized layout on
the meta device, so no float32 matrix is ever allocated, and each tensor of ``state`` is then
assigned as it is (memory-mapped tensors stay mapped; nothing is copied).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import LongattnError
from ..ops import native
from .transformer import Transformer, _quantize, choose_float_kernels, set_rope_tables
from .weights import QUANTIZED, parse_recipe, recipe_name

# Formats worth preparing: the ones whose prepared state is smaller than the float32 weights.
PREPARED_FORMATS = ("bf16", *QUANTIZED)


def from_prepared(cfg: ModelConfig, state: dict, recipe: str) -> Transformer:
    """The model ``build_model(cfg, sd, weights=fmt, kinds=kinds)`` returns, from its state.

    Args:
        cfg: the checkpoint's config.
        state: ``model.state_dict()`` of a model built with ``recipe`` (tensors used as given).
        recipe: the weight recipe, e.g. ``"int8"`` or ``"int4+int8:embed"`` (models.weights).

    Raises:
        LongattnError: ``state`` does not hold exactly the tensors that model has.
    """
    fmt, kinds = parse_recipe(recipe)
    if fmt not in PREPARED_FORMATS:
        raise LongattnError(f"{fmt} weights are read from the checkpoint, not prepared")
    native.available()  # builds or loads the kernels outside the meta-device block below
    # Only factory calls run on the meta device: any arithmetic there would go through
    # torch's Python decompositions and import torch._dynamo (~0.7 s of every start).
    with torch.device("meta"):
        m = Transformer(cfg)
        for block in m.model.layers:
            block.self_attn.fuse(structure_only=True)
            block.mlp.fuse(structure_only=True)
        if fmt in QUANTIZED:
            _quantize(m, cfg, fmt, kinds, structure_only=True)
    want = set(m.state_dict())
    if want != set(state):
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        raise LongattnError(f"prepared weights do not match the {cfg.family} model: "
                            f"missing {missing[:3]}, unexpected {extra[:3]}")
    m.load_state_dict(state, strict=True, assign=True)
    set_rope_tables(m, cfg)
    left = [n for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
    if left:
        raise LongattnError(f"prepared weights leave {left[:3]} unset")
    if fmt not in QUANTIZED:
        choose_float_kernels(m)
    m.weights = recipe_name(fmt, kinds)
    m.eval()
    return m
