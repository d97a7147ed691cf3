"""Attention arithmetic: masks, reference attention, masked SDPA, banded prefill."""

from .masks import window_lo, allowed_mask  # noqa: F401
from .reference import reference_attention  # noqa: F401
from .dense import masked_attention  # noqa: F401

try:  # banded prefill lives in its own module (O(T*W) work)
    from .banded import banded_attention  # noqa: F401
except ImportError:  # pragma: no cover - banded.py ships with the package
    pass
