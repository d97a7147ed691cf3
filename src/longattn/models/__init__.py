"""The decoder transformer; family differences come from ModelConfig."""

from .transformer import Transformer, build_model  # noqa: F401
