"""KV caches: per-layer storage behind one interface (see base.KVCache)."""

from .base import KVCache, KVView, LayerCache, GrowingLayerCache, register_layer_cache, LAYER_CACHES  # noqa: F401
from .ring import RingLayerCache, ring_slot  # noqa: F401,E402
from .hybrid import plan_layers, layer_report, LayerReport, CACHE_KINDS  # noqa: F401,E402
from .factory import make_cache  # noqa: F401,E402
from .evict import evict, trim_to_window, rerotate_error_bound  # noqa: F401,E402
