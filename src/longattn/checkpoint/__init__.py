"""Checkpoints: GGUF files, HF directories and bundled models -> (ModelConfig, weights, tokenizer)."""

from .load import load_checkpoint, LoadedCheckpoint  # noqa: F401
from .bundled import BUNDLED, resolve_model  # noqa: F401
