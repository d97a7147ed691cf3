"""What a transformers model is, in longattn's terms: its ModelConfig and the policies built on it.

The adapter serves the families longattn runs natively; a transformers config of any other
kind, or a transformers version outside the tested range, is refused with one line.
"""

from __future__ import annotations

from typing import Optional

from ..config import ModelConfig
from ..errors import LongattnError, check_int
from ..policy import AttentionPolicy

# model_type -> served. gemma3 (the multimodal wrapper) is refused: its text model is served.
SERVED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gpt_oss")

# The Cache / CacheLayerMixin / AttentionInterface API the adapter follows (tested on 5.23.0).
TRANSFORMERS_RANGE = ((5, 23), (6, 0))  # [lower, upper)


def check_transformers_version(version: Optional[str] = None) -> None:
    """Refuse a transformers release outside ``TRANSFORMERS_RANGE`` (its cache API differs)."""
    if version is None:
        import transformers
        version = transformers.__version__
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        raise LongattnError(f"cannot read the transformers version '{version}'") from None
    lo, hi = TRANSFORMERS_RANGE
    if not lo <= major_minor < hi:
        raise LongattnError(f"longattn.hf needs transformers >= {lo[0]}.{lo[1]} and < {hi[0]}.{hi[1]} "
                            f"(its Cache API); this is {version}")


def model_config(config) -> ModelConfig:
    """longattn's ModelConfig for a transformers config (``model.config``), or LongattnError.

    The layer pattern and windows come from the config's own ``layer_types`` and
    ``sliding_window`` (longattn.checkpoint.hf_dir.read_hf_config).
    """
    from ..checkpoint.hf_dir import read_hf_config
    mt = getattr(config, "model_type", None)
    if mt not in SERVED_MODEL_TYPES:
        hint = " (pass the text model: model.language_model)" if mt == "gemma3" else ""
        raise LongattnError(f"longattn.hf serves {', '.join(SERVED_MODEL_TYPES)} models; this one is "
                            f"'{mt}'{hint}")
    return read_hf_config(config.to_dict(), name=getattr(config, "name_or_path", "") or "")


def sink_policy(cfg: ModelConfig, window: Optional[int] = None, sinks: int = 4,
                layers: str = "auto") -> AttentionPolicy:
    """The window + sinks policy of ``SinkCache``.

    layers:
        "auto": a model trained with windows (Gemma 3) keeps its global layers global and
            puts ``window`` (default: the trained one) and the sinks on its windowed layers;
            a model with no trained window (Llama, Qwen) gets ``window`` on every layer.
        "all": ``window`` and the sinks on every layer, global ones included.
    """
    if layers not in ("auto", "all"):
        raise LongattnError(f"layers must be 'auto' or 'all', got {layers!r}")
    check_int("window", window, minimum=1, allow_none=True)
    check_int("sinks", sinks)
    trained = list(cfg.layer_windows)
    hybrid = any(w is not None for w in trained)
    if layers == "all" or not hybrid:
        if window is None:
            raise LongattnError("this cache needs window=W (a positive integer): "
                                + ("layers='all' imposes it on every layer" if hybrid else
                                   "the model has no trained window"))
        return AttentionPolicy.build(cfg, "window", window=window, sinks=sinks)
    windows = [(window or t) if t is not None else None for t in trained]
    return AttentionPolicy.build(cfg, "layers", windows=windows, sinks=sinks)
