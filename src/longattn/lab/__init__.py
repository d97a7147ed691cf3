"""Experiments and the arithmetic they are checked against (see arithmetic.py)."""

from .arithmetic import (  # noqa: F401
    PUBLISHED_CONFIGS,
    PublishedConfig,
    attention_pairs,
    bounded_cache_tokens,
    hybrid_cache_bytes,
    reach,
    window_mask,
)

__all__ = ["window_mask", "attention_pairs", "reach", "bounded_cache_tokens",
           "hybrid_cache_bytes", "PUBLISHED_CONFIGS", "PublishedConfig"]
