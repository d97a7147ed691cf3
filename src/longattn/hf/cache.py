"""transformers Cache classes over longattn's own layer caches.

A ``LongattnCache`` is a transformers ``Cache`` whose layers wrap longattn's LayerCaches
(``cache/ring.py`` RingLayerCache on windowed layers, GrowingLayerCache on global ones, built
by ``cache.factory.make_cache`` from an AttentionPolicy). Each layer numbers the tokens it
stores by absolute position and remembers, for the attention function, the positions of the
queries and of the keys it last returned: a ring returns keys out of position order, so the
attention must mask by those positions (``hf/attention.py``), never by slot index.

- ``SinkCache(config, window, sinks)``: window + sinks rings, absolute positions.
- ``ShiftingSinkCache(config, window, sinks)``: the same rings with StreamingLLM's position
  shift (attention sees positions within the cache; sink keys re-rotated on read).
- ``LongattnCache(config, policy)``: any longattn policy, sparse (SCSA) layers included
  (their growing cache is the append-only one SCSA indexes; the index lives in the op).

All three need the model's attention routed through longattn (``longattn.hf.apply``): a
layer refuses to store anything while the config's attention implementation is another.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.base import KVCache
from ..cache.evict import evict as _evict
from ..cache.factory import make_cache
from ..cache.kv_format import KV_FORMATS
from ..errors import LongattnError, check_int
from ..models.rope import inv_freq
from ..policy import AttentionPolicy
from .policy import check_transformers_version, model_config, sink_policy


class LongattnLayer(CacheLayerMixin):
    """One layer of a LongattnCache: a longattn LayerCache behind transformers' layer API.

    The LayerCache is made on the first ``update`` (when batch and dtype are known).
    After each ``update``, ``q_pos [B, T]`` holds the positions of that call's tokens and
    ``k_pos [B, N]`` the absolute position of every returned key slot (-1 = empty).
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "LongattnCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.seen = 0  # tokens stored so far: the next token's position
        self.q_pos: Optional[torch.Tensor] = None
        self.k_pos: Optional[torch.Tensor] = None
        self.view = None  # the KVView of the last update (what the layer's attention op reads)

    @property
    def inner(self):
        """The longattn LayerCache (None before the first update)."""
        kv = self.owner.kv
        return None if kv is None else kv.layers[self.index]

    @property
    def is_sliding(self) -> bool:
        lp = self.owner.policy.layers[self.index]
        return lp.window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.device.type != "cpu":
            raise LongattnError(f"longattn.hf caches run on CPU; the model is on {key_states.device}")
        self.owner.allocate(key_states.shape[0], key_states.dtype)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``key_states, value_states [B, Hkv, T, D]`` at the next T positions; return
        what the layer's attention may read: ``(k [B, Hkv, N, D], v)``, with ``k_pos [B, N]``."""
        impl = getattr(self.owner.hf_config, "_attn_implementation", None)
        if impl != "longattn":
            raise LongattnError(f"the model's attention is '{impl}', which reads a ring's slots as if in "
                                "position order: call longattn.hf.apply(model) before using this cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, _, T, _ = key_states.shape
        pos = (self.seen + torch.arange(T, dtype=torch.int64)).expand(B, T)  # [B, T]
        rot = self.owner.kv.key_rotation
        if rot is not None:  # a format storing rotated keys; longattn_attention turns the queries alike
            key_states = key_states @ rot.to(key_states.dtype)
        self.view = self.owner.kv.update(self.index, key_states, value_states, pos)
        self.seen += T
        self.q_pos, self.k_pos = pos, self.view.positions
        return self.view.k, self.view.v

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        lp = self.owner.policy.layers[self.index]
        return lp.window + lp.sinks if lp.window is not None else -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # transformers builds no mask for longattn's attention (it masks by positions);
        # these are the sizes of a plain causal layout, for callers that ask anyway.
        return self.seen + query_length, 0

    def reset(self) -> None:
        self.owner.kv = None  # and with it every op's state (a sparse layer's index)
        self.seen = 0
        self.q_pos = self.k_pos = self.view = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise LongattnError("longattn.hf caches cannot be cropped (assisted decoding needs a "
                            "cache that keeps every token); use evict() to forget a span")

    def _map_batch(self, fn) -> None:
        """Apply ``fn`` to the batch dimension of every tensor the layer holds."""
        inner = self.inner
        if inner is None:
            return
        if self.owner.kv.op_state[self.index]:  # a sparse layer's SCSA index for these streams
            raise LongattnError("a sparse layer's SCSA index cannot follow reordered or repeated streams "
                                "(beam search); use greedy or sampled decoding")
        inner.k, inner.v, inner.pos = fn(inner.k), fn(inner.v), fn(inner.pos)
        inner.B = inner.k.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self):
        pass  # CPU only: nothing to move

    def prefetch(self):
        pass


