"""Read an HF model directory (config.json + *.safetensors) into ModelConfig + state dict.

Every config.json field that changes a family's outputs in transformers is either read
here or refused with one line (docs/families.md lists them per family); fields that do not
change outputs at inference (dropouts, initializer ranges, cache flags) are not read. Each
field is read through hf_fields: the family's transformers config class's fields, with its
defaults. Whether the head is tied to the embedding is decided with the stored tensors, as
transformers decides it (``hf_dir_config``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..config import FAMILIES, ModelConfig
from ..errors import LongattnError
from .hf_fields import GPT_OSS_ROPE, Fields
from .integrity import check_values
from .lazy_weights import LazyWeights

# config.json model_type -> longattn family
_FAMILY = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
           "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "gpt_oss": "gpt_oss"}
# hidden_act / hidden_activation -> ModelConfig.activation
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_GEMMA = ("gemma2", "gemma3")
# Families whose transformers config derives the window pattern from use_sliding_window /
# max_window_layers (layer i windowed when i >= max_window_layers).
_QWEN = ("qwen2", "qwen3")
# Families whose transformers model applies sliding_window on every layer.
_WINDOW_EVERY_LAYER = ("mistral", "phi3")
# rope types whose parameters include original_max_position_embeddings
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope")
_LAYER_KINDS = ("full_attention", "sliding_attention")
OMP = "original_max_position_embeddings"


def _standard_rope(params: dict, f: Fields, top_level_original: bool) -> tuple[float, dict | None]:
    """(rope base, scaling dict or None) of one rope_parameters dict after transformers'
    ``standardize_rope_params``: ``rope_type`` from the older ``type``, the top-level
    ``partial_rotary_factor``, and ``original_max_position_embeddings`` for the types that use
    it (the top-level field where ``top_level_original``, else ``max_position_embeddings``)."""
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.pop("type", None)
    if f("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", f("partial_rotary_factor"))
    if params["rope_type"] in _ORIGINAL_CONTEXT_TYPES:
        if top_level_original:
            params[OMP] = f(OMP) if f.has_field(OMP) else f.d[OMP]
        params.setdefault(OMP, f("max_position_embeddings"))
    theta = params.pop("rope_theta")
    return float(theta), params


def _rope(f: Fields) -> tuple[float, dict | None]:
    """One rope for every layer, read as transformers' ``convert_rope_params_to_dict`` does: the
    older ``rope_scaling`` takes precedence over ``rope_parameters``; ``rope_theta`` inside it,
    else the top-level ``rope_theta``, else the class's default base."""
    if isinstance(f("rope_parameters"), dict) and set(f("rope_parameters")) & set(_LAYER_KINDS):
        raise LongattnError(f"config rope_parameters is nested per layer type, which transformers' {f.family} "
                            "model does not read (Gemma 3 does); give one rope_parameters for every layer")
    rp = f("rope_parameters")
    if f.family == "gpt_oss" and rp is None:
        rp = GPT_OSS_ROPE  # GptOssConfig's own default
    params = dict(f("rope_scaling") or rp or {})
    params.setdefault("rope_theta", f("rope_theta"))
    if f.family == "phi3":
        # Phi3Config reads the older "su" and "yarn" as longrope and refuses any other type
        t = params.get("rope_type", params.get("type", "default"))
        if t in ("su", "yarn"):
            params["rope_type"] = "longrope"
        elif t not in ("default", "longrope"):
            raise LongattnError(f"phi3 rope_type '{t}' is refused by transformers' Phi3Config (default or "
                                "longrope); longattn refuses it too")
    # Phi-3's top-level original_max_position_embeddings (a Phi3Config field, 4096 when absent)
    # replaces rope_parameters' own; other families give a top-level one priority when set.
    return _standard_rope(params, f, top_level_original=f.family == "phi3" or OMP in f.d)


