"""The engine: prefill and decode loops over a model, a policy and a cache.

    session        Session (chunked prefill, step decode, several streams batched) and generate
    static_step    StaticDecoder: a fixed-shape decode step over preallocated buffers, compilable
    sampling       next-token choice (greedy, temperature, top-k, top-p; explicit seed)
"""

from .sampling import SamplingConfig, sample  # noqa: F401
from .session import GenerationResult, Session, generate  # noqa: F401
