"""Read an HF model directory (config.json + *.safetensors) into ModelConfig + state dict.

Every config.json field that changes a family's outputs in transformers is either read
here or refused with one line (docs/families.md lists them per family); fields that do not
change outputs at inference (dropouts, initializer ranges, cache flags) are not read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import FAMILIES, ModelConfig
from ..errors import LongattnError
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


def _rope(d: dict, params: dict | None) -> tuple[float, dict | None]:
    """(rope base, scaling dict or None) from one rope_parameters dict, or from the older
    top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` fields."""
    if params is None:
        params = dict(d.get("rope_scaling") or {})
    else:
        params = dict(params)
    theta = params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    if d.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    t = params.get("rope_type") or params.get("type") or "default"
    if t in ("llama3", "yarn", "longrope"):
        # transformers gives a top-level original_max_position_embeddings (Phi-3) priority
        if d.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return float(theta), (params or None)


def _layer_types(d: dict, family: str, n_layers: int) -> list | None:
    """Each layer's "sliding_attention" / "full_attention" as transformers derives it."""
    lt = d.get("layer_types")
    if lt is not None and family not in _GEMMA + _QWEN + ("gpt_oss",):
        raise LongattnError(f"config has layer_types, which transformers' {family} model does not read; "
                            "longattn refuses to guess which layers are windowed")
    if lt is None:
        if family in ("gemma2", "gpt_oss"):
            lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
        elif family == "gemma3":
            pattern = int(d.get("sliding_window_pattern", 6))
            lt = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
        elif family in _QWEN:
            first = int(d.get("max_window_layers", 28))
            lt = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        else:
            return None
    lt = list(lt)
    if len(lt) != n_layers:
        raise LongattnError(f"config layer_types has {len(lt)} entries for {n_layers} layers")
    unknown = sorted(set(lt) - {"sliding_attention", "full_attention"})
    if unknown:
        raise LongattnError(f"config layer_types has unknown kind(s) {unknown}; longattn knows "
                            "sliding_attention and full_attention")
    return lt


def _refuse(d: dict) -> None:
    """One line for a config field that changes outputs and longattn does not implement."""
    if d.get("use_bidirectional_attention"):
        raise LongattnError("use_bidirectional_attention is set; longattn runs causal decoders only")


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
    """A config.json dict -> ModelConfig (raises LongattnError with one line for what it refuses)."""
    if d.get("model_type") == "gemma3" and "text_config" in d:
        d = {**d["text_config"], "model_type": "gemma3_text"}
    mt = d.get("model_type")
    family = _FAMILY.get(mt)
    if family is None:
        raise LongattnError(f"unsupported architecture '{mt}' in config.json; longattn runs: "
                            f"{', '.join(FAMILIES)}")
    _refuse(d)
    n_layers = int(d["num_hidden_layers"])
    n_heads = int(d["num_attention_heads"])
    n_kv = int(d.get("num_key_value_heads") or n_heads)
    _check_heads(int(d["hidden_size"]), n_heads, n_kv, d.get("head_dim"))
    head_dim = int(d.get("head_dim") or d["hidden_size"] // n_heads)
    act_name = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if family in _GEMMA
                                                                      else "silu")
    if act_name not in _ACTIVATIONS:
        raise LongattnError(f"activation '{act_name}' is not implemented; longattn runs "
                            f"{', '.join(_ACTIVATIONS)}")
    eos = d.get("eos_token_id")
    attn_bias = bool(d.get("attention_bias", family == "gpt_oss"))
    kw = dict(
        family=family, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=n_layers, num_heads=n_heads,
        num_kv_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_context=int(d.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(d.get("tie_word_embeddings", family in _GEMMA)),
        # Qwen2 always has q/k/v biases and no output bias; elsewhere attention_bias is all four.
        qkv_bias=family == "qwen2" or attn_bias, o_bias=family != "qwen2" and attn_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "gemma3"),
        activation=_ACTIVATIONS[act_name],
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        name=name,
    )
    if family in _GEMMA:
        kw.update(norm_plus_one=True, sandwich_norms=True, embed_scale=float(d["hidden_size"]) ** 0.5,
                  query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or head_dim),
                  # transformers' Gemma 3 attention never applies attn_logit_softcapping
                  attn_softcap=d.get("attn_logit_softcapping") if family == "gemma2" else None,
                  final_softcap=d.get("final_logit_softcapping"))
    if family == "gpt_oss":
        kw.update(learned_sinks=True, num_experts=int(d.get("num_local_experts", 128)),
                  experts_per_token=int(d.get("num_experts_per_tok", 4)),
                  swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)))
    lt = _layer_types(d, family, n_layers)
    window = d.get("sliding_window")
    if family in _QWEN and not d.get("use_sliding_window", False):
        window = None  # transformers drops sliding_window unless use_sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise LongattnError(f"config sliding_window must be a positive integer, got {window!r}")
    if window and lt is not None:
        kw["layer_windows"] = [window if t == "sliding_attention" else None for t in lt]
    elif window and family in _WINDOW_EVERY_LAYER:
        kw["layer_windows"] = [window] * n_layers

    rp = d.get("rope_parameters")
    if family == "gpt_oss" and rp is None and not d.get("rope_scaling"):
        raise LongattnError("gpt_oss config.json has neither rope_parameters nor rope_scaling; longattn "
                            "does not guess transformers' default yarn parameters")
    if isinstance(rp, dict) and set(rp) & {"full_attention", "sliding_attention"}:
        # transformers 5 nests rope bases per layer type (Gemma 3: 1e6 global, 1e4 local)
        by_type = {}
        for t in ("full_attention", "sliding_attention"):
            p = rp.get(t)
            if p is None and t == "sliding_attention":  # older Gemma 3 fields
                p = {"rope_theta": d.get("rope_local_base_freq") or 1e4}
            by_type[t] = _rope(d, p or {})
        types = lt or ["full_attention"] * n_layers
        kw["rope_theta"] = by_type["full_attention"][0]
        kw["rope_scaling"] = by_type["full_attention"][1]
        kw["layer_rope_theta"] = [by_type[t][0] for t in types]
        kw["layer_rope_scaling"] = [by_type[t][1] for t in types]
    elif family == "gemma3":
        # pre-5 Gemma 3 config: one rope_theta + rope_scaling for global layers, a local base
        theta, scaling = _rope(d, rp)
        local = float(d.get("rope_local_base_freq") or 1e4)
        kw.update(rope_theta=theta, rope_scaling=scaling,
                  layer_rope_theta=[theta if t == "full_attention" else local for t in lt],
                  layer_rope_scaling=[scaling if t == "full_attention" else None for t in lt])
    else:
        kw["rope_theta"], kw["rope_scaling"] = _rope(d, rp)
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
    hf_dir_weight_files(path)
    return cfg


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
                k = "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key
                self._add(k, (f, key, k), tuple(handle.get_slice(key).get_shape()))

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