def _gemma3_rope(f: Fields, lt: list) -> dict:
    """Gemma 3's rope per layer type, as ``Gemma3TextConfig.convert_rope_params_to_dict`` reads
    it: ``rope_parameters.full_attention`` / ``.sliding_attention``; the older ``rope_scaling``
    applies to the global (full-attention) layers only; a missing base is ``rope_theta`` (global,
    default 1e6) or ``rope_local_base_freq`` (local, default 1e4). Returns ModelConfig keywords."""
    rp = f("rope_parameters")
    if rp is None:
        rp = {t: {"rope_type": "default"} for t in _LAYER_KINDS}
    if not isinstance(rp, dict) or set(rp) - set(_LAYER_KINDS):
        raise LongattnError("gemma3 rope_parameters must be nested per layer type (full_attention, "
                            f"sliding_attention); transformers ignores keys outside them: {sorted(rp)}")
    by_type = {t: dict(rp.get(t) or {"rope_type": "default"}) for t in _LAYER_KINDS}
    if f("rope_scaling") is not None:
        by_type["full_attention"].update(f("rope_scaling"))
    by_type["full_attention"].setdefault("rope_theta", f("rope_theta"))
    by_type["sliding_attention"].setdefault("rope_theta", f("rope_local_base_freq"))
    rope = {t: _standard_rope(p, f, top_level_original=False) for t, p in by_type.items()}
    return dict(rope_theta=rope["full_attention"][0], rope_scaling=rope["full_attention"][1] or None,
                layer_rope_theta=[rope[t][0] for t in lt], layer_rope_scaling=[rope[t][1] or None for t in lt])


def _layer_types(f: Fields, n_layers: int) -> list | None:
    """Each layer's "sliding_attention" / "full_attention" as transformers derives it."""
    family = f.family
    lt = f.d.get("layer_types")
    if lt is not None and not f.has_field("layer_types"):
        raise LongattnError(f"config has layer_types, which transformers' {family} model does not read; "
                            "longattn refuses to guess which layers are windowed")
    if lt is None:
        if family in ("gemma2", "gpt_oss"):
            lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
        elif family == "gemma3":
            pattern = int(f("sliding_window_pattern"))
            lt = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
        elif family in _QWEN:
            first = int(f("max_window_layers"))
            lt = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        else:
            return None
    lt = list(lt)
    if len(lt) != n_layers:
        raise LongattnError(f"config layer_types has {len(lt)} entries for {n_layers} layers")
    unknown = sorted(set(lt) - set(_LAYER_KINDS))
    if unknown:
        raise LongattnError(f"config layer_types has unknown kind(s) {unknown}; longattn knows "
                            "sliding_attention and full_attention")
    return lt


def _check_heads(hidden: int, n_heads: int, n_kv: int, head_dim) -> None:
    """Refuse head counts that do not divide, naming the config.json fields (a zero count is
    left to the division it breaks, which names it). Without head_dim the head size is
    hidden_size / num_attention_heads, so that division must be exact."""
    if n_heads <= 0 or n_kv <= 0:
        return
    if n_heads % n_kv:
        raise LongattnError(f"config.json: num_attention_heads ({n_heads}) is not divisible by "
                            f"num_key_value_heads ({n_kv}); grouped-query attention needs whole groups")
    if not head_dim and hidden % n_heads:
        raise LongattnError(f"config.json: hidden_size ({hidden}) is not divisible by num_attention_heads "
                            f"({n_heads}), and it sets no head_dim to give the head size")


