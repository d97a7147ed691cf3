"""Closed-form arithmetic of windowed attention: masks, pair counts, reach, cache sizes.

Definitions (docs/design.md): a query at position i may read key j when ``j <= i`` and
``i - j < W`` (W keys including itself); the first S positions (sinks) stay readable by every
query; ``W`` of ``None`` or ``<= 0`` means full causal attention. Everything here is exact
integer arithmetic (Python ints, no loops over T) so it can be quoted next to measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import LongattnError, check_int

CONVENTIONS = ("longattn", "transformers")


def _windowed(W: Optional[int]) -> bool:
    return W is not None and W > 0


def window_mask(T: int, W: Optional[int], sinks: int = 0) -> torch.Tensor:
    """Who may read whom over T positions.

    Returns:
        ``[T, T]`` bool, entry ``[i, j]`` True when query i may read key j:
        ``j <= i`` and (``i - j < W`` or ``j < sinks``); full causal when W is None/<= 0.
    """
    check_int("T", T)
    check_int("sinks", sinks)
    i = torch.arange(T)[:, None]  # [T, 1] queries
    j = torch.arange(T)[None, :]  # [1, T] keys
    ok = j <= i
    if _windowed(W):
        ok = ok & (((i - j) < W) | (j < sinks))
    return ok


def _sum_min(n: int, cap: int) -> int:
    """sum_{a=1..n} min(cap, a), for n, cap >= 0."""
    if n <= 0:
        return 0
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def attention_pairs(T: int, W: Optional[int], sinks: int = 0) -> int:
    """(query, key) pairs read over T positions; equals ``window_mask(T, W, sinks).sum()``.

    Full causal: T(T+1)/2. Window: sum_i min(W, i+1). Sinks add, for each query i, the sink
    keys that are causal but fell out of its window: min(S, i - W + 1) when positive.
    Example: T=16, W=4 -> 58 pairs (136 causal); T=32768, W=1024 -> 16.3x fewer than causal.
    """
    check_int("T", T)
    check_int("sinks", sinks)
    if not _windowed(W):
        return T * (T + 1) // 2
    band = _sum_min(T, W)               # sum_{i=0}^{T-1} min(W, i+1)
    extra = _sum_min(T - W, sinks)      # queries i >= W see min(S, i-W+1) sinks outside the band
    return band + extra


def reach(L: int, W: Optional[int]) -> float:
    """How far back information can travel through L stacked windowed layers: L*(W-1).

    Each layer moves information at most W-1 positions back. Full attention (W None/<= 0) has
    unbounded reach: ``math.inf``.
    """
    check_int("L", L)
    if not _windowed(W):
        return math.inf
    return L * (W - 1)


def bounded_cache_tokens(T: int, W: Optional[int], sinks: int = 0, slack: int = 0,
                         convention: str = "longattn") -> int:
    """Tokens a windowed layer's cache holds after T tokens (prefill or decode, same result).

    conventions:
      * ``"longattn"``: a ring with ``sinks`` pinned slots and W rotating slots plus ``slack``
        spare slots (e.g. llama.cpp keeps n_swa + n_ubatch cells: slack = n_ubatch) holds
        ``min(T, sinks + W + slack)``. W slots (not W-1) because the token being decoded is
        written into the ring before it attends, and it reads W keys including itself.
      * ``"transformers"``: transformers 5.23 ``DynamicCache`` sliding layers
        (``transformers/cache_utils.py``, class ``DynamicSlidingWindowLayer.update``) keep
        ``full_states[:, :, -self.sliding_window + 1:, :]`` after every update: the last W-1
        tokens, ``min(T, W-1)``, whether the T tokens came as one prefill or step by step.
        During an update it returns (cached + new) states, so the transient peak is
        ``min(T_before, W-1) + new_tokens``. Quirk reproduced here: for W == 1 the slice is
        ``[-0:]``, i.e. everything, so the layer keeps all T tokens. No sinks, no slack.
        (Its ``StaticSlidingWindowLayer`` instead preallocates ``min(max_cache_len, W)`` slots.)
    Full attention layers (W None/<= 0) hold T.
    """
    check_int("T", T)
    check_int("sinks", sinks)
    check_int("slack", slack)
    if convention not in CONVENTIONS:
        raise LongattnError(f"unknown cache convention {convention!r}; use one of {', '.join(CONVENTIONS)}")
    if not _windowed(W):
        return T
    if convention == "transformers":
        if sinks or slack:
            raise LongattnError("the transformers sliding-window cache has no sink or slack slots; "
                                "use convention='longattn' for sinks/slack")
        return T if W == 1 else min(T, W - 1)
    return min(T, sinks + W + slack)


def _itemsize(dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    raise LongattnError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")


def hybrid_cache_bytes(config, T: int, dtype: torch.dtype = torch.float32, sinks: int = 0,
                       convention: str = "longattn", slack: int = 0, per_layer: bool = False):
    """Bytes of K plus V one sequence keeps after T tokens, windowed layers bounded.

    Args:
        config: anything with ``num_layers``, ``num_kv_heads``, ``head_dim`` and
            ``layer_windows`` (list of int | None, one per layer) -- a ``ModelConfig`` or a
            ``PUBLISHED_CONFIGS`` row.
        T: tokens seen so far.
        dtype: storage dtype of K and V.
        sinks, slack, convention: passed to ``bounded_cache_tokens`` for windowed layers.
        per_layer: return a list of per-layer bytes instead of the total.
    Returns:
        int total bytes, or ``[L]`` list of ints. Layer bytes = 2 * num_kv_heads * (bytes of
        one stored row, ``kv_format.row_bytes``) * tokens, tokens = T for full layers and ``bounded_cache_tokens`` otherwise.
    """
    check_int("T", T)
    windows = list(config.layer_windows)
    if len(windows) != config.num_layers:
        raise LongattnError(f"config has {len(windows)} layer windows for {config.num_layers} layers")
    _itemsize(dtype)  # a torch.dtype, refused in one line otherwise
    from ..cache.kv_format import row_bytes  # int8 rows carry their scales
    per_token = 2 * config.num_kv_heads * row_bytes(dtype, config.head_dim)
    out = [per_token * bounded_cache_tokens(T, w, sinks, slack, convention) for w in windows]
    return out if per_layer else sum(out)


# --------------------------------------------------------------------------------------------
# Published architectures (attention-relevant fields only), each with where the numbers come from.


@dataclass(frozen=True)
class PublishedConfig:
    """Attention shape of a released checkpoint. ``layer_windows[i]`` None = full attention."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_windows: tuple
    source: str

    @property
    def windowed_layers(self) -> int:
        return sum(w is not None for w in self.layer_windows)


