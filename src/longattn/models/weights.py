"""Weight formats for the projection matrices: f32, bf16, int8 (per output channel), int4 and
int5 (groups of 32), and ``auto`` (the default), which picks int4, int5 or int8 for each kind
of matrix from what the checkpoint stores (auto_recipe).

``int8`` stores every 2-D weight (projections, embedding table, output head) as int8 rows with
one float32 scale per row (symmetric, scale = max|row| / 127): a decode step reads a quarter of
the float32 bytes. Every int8, int4 and int5 matmul, whatever its row count, runs longattn's
kernel (ops/csrc/quant_gemm.cpp; ops/linear.py picks it, and evaluates the same product in
PyTorch where it cannot run), which rounds the activations to int8 per block of 32 and takes
exact integer dots.

Per-row quantization commutes with concatenating rows, so the fused q/k/v and gate/up matrices
hold exactly the values that quantizing each part would give: ``effective_state_dict`` uses that
to build the float reference model that tests compare the int8 paths against.

``int4`` stores every 2-D weight whose row length is a multiple of 32 as 4-bit codes in groups
of 32 along the row, each group with a float16 step and a float16 offset (``d * u + m``,
u in 0..15; 20 bytes per 32 weights), multiplied as int8 is. A matrix whose rows are not a
multiple of 32 stays int8.
``int5`` is int4 with a fifth bit per code (u in 0..31, 24 bytes per 32 weights; the same
kernels): GGML's Q5_0 and Q5_1 blocks are int5 groups exactly, so a GGUF's 5-bit matrices run
as stored instead of widened to int8.
(Not PyTorch's own ``_weight_int4pack_mm_for_cpu``, which does not beat bf16 on CPU, nor a
float-activation 4-bit kernel, which is bound by its conversions.)
"""

from __future__ import annotations

import torch

from ..errors import LongattnError
from ..ops.linear import INT4_GROUP, dequantize_int4, dequantize_int5, dequantize_int8

WEIGHT_FORMATS = ("f32", "bf16", "int8", "int4", "int5")
# the formats a recipe may mix, one per kind of matrix (parse_recipe)
QUANTIZED = ("int8", "int4", "int5")
# names accepted on the command line and in the API (the --dtype spellings included)
_ALIASES = {"f32": "f32", "float32": "f32", "fp32": "f32", "bf16": "bf16", "bfloat16": "bf16",
            "int8": "int8", "q8": "int8", "int4": "int4", "q4": "int4", "int5": "int5", "q5": "int5"}


