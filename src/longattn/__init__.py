"""longattn: pretrained decoder LLMs over long contexts with bounded attention.

Layout (each module owns one concern; see DESIGN.md in the shared folder):
    checkpoint/ config    GGUF / HF loading -> ModelConfig + weights (models/)
    models/               the transformer, family differences as config data
    policy                per-layer attention choice (dense | window | sparse)
    cache/                KV storage per layer (growing, ring, hybrid, eviction)
    ops/                  attention arithmetic (reference, masked SDPA, banded)
    sparse/               SCSA sparse decode operator
    session               prefill / decode loop, sampling
    lab/                  arithmetic and experiments
    cli/                  `longattn ...`
"""

__version__ = "0.1.0"

from .errors import LongattnError  # noqa: F401
