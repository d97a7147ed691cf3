"""A tiny random llama GGUF (with a byte-level BPE vocabulary) written with gguf's GGUFWriter:
a real file to damage in the bad-input and kill tests, converted in a fraction of a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SIZES = dict(vocab=98, hidden=64, ff=96, layers=2, heads=4, kv_heads=2, head_dim=16, context=256)


def _vocab() -> list:
    # byte-level BPE spells a space as "Ġ"; printable ASCII otherwise stands for itself
    return ["Ġ"] + [chr(c) for c in range(33, 127)] + ["Ġt", "he", "<eos>"]


def write_tiny_gguf(path: Path, seed: int = 0, context: int = SIZES["context"],
                    quantized: bool = True, mlp_type: str = "Q8_0", attn_type: str | None = None,
                    rope_dims: int | None = None) -> Path:
    """Write the tiny model to ``path``; the MLP matrices are ``mlp_type`` (a GGML block type)
    when ``quantized``, the attention projections ``attn_type`` when given (float32 otherwise);
    ``rope_dims``: the header's ``llama.rope.dimension_count`` (as llama.cpp's converter writes
    it), absent when None."""
    import gguf
    s = SIZES
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random")
    w.add_block_count(s["layers"])
    w.add_context_length(context)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    if rope_dims is not None:
        w.add_rope_dimension_count(rope_dims)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([1] * (len(vocab) - 1) + [3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(len(vocab) - 1)
    w.add_eos_token_id(len(vocab) - 1)

    def add(name, *shape, quant=None):
        a = (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 0.1)).astype(np.float32)
        if quant:
            kind = gguf.GGMLQuantizationType[quant]
            q = gguf.quants.quantize(a, kind)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, a)
    h, d = s["hidden"], s["head_dim"]
    add("token_embd.weight", s["vocab"], h)
    add("output_norm.weight", h)
    add("output.weight", s["vocab"], h)
    for i in range(s["layers"]):
        add(f"blk.{i}.attn_norm.weight", h)
        add(f"blk.{i}.attn_q.weight", s["heads"] * d, h, quant=attn_type)
        add(f"blk.{i}.attn_k.weight", s["kv_heads"] * d, h, quant=attn_type)
        add(f"blk.{i}.attn_v.weight", s["kv_heads"] * d, h, quant=attn_type)
        add(f"blk.{i}.attn_output.weight", h, s["heads"] * d, quant=attn_type)
        add(f"blk.{i}.ffn_norm.weight", h)
        mlp = mlp_type if quantized else None
        add(f"blk.{i}.ffn_gate.weight", s["ff"], h, quant=mlp)
        add(f"blk.{i}.ffn_up.weight", s["ff"], h, quant=mlp)
        add(f"blk.{i}.ffn_down.weight", h, s["ff"], quant=mlp)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
