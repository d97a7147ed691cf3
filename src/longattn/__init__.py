"""longattn: pretrained decoder LLMs over long contexts with bounded attention.

Layout (one module per concern; the map with every exactness claim is docs/design.md):
    checkpoint/ config    GGUF / HF loading -> ModelConfig + weights
    models/               the transformer, family differences as config data
    policy                per-layer attention choice as data (dense | window | sparse)
    cache/                KV storage per layer (growing, ring, paged, hybrid, eviction)
    ops/                  attention and matrix kernels, their references
    engine/               chunked prefill, decode steps, generate, the static step
    sparse/               SCSA sparse decode operator
    serve/ hf/            the OpenAI-compatible server; the transformers adapter
    lab/                  arithmetic and experiments
    cli/                  `longattn ...`
"""

__version__ = "0.1.0"

from .errors import LongattnError  # noqa: F401
