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

# Experiments: each returns a JSON-able dict; the `longattn` commands of the same names
# print, save and plot them.
from .cachebytes import cache_sweep, measure_cache  # noqa: E402,F401
from .quality import quality_sweep  # noqa: E402,F401
from .receptive import receptive_field  # noqa: E402,F401
from .retrieval import retrieval_sweep  # noqa: E402,F401
from .scaling import decode_step_times, prefill_attention_times, scaling_run  # noqa: E402,F401
from .sinkmass import sink_mass  # noqa: E402,F401
from .tasks import TASKS, make_sample  # noqa: E402,F401

__all__ += ["cache_sweep", "measure_cache", "quality_sweep", "receptive_field", "retrieval_sweep",
            "decode_step_times", "prefill_attention_times", "scaling_run", "sink_mass", "TASKS",
            "make_sample"]
