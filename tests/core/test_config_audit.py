"""The config audit (docs/families.md): every transformers config field that can change a
family's outputs, fed a non-default value, is honoured (logits within 1e-4 of transformers on
the same checkpoint) or refused with one line. Where the value keeps the weights' shapes,
transformers' own logits are also compared with the default value's (same random weights):
``changes`` says whether the field must change the function (so ignoring it would fail)."""

import pytest
import torch

from conftest import tiny_dir
from longattn.errors import LongattnError

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}

# (family, field values, expectation): expectation is True/False (honoured; must / must not
# change transformers' function), None (honoured; shapes change) or a refusal's text.
CASES = [
    ("llama", {"rms_norm_eps": 0.5}, True),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, True),
    ("llama", {"hidden_act": "relu"}, "activation 'relu' is not implemented"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}, True),
    ("llama", {"attention_bias": True}, None),
    ("llama", {"mlp_bias": True}, None),
    ("llama", {"tie_word_embeddings": True}, None),
    ("llama", {"head_dim": 24}, None),
    ("llama", {"num_key_value_heads": 1}, None),
    ("llama", {"pretraining_tp": 2}, False),
    ("llama", {"attention_dropout": 0.5}, False),
    ("mistral", {"sliding_window": 4}, True),
    ("mistral", {"head_dim": 24}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, True),
    ("qwen2", {"rms_norm_eps": 0.5}, True),
    ("qwen3", {"attention_bias": True}, None),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, True),
    ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not implemented"),
    ("phi3", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 16,
              "max_position_embeddings": 64}, True),
    ("phi3", {"resid_pdrop": 0.3, "embd_pdrop": 0.3}, False),
    ("gemma2", {"attn_logit_softcapping": None}, True),
    ("gemma2", {"final_logit_softcapping": None}, True),
    ("gemma2", {"query_pre_attn_scalar": 64}, True),
    ("gemma2", {"hidden_activation": "gelu"}, "activation 'gelu' is not implemented"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"attention_bias": True}, None),
    ("gemma3", {"attn_logit_softcapping": 5.0}, False),  # transformers' Gemma 3 never applies it
    ("gemma3", {"final_logit_softcapping": 3.0}, True),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
]


def _hf_logits(d, ids):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("family, over, expect", CASES,
                         ids=[f"{f}-{'-'.join(o)}" for f, o, _ in CASES])
def test_config_field_honoured_or_refused(family, over, expect):
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = tiny_dir(family, **over)
    if isinstance(expect, str):
        with pytest.raises(LongattnError, match=expect):
            load_checkpoint(d, with_tokenizer=False)
        return
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(7))
    ck = load_checkpoint(d, with_tokenizer=False)
    ours = build_model(ck.config, ck.state_dict)(ids)
    hf = _hf_logits(d, ids)
    err = (ours - hf).abs().max().item()
    assert err < 1e-4, f"{family} {over}: max |delta logit| {err:.2e}"
    if expect is not None:  # same weights under the default value: does the field matter?
        moved = (hf - _hf_logits(tiny_dir(family), ids)).abs().max().item()
        assert (moved > 1e-3) == expect, f"{family} {over}: changes the function by {moved:.2e}"


# ---------------------------------------------------------------- every field of every family

def _layers(family):
    return 6 if family == "gemma3" else 3


def _other_layer_types(family):
    """A layer pattern other than the family's default."""
    n = _layers(family)
    return ["full_attention"] + ["sliding_attention"] * (n - 1)


# One value other than the tiny checkpoint's for each field of the families' config classes
# (a callable takes the family). A field transformers adds has none, and fails
# test_every_class_field_has_a_perturbation.
PERTURB = {
    "vocab_size": 80, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 24,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "silu", "max_position_embeddings": 32,
    "rms_norm_eps": 0.5,
    "tie_word_embeddings": lambda f: f not in ("qwen2", "qwen3", "gemma2", "gemma3"),
    "rope_parameters": lambda f: (
        {"full_attention": {"rope_type": "default", "rope_theta": 50.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 30.0}} if f == "gemma3"
        else {"rope_type": "default", "rope_theta": 50.0}),
    "attention_bias": lambda f: f != "gpt_oss", "mlp_bias": True, "sliding_window": 4,
    "use_sliding_window": True, "max_window_layers": 1, "layer_types": _other_layer_types,
    "query_pre_attn_scalar": 64, "final_logit_softcapping": 2.0, "attn_logit_softcapping": 2.0,
    "use_bidirectional_attention": True, "original_max_position_embeddings": 8,
    "num_local_experts": 3, "num_experts_per_tok": 1, "swiglu_alpha": 1.0, "swiglu_limit": 2.0,
    # no effect at inference in transformers either (randomized weights overwrite the init)
    "pretraining_tp": 2, "resid_pdrop": 0.3, "embd_pdrop": 0.3, "attention_dropout": 0.5,
    "initializer_range": 0.5, "use_cache": False, "pad_token_id": 5, "bos_token_id": 5, "eos_token_id": 5,
    "router_aux_loss_coef": 0.5, "output_router_logits": True,
}


def _class_fields(family):
    import dataclasses
    import transformers
    from longattn.checkpoint.hf_fields import CONFIG_CLASS
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    return [f.name for f in dataclasses.fields(getattr(transformers, CONFIG_CLASS[family])) if f.name not in base]


def _grid():
    from longattn.checkpoint.hf_fields import CONFIG_CLASS, FIELDS
    return [(fam, field) for fam in CONFIG_CLASS for field in FIELDS[fam]]


def test_every_class_field_has_a_perturbation():
    from longattn.checkpoint.hf_fields import CONFIG_CLASS
    missing = {fam: sorted(set(_class_fields(fam)) - set(PERTURB)) for fam in CONFIG_CLASS}
    assert not any(missing.values()), f"fields without an audit case: {missing}"


@pytest.mark.parametrize("family, field", _grid(), ids=[f"{f}-{x}" for f, x in _grid()])
def test_every_field_honoured_or_refused(family, field):
    """The field at a value other than the tiny checkpoint's: longattn's logits equal
    transformers' on that checkpoint (so the value changes both alike, or neither), or
    loading is refused in one line."""
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    value = PERTURB[field](family) if callable(PERTURB[field]) else PERTURB[field]
    try:
        d = tiny_dir(family, **{field: value})
    except Exception:  # transformers refuses the value: nothing to match
        pytest.skip(f"transformers refuses {field}={value!r} for {family}")
    ids = torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(7))
    try:
        ck = load_checkpoint(d, with_tokenizer=False)
        ours = build_model(ck.config, ck.state_dict)(ids)
    except LongattnError as e:
        assert "\n" not in str(e)
        return
    try:
        hf = _hf_logits(d, ids)
    except Exception as e:  # transformers cannot run it either (qwen2 sliding layers without a window)
        pytest.skip(f"transformers fails on {field}={value!r} for {family}: {type(e).__name__}")
    err = (ours - hf).abs().max().item()
    assert err < 1e-4, f"{family} {field}={value!r}: max |delta logit| {err:.2e}"
