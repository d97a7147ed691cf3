"""SCSA: self-calibrating, training-free sparse decode attention over a layer's KV cache.

    from longattn.sparse import SCSAConfig, SCSALayer
    layer = SCSALayer(SCSAConfig(), num_heads=14, num_kv_heads=2, head_dim=64, layer_index=3)
    out = layer.attend(q, k, v, scale)   # q [B, H, 1, D]; k, v [B, Hkv, N, D] (whole cache)

Modules: ``config`` (settings), ``clustering`` (splitting + summaries), ``store``
(cluster-contiguous rows), ``packing`` (q8_0 rows; picks a packing), ``index`` (incremental
per-row index), ``kernel`` (the fast selection and merged softmax), ``prepared`` (a row's
quantities shared by every tau), ``layer`` (the operator and its native call), ``calibrate``
(tau self-calibration), ``taus`` (set taus and the tau file), ``serial`` (the slow reference
path), ``cost`` (the dense-or-sparse cost rule), ``policy`` / ``static_op`` (the model's wiring),
``synthetic`` (clustered test caches); ``experimental/`` holds the research variants
(hierarchical tree walk, re-decided rule, f16/f32 packings).
"""

from .config import SCSAConfig  # noqa: F401
from .layer import SCSALayer  # noqa: F401
