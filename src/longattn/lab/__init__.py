"""Experiments and the arithmetic they are checked against (see arithmetic.py).

Each experiment returns a JSON-able dict; the `longattn` commands of the same names print, save
and plot them. Names are loaded on first use, so a command that only needs ``lab.plots`` or
``lab.tasks`` (for its options) does not import torch.
"""

from __future__ import annotations

import importlib

# public name -> submodule that defines it
_EXPORTS = {
    "window_mask": "arithmetic", "attention_pairs": "arithmetic", "reach": "arithmetic",
    "bounded_cache_tokens": "arithmetic", "hybrid_cache_bytes": "arithmetic",
    "PUBLISHED_CONFIGS": "arithmetic", "PublishedConfig": "arithmetic",
    "cache_sweep": "cachebytes", "measure_cache": "cachebytes", "quality_sweep": "quality",
    "receptive_field": "receptive", "retrieval_sweep": "retrieval", "decode_step_times": "scaling",
    "prefill_attention_times": "scaling", "scaling_run": "scaling", "sink_mass": "sinkmass",
    "TASKS": "tasks", "make_sample": "tasks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'longattn.lab' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
