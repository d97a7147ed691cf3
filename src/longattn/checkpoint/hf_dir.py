"""Read an HF model directory (config.json + *.safetensors) into ModelConfig + state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import LongattnError
from .integrity import check_values

_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
           "gemma3": "gemma3"}


def read_hf_config(d: dict, name: str = "") -> ModelConfig:
    if d.get("model_type") == "gemma3" and "text_config" in d:
        d = {**d["text_config"], "model_type": "gemma3_text"}
    mt = d.get("model_type")
    family = _FAMILY.get(mt)
    if family is None:
        raise LongattnError(f"unsupported architecture '{mt}' in config.json; longattn runs: "
                            "llama, qwen2, qwen3, gemma3")
    n_layers = int(d["num_hidden_layers"])
    n_heads = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
    theta = float(d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    eos = d.get("eos_token_id")
    kw = dict(
        family=family, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=n_layers, num_heads=n_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or n_heads), head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_context=int(d.get("max_position_embeddings", 8192)), rope_theta=theta,
        tie_embeddings=bool(d.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=bool(d.get("attention_bias", family == "qwen2")),
        qk_norm=family in ("qwen3", "gemma3"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        name=name,
    )
    layer_types = d.get("layer_types")
    window = d.get("sliding_window")
    rp = d.get("rope_parameters") or {}
    if family == "gemma3":
        if not layer_types:
            pattern = int(d.get("sliding_window_pattern", 6))
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(n_layers)]
        # transformers 5 nests rope bases per layer type under rope_parameters.
        g_theta = float((rp.get("full_attention") or {}).get("rope_theta") or d.get("rope_theta") or 1e6)
        l_theta = float((rp.get("sliding_attention") or {}).get("rope_theta")
                        or d.get("rope_local_base_freq") or 1e4)
        kw.update(norm_plus_one=True, sandwich_norms=True, embed_scale=float(d["hidden_size"]) ** 0.5,
                  activation="gelu_tanh", query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", head_dim)),
                  attn_softcap=d.get("attn_logit_softcapping"),
                  final_softcap=d.get("final_logit_softcapping"),
                  rope_theta=g_theta,
                  layer_rope_theta=[g_theta if t == "full_attention" else l_theta for t in layer_types])
        scaling = (rp.get("full_attention") or {})
        if scaling.get("rope_type") not in (None, "default"):
            kw["rope_scaling"] = {"type": scaling["rope_type"], "factor": float(scaling.get("factor", 1.0))}
    if layer_types and window:
        kw["layer_windows"] = [int(window) if t == "sliding_attention" else None for t in layer_types]
    elif window and d.get("use_sliding_window", family not in ("qwen2", "qwen3")) and family != "gemma3":
        kw["layer_windows"] = [int(window)] * n_layers
    return ModelConfig(**kw)


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict]:
    from safetensors.torch import load_file
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise LongattnError(f"{path} has no config.json; pass a GGUF file or an HF model directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LongattnError(f"{path} has no *.safetensors weights")
    cfg = _config_of(cfg_path, path.name)
    sd = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:
            raise LongattnError(f"cannot read {f}: {e}; the file is truncated or corrupt") from None
        for k, v in part.items():
            if k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model."):]
            sd[k] = v.to(torch.float32)
            check_values(k, sd[k], f)
    return cfg, sd


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