def _gemma2_windows(L: int, W: int) -> tuple:
    # transformers Gemma2Config: layer i is "sliding_attention" when (i + 1) % 2, else full.
    return tuple(W if (i + 1) % 2 else None for i in range(L))


def _gemma3_windows(L: int, W: int) -> tuple:
    # transformers Gemma3TextConfig: sliding_window_pattern 6 -> layer i full when (i + 1) % 6 == 0.
    return tuple(W if (i + 1) % 6 else None for i in range(L))


_G2_SRC = ("transformers 5.23 models/gemma2/configuration_gemma2.py (layer_types: sliding when "
           "(i+1) % 2, sliding_window default 4096); ")
_G3_SRC = ("transformers 5.23 models/gemma3/configuration_gemma3.py (sliding_window_pattern 6: "
           "full when (i+1) % 6 == 0); ")

_ROWS = [
    PublishedConfig("gemma-2-2b", 26, 8, 4, 256, 2304, _gemma2_windows(26, 4096),
                    _G2_SRC + "google/gemma-2-2b config.json (num_hidden_layers 26, num_attention_heads 8, "
                    "num_key_value_heads 4, head_dim 256, hidden_size 2304, sliding_window 4096), as "
                    "copied in huggingface.co/kemura/gemma-2b-sql-finetuned; AI-Hypercomputer/maxtext "
                    "hf_model_configs.py gemma2_2b_config"),
    PublishedConfig("gemma-2-9b", 42, 16, 8, 256, 3584, _gemma2_windows(42, 4096),
                    _G2_SRC + "google/gemma-2-9b-it config.json (42 layers, 16 heads, 8 KV heads, "
                    "head_dim 256, hidden_size 3584, sliding_window 4096), as copied in "
                    "huggingface.co/Q-PING/krx_Gemma_9B_it_1119_5; maxtext gemma2_9b_config"),
    PublishedConfig("gemma-2-27b", 46, 32, 16, 128, 4608, _gemma2_windows(46, 4096),
                    _G2_SRC + "AI-Hypercomputer/maxtext MaxText/utils/ckpt_conversion/utils/"
                    "hf_model_configs.py gemma2_27b_config (46 layers, 32 heads, 16 KV heads, head_dim 128, "
                    "hidden_size 4608, sliding_window 4096)"),
    PublishedConfig("gemma-3-270m", 18, 4, 1, 256, 640, _gemma3_windows(18, 512),
                    _G3_SRC + "google/gemma-3-270m config.json (18 layers, 4 heads, 1 KV head, head_dim "
                    "256, hidden_size 640, sliding_window 512, layer_types 5 sliding : 1 full), as copied "
                    "in huggingface.co/Codingstark/gemma3-270m-leetcode; the bundled model's shape"),
    PublishedConfig("gemma-3-1b", 26, 4, 1, 256, 1152, _gemma3_windows(26, 512),
                    _G3_SRC + "google/gemma-3-1b-it config.json (26 layers, 4 heads, 1 KV head, head_dim "
                    "256, hidden_size 1152, sliding_window 512, sliding_window_pattern 6), as quoted in "
                    "github.com/Liwink/gemma-jax models/README.md"),
    PublishedConfig("gemma-3-4b", 34, 8, 4, 256, 2560, _gemma3_windows(34, 1024),
                    _G3_SRC + "AI-Hypercomputer/maxtext hf_model_configs.py gemma3_4b_config text_config "
                    "(34 layers, 8 heads, 4 KV heads, head_dim 256, hidden_size 2560, sliding_window 1024, "
                    "sliding_window_pattern 6)"),
    PublishedConfig("gemma-3-12b", 48, 16, 8, 256, 3840, _gemma3_windows(48, 1024),
                    _G3_SRC + "maxtext gemma3_12b_config text_config (48 layers, 16 heads, 8 KV heads, "
                    "head_dim 256, hidden_size 3840, sliding_window 1024); same in "
                    "huggingface.co/OpenPipe/gemma-3-12b-it-text-only config.json"),
    PublishedConfig("gemma-3-27b", 62, 32, 16, 128, 5376, _gemma3_windows(62, 1024),
                    _G3_SRC + "maxtext gemma3_27b_config text_config (62 layers, 32 heads, 16 KV heads, "
                    "head_dim 128, hidden_size 5376, sliding_window 1024, query_pre_attn_scalar 168)"),
    PublishedConfig("mistral-7b-v0.1", 32, 32, 8, 128, 4096, (4096,) * 32,
                    "mistralai/Mistral-7B-v0.1 config.json (num_hidden_layers 32, num_attention_heads 32, "
                    "num_key_value_heads 8, hidden_size 4096, sliding_window 4096 on every layer), as "
                    "copied in huggingface.co/dmayboroda/42_mistral_0.1; head_dim 128 from "
                    "mlx-community/mistral-7B-v0.1 params.json"),
    PublishedConfig("qwen2.5-0.5b", 24, 14, 2, 64, 896, (None,) * 24,
                    "Qwen/Qwen2.5-0.5B config.json (24 layers, 14 heads, 2 KV heads, hidden_size 896 -> "
                    "head_dim 64, use_sliding_window false), as copied in "
                    "huggingface.co/osllmai-community/Qwen2.5-0.5B; same shape as the bundled "
                    "Qwen2.5-Coder-0.5B"),
    PublishedConfig("qwen3-0.6b", 28, 16, 8, 128, 1024, (None,) * 28,
                    "AI-Hypercomputer/maxtext hf_model_configs.py qwen3_0_6b_config (28 layers, 16 heads, "
                    "8 KV heads, head_dim 128, hidden_size 1024, no sliding window)"),
    PublishedConfig("smollm2-135m", 30, 9, 3, 64, 576, (None,) * 30,
                    "HuggingFaceTB/SmolLM2-135M config.json (30 layers, 9 heads, 3 KV heads, head_dim 64, "
                    "hidden_size 576, no sliding window), as copied in "
                    "huggingface.co/Avibhi/SmolLM2-SFT-DSQA; the bundled model's shape"),
    PublishedConfig("llama-3.2-1b", 16, 32, 8, 64, 2048, (None,) * 16,
                    "meta-llama/Llama-3.2-1B config.json (16 layers, 32 heads, 8 KV heads, head_dim 64, "
                    "hidden_size 2048, no sliding window), as copied in "
                    "huggingface.co/Emm9625/Llama-3.2-1B-chatml"),
]

PUBLISHED_CONFIGS = {row.name: row for row in _ROWS}
