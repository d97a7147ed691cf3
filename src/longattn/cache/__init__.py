"""KV caches: per-layer storage behind one interface (see base.KVCache)."""

from .base import KVCache, LayerCache, GrowingLayerCache, register_layer_cache, LAYER_CACHES  # noqa: F401
