"""Read a GGUF file into a ModelConfig and a float32 state dict with HF tensor names.

What the GGUF converter changed and we undo here:
- llama: Q and K rows are permuted so GGML can rotate adjacent pairs; we permute them
  back to the half-split (NeoX) layout the HF model uses. Proven by logits in the tests.
- gemma2, gemma3: RMSNorm weights are stored as (1 + w); we subtract 1 so the model applies
  (1 + w) exactly once, as the HF checkpoint does.
- phi3: q/k/v and gate/up stay fused in the file; they are read as their parts
  (lazy_weights.fused_parts), as from the HF checkpoint.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import LongattnError
from .family_gaps import (GEMMA2_ROPE_THETA, GEMMA2_WINDOW, GEMMA3_LOCAL_ROPE_THETA, gemma2_layer_is_global,
                          gemma2_query_pre_attn_scalar, gemma3_global_layers, gemma3_query_pre_attn_scalar)
from .integrity import check_gguf_structure, check_values
from .lazy_weights import LazyWeights

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Phi-3 keeps q/k/v and gate/up fused (as its HF checkpoint does; hf_dir splits them).
_LAYER_NAMES_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 2 and 3 have four norms per block; llama/qwen/phi3 have two.
_NORMS_PLAIN = {"ffn_norm": "post_attention_layernorm"}
_NORMS_GEMMA3 = {"post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}


@functools.cache
def _reader_class():
    """gguf.GGUFReader reading its header from a plain view of the file's map.

    gguf's reader slices its ``np.memmap`` once per value, and every memmap slice runs
    memmap's Python hooks: a 150K-token vocabulary (two string arrays, ~760K slices) takes
    6 s to parse that way and 1.4 s from an ``ndarray`` view of the same map. The values and
    tensor views are the same (tests/core/test_gguf_reader.py compares them).
    """
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))
    return Reader


def _open(path: Path):
    if not path.exists():
        raise LongattnError(f"checkpoint not found: {path}")
    try:
        return _reader_class()(str(path))
    except Exception as e:  # truncated or not a GGUF at all
        raise LongattnError(f"cannot read GGUF {path}: {type(e).__name__}: {e}; "
                            "the file is truncated or corrupt, re-install or re-download it") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise LongattnError(f"unsupported architecture '{arch}' in {path.name}; "
                            f"longattn runs: {', '.join(SUPPORTED_ARCHS)}")

    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_layers = int(a("block_count"))
    hidden = int(a("embedding_length"))
    n_heads = int(a("attention.head_count"))
    n_kv = a("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        n_kv = max(n_kv)
    n_kv = int(n_kv)
    head_dim, source = _head_size(arch, path, hidden, n_heads, n_kv, int(a("attention.key_length", 0) or 0))
    theta = float(a("rope.freq_base", GEMMA2_ROPE_THETA if arch == "gemma2" else 10000.0))
    rot = a("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        _refuse_rotary(reader, arch, path, int(rot), head_dim, source, n_kv)
    names = {t.name for t in reader.tensors}
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields \
        else int(a("vocab_size"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    kw = dict(
        family=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")), num_layers=n_layers,
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        max_context=int(a("context_length", 8192)), rope_theta=theta,
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        longrope_recompute=arch == "phi3",
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=[int(eos)] if eos is not None else [],
        name=str(_field(reader, "general.name", path.stem)),
    )
    kw["rope_scaling"] = _gguf_rope_scaling(reader, arch, path)
    window = a("attention.sliding_window")
    if arch == "phi3" and window:  # 0 = no window (Phi-4 files)
        kw["layer_windows"] = [int(window)] * n_layers
    if arch == "gemma2":
        glob = [gemma2_layer_is_global(i) for i in range(n_layers)]
        kw.update(
            norm_plus_one=True, sandwich_norms=True, embed_scale=hidden ** 0.5, activation="gelu_tanh",
            query_pre_attn_scalar=gemma2_query_pre_attn_scalar(n_layers, hidden, n_heads, head_dim),
            attn_softcap=a("attn_logit_softcapping"), final_softcap=a("final_logit_softcapping"),
            layer_windows=[None if g else int(window or GEMMA2_WINDOW) for g in glob])
    if arch == "gemma3":
        window = int(a("attention.sliding_window", 0) or 0)
        glob = gemma3_global_layers(a("attention.sliding_window_pattern"), n_layers, windowed=window > 0)
        local_theta = float(a("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
        kw.update(
            norm_plus_one=True, sandwich_norms=True, embed_scale=hidden ** 0.5, activation="gelu_tanh",
            query_pre_attn_scalar=gemma3_query_pre_attn_scalar(n_layers, hidden, n_heads, head_dim),
            layer_windows=[None if g else window for g in glob],
            # the file's base and scaling are the global layers'; local layers have their own
            # base (rope.freq_base_swa) and no scaling, as llama.cpp and transformers run them
            layer_rope_theta=[theta if g else local_theta for g in glob],
            layer_rope_scaling=[kw["rope_scaling"] if g else None for g in glob],
        )
        # Gemma 3's chat turns end with <end_of_turn> (id 106) as well as <eos>.
        kw["eos_token_ids"] = sorted(set(kw["eos_token_ids"]) | {106})
    return ModelConfig(**kw)


def _corrupt(path: Path, msg: str) -> LongattnError:
    return LongattnError(f"{path.name}: {msg}; the header is corrupt: re-download or re-convert it")


def _head_size(arch: str, path: Path, hidden: int, n_heads: int, n_kv: int, key_length: int) -> tuple:
    """``(head size, where it comes from)``, after the header's head counts are checked against
    each other and the width: a count that does not divide is named here, rather than
    surfacing later as a head size that matches nothing."""
    for key, n in (("attention.head_count", n_heads), ("attention.head_count_kv", n_kv)):
        if n <= 0:
            raise _corrupt(path, f"{arch}.{key} must be a positive integer, got {n}")
    if n_heads % n_kv:
        raise _corrupt(path, f"{arch}.attention.head_count ({n_heads}) is not divisible by "
                             f"{arch}.attention.head_count_kv ({n_kv}); grouped-query attention needs whole groups")
    if key_length:
        return key_length, f"{arch}.attention.key_length"
    if hidden % n_heads:
        raise _corrupt(path, f"{arch}.embedding_length ({hidden}) is not divisible by {arch}.attention.head_count "
                             f"({n_heads}), and no {arch}.attention.key_length gives the head size")
    return hidden // n_heads, f"{arch}.embedding_length {hidden} / {arch}.attention.head_count {n_heads}"


def _refuse_rotary(reader, arch: str, path: Path, rot: int, head_dim: int, source: str, n_kv: int) -> None:
    """Refuse a rotary width ``rot`` other than the head size: more than a head holds is a
    corrupt header; a head size the key projection contradicts is a corrupt head count; only
    a head size the tensors confirm leaves rope on part of each head (partial rotary), which
    longattn does not implement."""
    if rot > head_dim:
        raise _corrupt(path, f"{arch}.rope.dimension_count ({rot}) is more than the head size {head_dim} ({source})")
    k = next((t for t in reader.tensors if t.name == "blk.0.attn_k.weight"), None)
    rows = int(list(k.shape)[-1]) if k is not None and len(k.shape) == 2 else None
    if rows is not None and rows != n_kv * head_dim:
        raise _corrupt(path, f"{arch}.attention.head_count_kv ({n_kv}) heads of size {head_dim} ({source}) "
                             f"make {n_kv * head_dim} key rows, but tensor 'blk.0.attn_k.weight' has {rows}")
    raise LongattnError(f"{path.name}: {arch}.rope.dimension_count ({rot}) is less than the head size "
                        f"{head_dim} ({source}): rope on part of each head (partial rotary) is not implemented")


# {arch}.rope.scaling.* keys longattn reads; any other key under that prefix is refused.
_ROPE_SCALING_KEYS = ("type", "factor", "original_context_length", "finetuned")


def _gguf_rope_scaling(reader, arch: str, path: Path) -> dict | None:
    """The file's RoPE scaling in models.rope form, or None; refuses what is not implemented.

    - ``rope_freqs.weight`` (llama.cpp's converter writes it for Llama 3 scaling): per-frequency
      divisors, honoured as ``freq_factors``.
    - ``{arch}.rope.scaling.type`` "none" or "linear" (with ``.factor``) is honoured; "yarn" and
      "longrope" are refused (the file does not carry every parameter transformers uses).
    """
    prefix = f"{arch}.rope.scaling."
    keys = [k for k in reader.fields if k.startswith(prefix)]
    unknown = [k for k in keys if k[len(prefix):] not in _ROPE_SCALING_KEYS]
    if unknown:
        raise LongattnError(f"{path.name}: RoPE scaling key {unknown[0]} is not implemented")
    kind = _field(reader, prefix + "type", "none")
    factor = _field(reader, prefix + "factor")
    freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    if freqs:
        if kind not in ("none", None):
            raise LongattnError(f"{path.name}: rope_freqs.weight together with rope scaling type "
                                f"'{kind}' is not implemented")
        factors = np.asarray(freqs[0].data, dtype=np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    if kind in ("none", None):
        if factor not in (None, 1.0):
            raise LongattnError(f"{path.name}: rope scaling factor {factor} without a scaling type")
        return None
    if kind == "linear":
        if factor is None:
            raise LongattnError(f"{path.name}: linear rope scaling without {prefix}factor")
        return {"rope_type": "linear", "factor": float(factor)}
    raise LongattnError(f"{path.name}: RoPE scaling type '{kind}' in a GGUF is not implemented; "
                        "load the model's HF directory instead")


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of the GGUF llama converter's Q/K row permutation.

    The converter maps HF rows ``[h, half, j]`` to ``[h, j, half]`` (pairs made adjacent);
    we map them back. ``w`` is ``[n_head * head_dim, in]``.
    """
    out_dim, in_dim = w.shape
    hd = out_dim // n_head
    return w.reshape(n_head, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


DEQUANTIZE_CHUNK = 1 << 20  # values per call of gguf's block decoder (bounds its temporaries)


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf's own dequantization of a block-quantized tensor (``data``: its bytes, rows last),
    as float32 of the tensor's shape, bit for bit what ``gguf.quants.dequantize`` returns.

    gguf decodes 16 rows per call, which leaves most of the time in Python for a wide tensor;
    this calls the same decoder on about a million values at a time (3-4x faster here)."""
    from gguf import quants
    cls = getattr(quants, "_type_traits", {}).get(qtype)
    if cls is None or not hasattr(cls, "dequantize_rows"):
        return quants.dequantize(data, qtype)  # a type it has no block decoder for raises there
    cls.init_grid()
    block, size = quants.GGML_QUANT_SIZES[qtype]
    rows = data.reshape(-1, data.shape[-1])
    if rows.shape[1] % size:
        raise ValueError(f"a row of {rows.shape[1]} bytes is not a whole number of {size}-byte blocks")
    width = rows.shape[1] // size * block
    out = np.empty((rows.shape[0], width), dtype=np.float32)
    step = max(1, DEQUANTIZE_CHUNK // max(width, 1))
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = cls.dequantize_rows(rows[i:i + step]).reshape(-1, width)
    return out.reshape(*data.shape[:-1], width)


def _float32(t) -> torch.Tensor:
    """GGUF tensor ``t`` (a gguf ReaderTensor) as a new float32 tensor in PyTorch
    ``[out, in]`` orientation."""
    from gguf import GGMLQuantizationType
    shape = [int(x) for x in reversed(list(t.shape))]
    try:
        if t.tensor_type == GGMLQuantizationType.F32:  # a view of the map: copied
            arr = np.array(t.data, dtype=np.float32, copy=True)
        elif t.tensor_type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            from gguf import quants
            arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        else:  # a new array already
            arr = dequantize(t.data, t.tensor_type)
        return torch.from_numpy(arr.reshape(shape))
    except (NotImplementedError, ValueError, TypeError) as e:  # a type gguf cannot read, a bad size
        raise LongattnError(f"tensor '{t.name}' ({getattr(t.tensor_type, 'name', t.tensor_type)}) "
                            f"cannot be dequantized: {type(e).__name__}: {e}") from None


def _hf_name(name: str, cfg: ModelConfig, path: Path) -> tuple:
    """``(HF tensor name, heads)`` of GGUF tensor ``name``: ``heads`` > 0 where its rows must be
    unpermuted (``_unpermute_qk``), name None for a tensor read into the config instead.
    Raises LongattnError for a tensor the family does not have."""
    norms = _NORMS_GEMMA3 if cfg.family in ("gemma2", "gemma3") else _NORMS_PLAIN
    layer_names = {**_LAYER_NAMES, **(_LAYER_NAMES_PHI3 if cfg.family == "phi3" else {})}
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", 0
    if name == "output_norm.weight":
        return "model.norm.weight", 0
    if name == "output.weight":
        return "lm_head.weight", 0
    if name.startswith("blk."):
        _, i, part, kind = name.split(".", 3)
        mapped = layer_names.get(part) or norms.get(part)
        if mapped is None:
            raise LongattnError(f"{path.name}: unexpected tensor '{name}' for {cfg.family}")
        heads = 0
        if cfg.family == "llama" and part in ("attn_q", "attn_k"):
            heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
        return f"model.layers.{i}.{mapped}.{kind}", heads
    if name == "rope_freqs.weight":
        return None, 0  # read into cfg.rope_scaling by read_gguf_config
    if name.startswith("rope_factors_"):
        raise LongattnError(f"{path.name}: long-context rope factors ({name}) are not implemented in "
                            "GGUF files; load the model's HF directory instead")
    raise LongattnError(f"{path.name}: unexpected tensor '{name}'")


class GGUFWeights(LazyWeights):
    """A GGUF file's weights as a read-only mapping HF name -> float32 tensor, each
    dequantized, checked (integrity.check_values) and put in the HF layout when it is looked
    up, and not kept (lazy_weights). ``shape(name)`` reads the header only.

    Args:
        path: the file. reader, cfg: its reader and config (open_gguf).
    """

    def __init__(self, path: str | os.PathLike, reader, cfg: ModelConfig):
        super().__init__(cfg)
        self.path = Path(path)
        for t in reader.tensors:
            key, heads = _hf_name(t.name, cfg, self.path)
            if key is None:  # read into the config: its values are checked all the same
                check_values(t.name, _float32(t), self.path)
            else:
                self._add(key, (t, heads, key), tuple(int(x) for x in reversed(list(t.shape))))

    def _read(self, stored) -> torch.Tensor:
        t, heads, key = stored
        w = _float32(t)
        check_values(t.name, w, self.path)
        if heads:
            w = _unpermute_qk(w, heads)
        if self.cfg.norm_plus_one and key.endswith("norm.weight"):
            w = w - 1.0
        return w


def _config(reader, path: Path) -> ModelConfig:
    """read_gguf_config, with one line for a header too damaged to read."""
    try:
        return read_gguf_config(reader, path)
    except LongattnError:
        raise
    except MemoryError:
        raise LongattnError(f"{path.name}: the GGUF header's sizes are too large to be real (a damaged "
                            "header); re-download or re-convert it") from None
    except Exception as e:
        raise LongattnError(f"{path.name}: incomplete GGUF metadata ({type(e).__name__}: {e})") from None


def open_gguf(path: str | os.PathLike) -> tuple[ModelConfig, GGUFWeights]:
    """Parse a GGUF file's header and check its structure: ``(config, weights)``, the weights
    read on lookup (GGUFWeights)."""
    path = Path(path)
    reader = _open(path)
    cfg = _config(reader, path)
    check_gguf_structure(reader, cfg, path)
    return cfg, GGUFWeights(path, reader, cfg)


def load_gguf(path: str | os.PathLike, progress=None) -> tuple[ModelConfig, dict]:
    """Parse and dequantize a GGUF file.

    Returns:
        (config, state_dict) where state_dict maps HF-style names to float32 tensors.
    """
    cfg, weights = open_gguf(path)
    names = list(weights)
    return cfg, {k: weights[k] for k in (progress(names, total=len(names)) if progress else names)}


# GGUF block formats whose values int4 or int5 (models.weights: groups of 32, ``d * u + m``,
# float16 d and m) hold exactly, with their bytes per block of 32: Q4_1 is int4's layout byte for
# byte and Q4_0 is ``d * (u - 8)``; Q5_1 is int5's and Q5_0 is ``d * (u - 16)``.
STORED_GROUP_TYPES = {"Q4_0": ("int4", 18), "Q4_1": ("int4", 20), "Q5_0": ("int5", 22), "Q5_1": ("int5", 24)}


def read_stored_groups(path: str | os.PathLike) -> dict:
    """The GGUF's 4- and 5-bit matrices as int4 or int5 parts, read as stored (nothing
    dequantized).

    Returns:
        HF tensor name -> ("int4", (codes ``[N, K/2]`` uint8, d, m ``[N, K/32]`` float16)) for
        every Q4_0 and Q4_1 matrix, ("int5", (codes, hbits ``[N, K/8]`` uint8, d, m)) for every
        Q5_0 and Q5_1 matrix: ``dequantize_int4(*parts)`` / ``dequantize_int5(*parts)`` equals
        the float32 weight ``load_gguf`` gives, bit for bit (llama's Q/K rows unpermuted
        alike). Phi-3's fused matrices, split after loading, are left out (they are quantized
        instead), and so is a matrix whose offset ``-8 d`` or ``-16 d`` overflows float16.
    """
    path = Path(path)
    reader = _open(path)
    cfg = read_gguf_config(reader, path)
    out = {}
    for t in reader.tensors:
        fmt, size = STORED_GROUP_TYPES.get(t.tensor_type.name, (None, 0))
        if fmt is None or len(t.shape) != 2:
            continue
        key, heads = _hf_name(t.name, cfg, path)
        if key is None or (cfg.family == "phi3" and key.endswith(("qkv_proj.weight", "gate_up_proj.weight"))):
            continue
        raw = np.asarray(t.data, dtype=np.uint8)
        N = raw.shape[0]
        blocks = raw.reshape(N, -1, size)

        def half(at: int) -> torch.Tensor:  # the float16 at byte ``at`` of every block
            return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0])

        d = half(0)
        if size in (20, 24):  # Q4_1, Q5_1: d, m, ...
            m = half(2)
        else:  # Q4_0, Q5_0: d, ...; the offset -8 d or -16 d is exact in float16 unless it overflows
            m = d * (-8 if fmt == "int4" else -16)
            if not bool(torch.isfinite(m).all()):
                continue
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., size - 16:]).reshape(N, -1))
        parts = [codes, d, m]
        if fmt == "int5":  # the 4 bytes of fifth bits sit just before the 16 of codes
            parts.insert(1, torch.from_numpy(np.ascontiguousarray(blocks[..., size - 20:size - 16]).reshape(N, -1)))
        if heads:
            parts = [_unpermute_qk(x, heads) for x in parts]
        out[key] = (fmt, tuple(x.contiguous() for x in parts))
    return out
