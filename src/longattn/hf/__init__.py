"""longattn's window + sinks ring caches and attention inside transformers models.

    import longattn.hf
    cache = longattn.hf.apply(model, window=1024, sinks=4)   # SinkCache for model.config
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=200)

See docs/transformers.md for what is promised and the supported transformers versions.
"""

from .policy import SERVED_MODEL_TYPES, TRANSFORMERS_RANGE, model_config, sink_policy  # noqa: F401
from .cache import LongattnCache, ShiftingSinkCache, SinkCache  # noqa: F401
from .attention import apply, attached, detach, longattn_attention  # noqa: F401
from .stream import stream_score  # noqa: F401
