"""Each family's config.json is read as its transformers config class reads it.

The table of fields and defaults (checkpoint/hf_fields.py) equals transformers' classes: the
same fields (a release that adds one fails here) with the same defaults. Then every key of a
tiny checkpoint's config.json is deleted, and set to null, one at a time: what longattn reads
(head sizes, norms, windows, rope per layer, soft-caps, biases, stop ids...) equals what the
transformers class derives from the same dict, or longattn refuses in one line.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from conftest import tiny_dir
from longattn.checkpoint.hf_fields import CONFIG_CLASS, FIELDS, GPT_OSS_ROPE, OLDER_KEYS, REQUIRED
from longattn.errors import LongattnError

FAMILIES = list(CONFIG_CLASS)


def _cls(family):
    import transformers
    return getattr(transformers, CONFIG_CLASS[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_field_table_is_transformers_class(family):
    from transformers import PreTrainedConfig
    cls = _cls(family)
    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}
    assert set(FIELDS[family]) == set(theirs), "fields added or removed: extend hf_fields and the audit"
    assert FIELDS[family] == theirs
    theta = cls.default_theta
    if family == "gemma3":
        assert (OLDER_KEYS[family]["rope_theta"], OLDER_KEYS[family]["rope_local_base_freq"]) == \
            (theta["global"], theta["local"])
    else:
        assert OLDER_KEYS[family]["rope_theta"] == theta


def test_derived_defaults_are_transformers():
    """Defaults set in the classes' __post_init__ rather than as field defaults."""
    from transformers import Gemma3TextConfig, GptOssConfig, Phi3Config
    rope = dict(GptOssConfig().rope_parameters)
    assert rope.pop("rope_theta") == OLDER_KEYS["gpt_oss"]["rope_theta"] and rope == GPT_OSS_ROPE
    assert Phi3Config().rope_parameters["partial_rotary_factor"] == OLDER_KEYS["phi3"]["partial_rotary_factor"]
    n = OLDER_KEYS["gemma3"]["sliding_window_pattern"]
    assert Gemma3TextConfig(num_hidden_layers=2 * n).layer_types == \
        ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(2 * n)]


def _windows(family, c, L):
    sw = getattr(c, "sliding_window", None)
    if family == "llama" or sw is None:
        return [None] * L
    if family in ("mistral", "phi3"):
        return [sw] * L
    return [sw if t == "sliding_attention" else None for t in c.layer_types]


def _rope_of(params):
    t = params.get("rope_type", "default")
    if t == "default":
        return None
    keep = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta", "partial_rotary_factor", "type")}
    return {"rope_type": t, **keep}


def _theirs(family, c) -> dict:
    """What transformers' config ``c`` makes of each value longattn reads."""
    c.standardize_rope_params()  # as each rope init function does when the model is built
    L = c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if family == "gemma3":
        per = [c.rope_parameters[t] for t in c.layer_types]
    else:
        per = [c.rope_parameters] * L
    eos = c.eos_token_id
    act = {"gelu_pytorch_tanh": "gelu_tanh", "swish": "silu"}.get
    out = dict(
        num_kv_heads=c.num_key_value_heads, head_dim=hd, rms_norm_eps=c.rms_norm_eps,
        max_context=c.max_position_embeddings, tie_embeddings=c.tie_word_embeddings,
        layer_windows=_windows(family, c, L), layer_rope_theta=[p["rope_theta"] for p in per],
        layer_rope_scaling=[_rope_of(p) for p in per], bos_token_id=c.bos_token_id,
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        mlp_bias=getattr(c, "mlp_bias", False) if family == "llama" else False,
        # Mistral's and Phi-3's attention have no biases whatever attention_bias says; Qwen2's no output one
        o_bias=bool(c.attention_bias) if family not in ("mistral", "phi3", "qwen2") else False,
    )
    if family != "gpt_oss":
        name = c.hidden_activation if family in ("gemma2", "gemma3") else c.hidden_act
        out["activation"] = act(name, name)
    gemma = family in ("gemma2", "gemma3")
    out.update(attn_scale=float(c.query_pre_attn_scalar if gemma else hd) ** -0.5,
               final_softcap=c.final_logit_softcapping if gemma else None,
               attn_softcap=c.attn_logit_softcapping if family == "gemma2" else None)
    if family == "gpt_oss":
        out.update(num_experts=c.num_local_experts, experts_per_token=c.num_experts_per_tok,
                   swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)
    return out


def _ours(cfg, keys) -> dict:
    return {k: getattr(cfg, k) for k in keys}


# Keys whose value the tiny checkpoint needs as saved (its sizes; the kind of model).
_KEEP = set(REQUIRED) | {"model_type", "architectures", "dtype", "transformers_version"}
# Values for other families' fields, set where the family's class lacks the field (its model
# reads it or not, as transformers' does: Llama reads no hidden_activation).
FOREIGN = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "relu", "attention_bias": True, "mlp_bias": True,
           "sliding_window": 4, "query_pre_attn_scalar": 7, "attn_logit_softcapping": 5.0,
           "final_logit_softcapping": 5.0, "use_bidirectional_attention": True, "head_dim": 32,
           "use_sliding_window": True, "max_window_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
           "swiglu_alpha": 1.0, "swiglu_limit": 1.0, "original_max_position_embeddings": 8}


def _variants(d: dict, family: str):
    """(what, config.json) with each key deleted, each key set to null, and each field of
    another family's class set."""
    for k in sorted(set(d) - _KEEP):
        yield f"without {k}", {x: v for x, v in d.items() if x != k}
        yield f"{k}: null", {**d, k: None}
    for k in sorted(set(FOREIGN) - set(FIELDS[family])):
        yield f"{k}: {FOREIGN[k]!r} (not a {family} field)", {**d, k: FOREIGN[k]}
    # the older rope keys, alone (what pre-5 checkpoints hold)
    older = {x: v for x, v in d.items() if x != "rope_parameters"}
    if family != "gemma3":  # a longrope with its own original context and none at the top level
        rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
                "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
        yield "longrope without a top-level original context", \
            {**{x: v for x, v in d.items() if x != "original_max_position_embeddings"}, "rope_parameters": rope}
    yield "without rope_parameters, rope_theta 5e5", {**older, "rope_theta": 5e5}
    if "gemma3" in d.get("model_type", ""):
        yield "rope_local_base_freq 3e3", {**older, "rope_local_base_freq": 3e3}
        yield "sliding_window_pattern 2", {**{x: v for x, v in older.items() if x != "layer_types"},
                                           "sliding_window_pattern": 2}


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_and_null_fields_read_as_transformers(family):
    from longattn.checkpoint.hf_dir import read_hf_config
    saved = json.loads((Path(tiny_dir(family)) / "config.json").read_text())
    cls, wrong = _cls(family), []
    for what, d in _variants(saved, family):
        try:
            theirs = _theirs(family, cls.from_dict(dict(d)))
        except Exception:
            continue  # transformers refuses the dict: nothing to match
        try:
            ours = _ours(read_hf_config(dict(d)), theirs)
        except LongattnError:
            continue  # refused in one line
        diff = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
        if diff:
            wrong.append(f"{what}: {diff}")
    assert not wrong, "\n".join(wrong)
