"""transformers' own float32 copy of a checkpoint: the independent oracle for tests and
benchmarks. transformers dequantizes the GGUF itself, which is slow; the result is cached in
``$LONGATTN_CACHE/oracle/<key>`` (atomically) so later loads take about a second."""

from __future__ import annotations

import json

import torch

from .bundled import resolve_model
from .digest import content_digest, remember_digest
from .load import cache_key
from .tokenizer import quiet_transformers
from .paths import atomic_dir, cache_root


def oracle_dir(name_or_path: str) -> str:
    quiet_transformers()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    _, src = resolve_model(name_or_path)
    if src.is_dir():
        return str(src)
    digest = content_digest([src], remember=False)
    target = cache_root() / "oracle" / cache_key(digest)
    if not (target / "model.safetensors").exists():
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        with atomic_dir(target, complete=lambda p: (p / "model.safetensors").exists()) as tmp:
            save_file({k: v.clone().contiguous() for k, v in hf.state_dict().items()},
                      str(tmp / "model.safetensors"))
            if hasattr(hf.config, "quantization_config"):
                del hf.config.quantization_config
            hf.config.save_pretrained(str(tmp))
            (tmp / "source.json").write_text(json.dumps({"source": str(src)}))
        del hf
    remember_digest([src], digest)
    return str(target)


def oracle_model(name_or_path: str, dtype=torch.float32):
    """A transformers AutoModelForCausalLM on the same weights, in eval mode."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(oracle_dir(name_or_path), dtype=dtype).eval()