def parse_weights(name: str) -> str:
    """Canonical weight-format name (``f32``, ``bf16``, ``int8``, ``int4`` or ``int5``); one-line error otherwise."""
    if isinstance(name, torch.dtype):
        name = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(name, str(name))
    key = _ALIASES.get(str(name).lower())
    if key is None:
        raise LongattnError(f"unknown weight format {name!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    return key


# Values quantized per call: rows are independent, so a large matrix is quantized in slices
# of rows, which bounds the float temporaries (an embedding table's are 0.5 GB each, whole).
QUANTIZE_SLICE = 1 << 22


def _by_rows(fn, w: torch.Tensor, empty_outputs) -> tuple:
    """``fn(w)`` computed over slices of ``w``'s rows into ``empty_outputs()`` (empty tensors
    of the results' shapes), or whole where ``w`` is small or on the meta device."""
    N, K = w.shape
    if w.device.type == "meta" or N * K <= QUANTIZE_SLICE:
        return fn(w)
    outputs = empty_outputs()
    step = max(1, QUANTIZE_SLICE // max(K, 1))
    for i in range(0, N, step):
        for out, part in zip(outputs, fn(w[i:i + step])):
            out[i:i + step] = part
    return outputs


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8. ``w [N, K]`` float -> (q ``[N, K]`` int8, scales ``[N]`` float32).

    Rows that are all zero get scale 1 (q = 0), so dequantizing never divides by zero.
    """
    return _by_rows(_quantize_int8, w, lambda: (torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0])))


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


# The default: each matrix in the fastest format that holds what the checkpoint stores at a
# negligible cost (auto_recipe).
AUTO = "auto"

# Module-name fragments (build_model's kinds) and the checkpoint matrices each one is made
# of (the last part of their module name; q/k/v and gate/up are fused).
_KINDS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down_proj": ("down_proj",), "embed": ("embed_tokens",), "lm_head": ("lm_head",)}


def auto_recipe(matrices, stored: dict) -> str:
    """The recipe ``auto`` stands for, from the groups the checkpoint stores (``stored``: name
    -> "int4" or "int5" for each matrix whose blocks that format holds exactly, names as in
    ``matrices``; checkpoint.gguf_file.read_stored_groups). Each kind of matrix (``_KINDS``)
    takes int4 where every matrix of it is stored as 4-bit groups, int5 where every one is
    stored as 4- or 5-bit groups, int8 otherwise.

    int4 and int5 then cost nothing against the checkpoint's weights (their decode rounds
    activations to int8 per block of 32, as llama.cpp does), int8 costs <= 0.004 bits/token on
    the bundled models and auto as a whole <= 0.005 (benchmarks/weights_quality.py). A
    checkpoint with a matrix outside ``_KINDS`` (an expert router, say) gets plain int8.
    """
    part_of = {part: kind for kind, parts in _KINDS.items() for part in parts}
    kinds = {n: part_of.get(n.rsplit(".", 2)[-2] if n.endswith(".weight") else "") for n in matrices}
    if None in kinds.values():
        return "int8"
    fmt = {}
    for n, kind in kinds.items():
        have = stored.get(n, "int8")
        was = fmt.get(kind, "int4")
        fmt[kind] = "int8" if "int8" in (have, was) else "int5" if "int5" in (have, was) else "int4"
    base = next((f for f in ("int4", "int5") if f in fmt.values()), "int8")
    return recipe_name(base, tuple((k, fmt[k]) for k in _KINDS if fmt.get(k, base) != base))


def _kind_pairs(kinds) -> tuple:
    """``kinds`` as (fragment, format) pairs; a plain fragment stands for int8."""
    return tuple((k, "int8") if isinstance(k, str) else (k[0], parse_weights(k[1])) for k in kinds)


def parse_recipe(spec: str) -> tuple[str, tuple]:
    """``"int5+int8:qkv,lm_head+int4:gate_up"`` -> ``("int5", (("qkv", "int8"), ("lm_head",
    "int8"), ("gate_up", "int4")))``: a weight format plus (module-name fragment, format) pairs
    for the matrices that take another quantized format (build_model's ``kinds``); a plain name
    has none. ``"auto"`` -> ``("auto", ())`` (resolved per checkpoint by auto_recipe)."""
    if str(spec).lower() == AUTO:
        return AUTO, ()
    base, *parts = str(spec).split("+")
    if base.lower() not in _ALIASES:
        raise LongattnError(f"unknown weight format {base!r}; use {AUTO} or one of {', '.join(WEIGHT_FORMATS)}")
    fmt = parse_weights(base)
    kinds = []
    for part in parts:
        other, sep, frags = part.partition(":")
        if not sep or other.lower() not in _ALIASES or parse_weights(other) not in QUANTIZED or not frags:
            raise LongattnError(f"bad recipe part {part!r} in {spec!r}; write e.g. int4+int8:qkv,embed")
        kinds += [(f, parse_weights(other)) for f in frags.split(",") if f]
    if kinds and fmt not in QUANTIZED:
        raise LongattnError(f"only {', '.join(QUANTIZED)} recipes name formats per kind, got {spec!r}")
    return fmt, tuple(kinds)


def recipe_name(fmt: str, kinds: tuple = ()) -> str:
    """The canonical spelling of a recipe (``parse_recipe``'s inverse): the base format, then
    per other format (in QUANTIZED order) ``+<format>:<fragments>``, e.g.
    ``"int4+int8:qkv,gate_up"``; pairs naming the base format itself are dropped."""
    pairs = _kind_pairs(kinds) if fmt in QUANTIZED else ()
    out = fmt
    for other in QUANTIZED:
        frags = [k for k, f in pairs if f == other and other != fmt]
        if frags:
            out += f"+{other}:{','.join(frags)}"
    return out


def kind_format(name: str, fmt: str, kinds: tuple) -> str:
    """The format of the matrix named ``name`` under recipe (``fmt``, ``kinds``): that of the
    last pair whose fragment ``name`` contains, else ``fmt``."""
    out = fmt
    for frag, other in _kind_pairs(kinds):
        if frag in name:
            out = other
    return out


def int4_applies(w: torch.Tensor) -> bool:
    """A 2-D weight can be stored as int4 or int5: its row length is a whole number of groups."""
    return w.dim() == 2 and w.shape[1] % INT4_GROUP == 0


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes in groups of 32 along each row.

    ``w [N, K]`` float (K a multiple of 32) -> (codes ``[N, K/2]`` uint8, d ``[N, K/32]`` float16,
    m ``[N, K/32]`` float16): value ``k`` of group ``g`` is ``d * u + m`` with ``u`` in 0..15, held in
    byte ``k % 16`` of the group's 16 bytes (low nibble for k < 16, high nibble otherwise).
    The step and offset are rounded to float16 first and the codes chosen against the rounded
    values, so the error is at most half a step (plus the offset's rounding, clamped at 0 and 15).
    """
    return _quantize_groups(w, 4)


def quantize_int5(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 5-bit codes in groups of 32 along each row: quantize_int4's layout with u in
    0..31, its low 4 bits in ``codes`` and bit 4 in ``hbits``.

    ``w [N, K]`` -> (codes ``[N, K/2]`` uint8, hbits ``[N, K/8]`` uint8, d, m ``[N, K/32]``
    float16); bit ``k`` of a group's 4 hbits bytes (a little-endian 32-bit word) is bit 4 of its
    value ``k``, as in GGML's Q5_0 and Q5_1 blocks.
    """
    return _quantize_groups(w, 5)


def _quantize_groups(w: torch.Tensor, bits: int) -> tuple:
    N, K = w.shape
    if K % INT4_GROUP:
        raise LongattnError(f"int{bits} needs rows that are a multiple of {INT4_GROUP} values, got {K}")
    groups = (N, K // INT4_GROUP)
    fifth = (torch.empty(N, K // 8, dtype=torch.uint8),) if bits == 5 else ()
    return _by_rows(lambda part: _quantize_groups_whole(part, bits), w,
                    lambda: (torch.empty(N, K // 2, dtype=torch.uint8), *fifth,
                             torch.empty(groups, dtype=torch.float16), torch.empty(groups, dtype=torch.float16)))


def _quantize_groups_whole(w: torch.Tensor, bits: int) -> tuple:
    N, K = w.shape
    top = (1 << bits) - 1
    wg = w.float().reshape(N, K // INT4_GROUP, INT4_GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    if w.device.type != "meta" and bool((hi.abs() > 65504).any() or (lo.abs() > 65504).any()):
        raise LongattnError(f"int{bits} stores float16 steps: a weight exceeds float16's range; use int8")
    d = ((hi - lo) / top).half()
    m = lo.half()
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    u = torch.round((wg - m.float()[..., None]) / safe[..., None]).clamp_(0, top).to(torch.uint8)
    u = torch.where(df[..., None] > 0, u, torch.zeros_like(u))
    half = INT4_GROUP // 2
    low = u & 15
    codes = (low[..., :half] | (low[..., half:] << 4)).reshape(N, K // 2).contiguous()
    if bits == 4:
        return codes, d.contiguous(), m.contiguous()
    return codes, pack_fifth_bits(u >> 4), d.contiguous(), m.contiguous()


def pack_fifth_bits(b: torch.Tensor) -> torch.Tensor:
    """``b [N, G, 32]`` of 0s and 1s (bit 4 of each code) -> hbits ``[N, G*4]`` uint8: per group
    a little-endian 32-bit word whose bit k is ``b[..., k]``."""
    N, G, _ = b.shape
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (b.reshape(N, G, 4, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8).reshape(N, G * 4)


def int4_as_int5(codes, d, m) -> tuple:
    """int4 parts as the int5 parts of the same values (every fifth bit 0)."""
    return codes, torch.zeros(codes.shape[0], codes.shape[1] // 4, dtype=torch.uint8), d, m


def effective_state_dict(state_dict: dict, weights: str) -> dict:
    """The float32 weights a model built with ``weights`` really multiplies by.

    For ``int8`` every 2-D tensor is quantized and dequantized per row; ``int4`` and ``int5``
    do the same in groups (int8 for rows that are not a multiple of 32; values rounded to
    float32); bf16 rounds
    the 2-D tensors to bf16; f32 returns the dict unchanged. Build a float64 model from the result
    to get an exact reference for the quantized paths (int4 decode also rounds activations:
    against this reference an int4 model's error is that rounding's, see tests/conftest.py).
    """
    fmt = parse_weights(weights)
    out = {}
    for k, t in state_dict.items():
        if t.dim() != 2 or fmt == "f32":
            out[k] = t
        elif fmt == "bf16":
            out[k] = t.to(torch.bfloat16).float()
        elif fmt == "int4" and int4_applies(t):
            out[k] = dequantize_int4(*quantize_int4(t), dtype=torch.float64).float()
        elif fmt == "int5" and int4_applies(t):
            out[k] = dequantize_int5(*quantize_int5(t), dtype=torch.float64).float()
        else:
            out[k] = dequantize_int8(*quantize_int8(t))
    return out