def read_hf_config(d: dict, name: str = "") -> ModelConfig:
    """A config.json dict -> ModelConfig (raises LongattnError with one line for what it refuses).

    Each field is read as the family's transformers config class reads it (hf_fields: a field
    config.json lacks takes the class default; a field the class does not have is not read).
    """
    if d.get("model_type") == "gemma3" and "text_config" in d:
        d = {**d["text_config"], "model_type": "gemma3_text"}
    mt = d.get("model_type")
    family = _FAMILY.get(mt)
    if family is None:
        raise LongattnError(f"unsupported architecture '{mt}' in config.json; longattn runs: "
                            f"{', '.join(FAMILIES)}")
    f = Fields(d, family)
    if family in _GEMMA and f("use_bidirectional_attention"):
        raise LongattnError("use_bidirectional_attention is set; longattn runs causal decoders only")
    n_layers = int(f("num_hidden_layers"))
    n_heads = int(f("num_attention_heads"))
    n_kv = f("num_key_value_heads")
    n_kv = n_heads if n_kv is None else int(n_kv)
    hidden = int(f("hidden_size"))
    # Qwen2 and Phi-3 have no head_dim field; their models read one config.json sets all the same
    head_dim = f("head_dim") if f.has_field("head_dim") else d.get("head_dim")
    _check_heads(hidden, n_heads, n_kv, head_dim)
    head_dim = int(head_dim or hidden // n_heads)
    if family == "gpt_oss":
        act_name = "silu"  # its experts' activation is swiglu_alpha / swiglu_limit; hidden_act is unused
    else:
        act_name = f("hidden_activation" if family in _GEMMA else "hidden_act")
    if act_name not in _ACTIVATIONS:
        raise LongattnError(f"activation '{act_name}' is not implemented; longattn runs "
                            f"{', '.join(_ACTIVATIONS)}")
    eos = f("eos_token_id")
    attn_bias = bool(f("attention_bias")) if f.has_field("attention_bias") else False
    kw = dict(
        family=family, vocab_size=int(f("vocab_size")), hidden_size=hidden,
        intermediate_size=int(f("intermediate_size")), num_layers=n_layers, num_heads=n_heads,
        num_kv_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=float(f("rms_norm_eps")),
        max_context=int(f("max_position_embeddings")),
        tie_embeddings=bool(f("tie_word_embeddings")),
        # Qwen2 always has q/k/v biases and no output bias; elsewhere attention_bias is all four.
        qkv_bias=family == "qwen2" or attn_bias, o_bias=attn_bias,
        mlp_bias=bool(f("mlp_bias")) if f.has_field("mlp_bias") else False,
        qk_norm=family in ("qwen3", "gemma3"),
        # Phi3ForCausalLM's generation recomputes its cache where a longrope passes the original context
        longrope_recompute=family == "phi3",
        activation=_ACTIVATIONS[act_name],
        bos_token_id=f("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        name=name,
    )
    if family in _GEMMA:
        kw.update(norm_plus_one=True, sandwich_norms=True, embed_scale=float(hidden) ** 0.5,
                  query_pre_attn_scalar=float(f("query_pre_attn_scalar")),
                  # transformers' Gemma 3 attention never applies attn_logit_softcapping
                  attn_softcap=f("attn_logit_softcapping") if family == "gemma2" else None,
                  final_softcap=f("final_logit_softcapping"))
    if family == "gpt_oss":
        kw.update(learned_sinks=True, num_experts=int(f("num_local_experts")),
                  experts_per_token=int(f("num_experts_per_tok")),
                  swiglu_alpha=float(f("swiglu_alpha")), swiglu_limit=float(f("swiglu_limit")))
    lt = _layer_types(f, n_layers)
    window = f("sliding_window") if f.has_field("sliding_window") else None
    if family in _QWEN and not f("use_sliding_window"):
        window = None  # transformers drops sliding_window unless use_sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise LongattnError(f"config sliding_window must be a positive integer, got {window!r}")
    if window and lt is not None:
        kw["layer_windows"] = [window if t == "sliding_attention" else None for t in lt]
    elif window and family in _WINDOW_EVERY_LAYER:
        kw["layer_windows"] = [window] * n_layers
    if family == "gemma3":
        kw.update(_gemma3_rope(f, lt))
    else:
        kw["rope_theta"], kw["rope_scaling"] = _rope(f)
    return ModelConfig(**kw)


# The files of an HF directory that loading it may read (config, weights, tokenizer, template).
_READ_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")


def _check_regular_files(path: Path) -> None:
    """Refuse an HF directory where a file loading may read is a FIFO, device or socket (a
    read would wait for a writer for ever, or never end), naming the file."""
    for pattern in _READ_PATTERNS:
        for f in path.glob(pattern):
            if f.exists() and not (f.is_file() or f.is_dir()):
                raise LongattnError(f"{f} is not a regular file (a pipe, device or socket); an HF model "
                                    "directory holds regular files only")


def hf_dir_config(path: Path) -> ModelConfig:
    """The ModelConfig of an HF directory's config.json (one line for any way it is wrong)."""
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise LongattnError(f"{path} has no config.json; pass a GGUF file or an HF model directory")
    _check_regular_files(path)
    cfg = _config_of(cfg_path, path.name)
    files = hf_dir_weight_files(path)
    if cfg.tie_embeddings and _stored_head_differs(files):
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    return cfg


EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_COMPARE_ROWS = 4096  # rows of the embedding compared at a time (bounds the memory it takes)


def _longattn_name(key: str) -> str:
    """A safetensors key as longattn names it (Gemma 3's multimodal prefix dropped)."""
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


def _stored_head_differs(files: list) -> bool:
    """True when the files store an output head (``lm_head.weight``) that is not the embedding.

    transformers ties the head to the embedding under ``tie_word_embeddings`` only when the
    checkpoint does not store both with different values; a head stored beside the embedding
    and unequal to it is used untied. Compared row block by row block, in float32.
    """
    from safetensors import safe_open
    where = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                where.update({_longattn_name(k): (f, k) for k in h.keys() if _longattn_name(k) in (EMBED, HEAD)})
        except Exception as e:
            raise LongattnError(f"cannot read {f}: {e}; the file is truncated or corrupt") from None
    if EMBED not in where or HEAD not in where:
        return False
    with safe_open(str(where[EMBED][0]), framework="pt") as fe, safe_open(str(where[HEAD][0]), framework="pt") as fh:
        e, h = fe.get_slice(where[EMBED][1]), fh.get_slice(where[HEAD][1])
        if list(e.get_shape()) != list(h.get_shape()):
            return True
        rows = e.get_shape()[0]
        for a in range(0, rows, _COMPARE_ROWS):
            b = min(rows, a + _COMPARE_ROWS)
            if not torch.equal(e[a:b].to(torch.float32), h[a:b].to(torch.float32)):
                return True
    return False


def hf_dir_weight_files(path: Path) -> list:
    """The directory's ``*.safetensors`` files, sorted (an error when there are none)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LongattnError(f"{path} has no *.safetensors weights")
    return files


class HFWeights(LazyWeights):
    """An HF directory's weights as a read-only mapping longattn name -> float32 tensor, each
    read from its safetensors file, widened to float32 and checked (integrity.check_values)
    when it is looked up, and not kept (lazy_weights). ``shape(name)`` reads the headers only.
    """

    def __init__(self, path: Path, cfg: ModelConfig):
        from safetensors import safe_open
        super().__init__(cfg)
        self._files: dict = {}  # file -> its open safetensors handle
        for f in hf_dir_weight_files(path):
            try:
                handle = safe_open(str(f), framework="pt")
                keys = list(handle.keys())
            except Exception as e:
                raise LongattnError(f"cannot read {f}: {e}; the file is truncated or corrupt") from None
            self._files[f] = handle
            for key in keys:
                k = _longattn_name(key)
                self._add(k, (f, key, k), tuple(handle.get_slice(key).get_shape()))
        if cfg.tie_embeddings and EMBED not in self._parts and HEAD in self._parts:
            # tied, with only the head stored: transformers ties the embedding to it
            self._parts[EMBED] = self._parts.pop(HEAD)

    def _read(self, stored) -> torch.Tensor:
        f, key, name = stored
        try:
            t = self._files[f].get_tensor(key).to(torch.float32)
        except Exception as e:
            raise LongattnError(f"cannot read {f}: {e}; the file is truncated or corrupt") from None
        check_values(name, t, f)
        return t


def _config_of(cfg_path: Path, name: str) -> ModelConfig:
    """read_hf_config of the file ``cfg_path``, with every way the file can be wrong (not
    JSON, not an object, a key missing, a value of the wrong type or zero) as one line."""
    try:
        d = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise LongattnError(f"{cfg_path} is not valid JSON ({e}); repair or re-download it") from None
    if not isinstance(d, dict):
        raise LongattnError(f"{cfg_path} holds a JSON {type(d).__name__}, not an object of settings")
    try:
        return read_hf_config(d, name=name)
    except LongattnError:
        raise
    except KeyError as e:
        raise LongattnError(f"{cfg_path} lacks the setting {e}; repair or re-download it") from None
    except ZeroDivisionError:
        raise LongattnError(f"{cfg_path} sets a size the others are divided by (such as "
                            "num_attention_heads) to zero; repair or re-download it") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise LongattnError(f"{cfg_path} holds an invalid value ({type(e).__name__}: {e}); "
                            "repair or re-download it") from None