class LongattnCache(Cache):
    """A transformers Cache laid out by a longattn AttentionPolicy.

    Args:
        config: the model's transformers config (``model.config``).
        policy: an AttentionPolicy for ``model_config(config)``, one LayerPolicy per layer;
            windowed layers get rings of ``window`` rotating slots plus the sinks, global
            layers a growing cache.
        shift: StreamingLLM's position shift on the rings (see ShiftingSinkCache).
        kv: how keys and values are stored (cache/kv_format.py): "f32" (as the model computes
            them, the reference), "bf16" or "int8" (q8 rows; keys stored rotated, and the
            attention turns the queries with them).
    """

    def __init__(self, config, policy: AttentionPolicy, shift: bool = False, kv: str = "f32"):
        check_transformers_version()
        if kv not in KV_FORMATS:
            raise LongattnError(f"kv must be one of {', '.join(KV_FORMATS)}, got {kv!r}")
        self.model_config = model_config(config)
        cfg = self.model_config
        if len(policy.layers) != cfg.num_layers:
            raise LongattnError(f"policy has {len(policy.layers)} layers; the model has {cfg.num_layers}")
        unknown = sorted({lp.kind for lp in policy.layers} - {"window", "sparse"})
        if unknown:
            raise LongattnError(f"longattn.hf serves window, dense and sparse layers; not {', '.join(unknown)}")
        if shift and not any(lp.window for lp in policy.layers):
            raise LongattnError("the position shift needs a windowed layer: give the policy a window")
        self.hf_config = config
        self.policy = policy
        self.shift = shift
        self.kv_format = kv
        self.kv: Optional[KVCache] = None  # longattn's cache, made on the first update
        super().__init__(layers=[LongattnLayer(self, i) for i in range(cfg.num_layers)])
        self._inv_freqs = _rope_inv_freqs(config, cfg) if shift else None

    def allocate(self, batch: int, dtype: torch.dtype) -> None:
        """Make longattn's cache for ``batch`` streams (once; later layers share it)."""
        if self.kv is not None:
            if self.kv.batch != batch:
                raise LongattnError(f"this cache holds {self.kv.batch} stream(s); the call has {batch}")
            return
        if self.kv_format != "f32":  # f32: as the model computes them (float64 in reference runs)
            dtype = KV_FORMATS[self.kv_format]
        self.kv = make_cache(self.model_config, self.policy, batch=batch, kind="auto", dtype=dtype,
                             model=self._inv_freqs, reindex=self.shift)

    def nbytes(self) -> int:
        """Bytes of K and V storage held (0 before the first update)."""
        return 0 if self.kv is None else self.kv.nbytes()

    def tokens(self) -> list:
        """Per layer: filled slots (max over streams)."""
        return [0] * len(self.layers) if self.kv is None else self.kv.tokens()

    def evict(self, start: int, end: int) -> "LongattnCache":
        """Forget positions ``[start, end)`` in every layer and renumber what follows.

        Later keys move down by ``end - start`` (re-rotated with each layer's RoPE
        frequencies: ``cache/evict.py``), and the next token takes the position it would have
        had if the span had never been seen. Needs plain RoPE (see ``_rope_inv_freqs``).
        """
        check_int("evict start", start)
        check_int("evict end", end)
        if self.kv is None:
            raise LongattnError("the cache is empty: nothing to evict")
        fs = self._inv_freqs or _rope_inv_freqs(self.hf_config, self.model_config)
        seen = self.layers[0].seen
        self.kv.next_pos = torch.full((self.kv.batch,), seen, dtype=torch.int64)
        _evict(self.kv, start, end, fs)
        for layer in self.layers:
            layer.seen = seen - (end - start)
        return self


def _rope_inv_freqs(config, cfg) -> list:
    """Per layer ``[head_dim // 2]`` RoPE inverse frequencies, for re-rotating keys.

    Only plain RoPE (rope_type "default") is re-rotated: a scaled variant (llama3, yarn,
    linear...) changes the frequencies or the amplitude, and re-rotating with the plain ones
    would be silently wrong.
    """
    params = getattr(config, "rope_parameters", None) or {}
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())  # per layer type
    for group in (params.values() if nested else [params]):
        kind = (group or {}).get("rope_type", "default")
        if kind != "default":
            raise LongattnError(f"re-rotating keys needs plain RoPE; this model uses rope_type '{kind}'")
    return [inv_freq(cfg.head_dim, cfg.layer_rope_theta[i]) for i in range(cfg.num_layers)]


class SinkCache(LongattnCache):
    """Window + sinks ring caches, usable as ``past_key_values=`` for ``generate``.

    A query at position i reads key j when ``j <= i`` and ``i - j < window``, plus the first
    ``sinks`` positions; a windowed layer holds ``sinks + window`` slots whatever the length.

    Args:
        config: the model's transformers config.
        window: keys per query including itself (default: the checkpoint's trained window,
            where it has one).
        sinks: first positions every query keeps reading.
        layers: "auto" keeps a model's trained global layers global (they grow) and windows
            the rest, or every layer when the model has no trained window; "all" imposes
            ``window`` on every layer.
        kv: the storage format (LongattnCache).
    """

    def __init__(self, config, window: Optional[int] = None, sinks: int = 4, layers: str = "auto",
                 kv: str = "f32"):
        super().__init__(config, sink_policy(model_config(config), window, sinks, layers), shift=self._shift,
                         kv=kv)

    _shift = False


class ShiftingSinkCache(SinkCache):
    """SinkCache with StreamingLLM's position shift: attention sees positions within the cache.

    Sinks sit at cache positions ``0..S-1`` and the window right after them, so relative
    distances never exceed ``sinks + window`` however long the stream runs; the sink keys are
    re-rotated on read (``cache/ring.py``, reindex). Needs plain RoPE.
    """

    _shift = True
