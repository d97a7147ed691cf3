"""Weight formats for the projection matrices: f32, bf16, int8 (per output channel) and int4
(groups of 32), and ``auto`` (the default), which picks int4 or int8 for each kind of matrix
from what the checkpoint stores (auto_recipe).

``int8`` stores every 2-D weight (projections, embedding table, output head) as int8 rows with
one float32 scale per row (symmetric, scale = max|row| / 127). Decode-sized matmuls (< WIDEN_ROWS
rows) run longattn's AVX2 kernel on float32 activations (ops/linear.py picks it; PyTorch's
``aten._weight_int8pack_mm`` on bf16 activations where it cannot run): a step reads a quarter of
the float32 bytes. Prefill-sized matmuls dequantize the weight to float32 once per
call (this CPU has no fast int8 or bf16 GEMM for many rows; see WIDEN_ROWS in ops/linear.py).

Per-row quantization commutes with concatenating rows, so the fused q/k/v and gate/up matrices
hold exactly the values that quantizing each part would give: ``effective_state_dict`` uses that
to build the float reference model that tests compare the int8 paths against.

``int4`` stores every 2-D weight whose row length is a multiple of 32 as 4-bit codes in groups
of 32 along the row, each group with a float16 step and a float16 offset (``d * u + m``,
u in 0..15; 20 bytes per 32 weights). Decode-sized matmuls run longattn's kernel
(ops/csrc/int4_gemv.cpp), which quantizes the activations to int8 per block of 32 once per call
and takes exact integer dots; ``int4_matmul`` evaluates the same arithmetic in PyTorch where the
kernel cannot run. Prefill-sized matmuls dequantize the weight
to float32 and keep float32 activations. A matrix whose rows are not a multiple of 32 stays int8.
(Not PyTorch's own ``_weight_int4pack_mm_for_cpu``, which does not beat bf16 on CPU, nor a
float-activation 4-bit kernel, which is bound by its conversions.)
"""

from __future__ import annotations

import torch

from ..errors import LongattnError
from ..ops.linear import INT4_GROUP, dequantize_int4, dequantize_int8

WEIGHT_FORMATS = ("f32", "bf16", "int8", "int4")
# names accepted on the command line and in the API (the --dtype spellings included)
_ALIASES = {"f32": "f32", "float32": "f32", "fp32": "f32", "bf16": "bf16", "bfloat16": "bf16",
            "int8": "int8", "q8": "int8", "int4": "int4", "q4": "int4"}


def parse_weights(name: str) -> str:
    """Canonical weight-format name (``f32``, ``bf16``, ``int8`` or ``int4``); one-line error otherwise."""
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

# Module-name fragments (build_model's keep_int8) and the checkpoint matrices each one is made
# of (the last part of their module name; q/k/v and gate/up are fused).
_KINDS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down_proj": ("down_proj",), "embed": ("embed_tokens",), "lm_head": ("lm_head",)}


def auto_recipe(matrices, stored_int4) -> str:
    """The recipe ``auto`` stands for: int4 for each kind of matrix (``_KINDS``) that the
    checkpoint stores entirely as 4-bit groups int4 holds exactly (``stored_int4``, names as in
    ``matrices``: checkpoint.gguf_file.read_int4_blocks), int8 for every other one.

    int4 then costs nothing against the checkpoint's weights (its decode rounds activations to
    int8 per block of 32, as llama.cpp does), and int8 costs <= 0.004 bits/token on the bundled
    models (benchmarks/weights_quality.py). A checkpoint with a matrix outside ``_KINDS`` (an
    expert router, say) gets plain int8.
    """
    part_of = {part: kind for kind, parts in _KINDS.items() for part in parts}
    kinds = {n: part_of.get(n.rsplit(".", 2)[-2] if n.endswith(".weight") else "") for n in matrices}
    if None in kinds.values():
        return "int8"
    present = set(kinds.values())
    int4 = present - {kinds[n] for n in matrices if n not in stored_int4}
    if not int4:
        return "int8"
    return recipe_name("int4", tuple(k for k in _KINDS if k in present - int4))


def parse_recipe(spec: str) -> tuple[str, tuple]:
    """``"int4+int8:qkv,gate_up"`` -> ``("int4", ("qkv", "gate_up"))``: a weight format plus the
    module-name fragments kept in int8 (build_model's ``keep_int8``); a plain name has none.
    ``"auto"`` -> ``("auto", ())`` (resolved per checkpoint by auto_recipe)."""
    if str(spec).lower() == AUTO:
        return AUTO, ()
    fmt, _, keep = str(spec).partition("+int8:")
    if fmt.lower() not in _ALIASES:
        raise LongattnError(f"unknown weight format {fmt!r}; use {AUTO} or one of {', '.join(WEIGHT_FORMATS)}")
    fmt = parse_weights(fmt)
    frags = tuple(f for f in keep.split(",") if f)
    if frags and fmt != "int4":
        raise LongattnError(f"only int4 can keep matrices in int8, got {spec!r}")
    return fmt, frags


def recipe_name(fmt: str, keep_int8: tuple = ()) -> str:
    """The canonical spelling of a recipe (``parse_recipe``'s inverse): ``"int4+int8:qkv,gate_up"``,
    or the plain format when nothing is kept in int8 (only int4 keeps any)."""
    keep = tuple(keep_int8) if fmt == "int4" else ()
    return fmt + (f"+int8:{','.join(keep)}" if keep else "")


def int4_applies(w: torch.Tensor) -> bool:
    """A 2-D weight can be stored as int4: its row length is a whole number of groups."""
    return w.dim() == 2 and w.shape[1] % INT4_GROUP == 0


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes in groups of 32 along each row.

    ``w [N, K]`` float (K a multiple of 32) -> (codes ``[N, K/2]`` uint8, d ``[N, K/32]`` float16,
    m ``[N, K/32]`` float16): value ``k`` of group ``g`` is ``d * u + m`` with ``u`` in 0..15, held in
    byte ``k % 16`` of the group's 16 bytes (low nibble for k < 16, high nibble otherwise).
    The step and offset are rounded to float16 first and the codes chosen against the rounded
    values, so the error is at most half a step (plus the offset's rounding, clamped at 0 and 15).
    """
    N, K = w.shape
    if K % INT4_GROUP:
        raise LongattnError(f"int4 needs rows that are a multiple of {INT4_GROUP} values, got {K}")
    groups = (N, K // INT4_GROUP)
    return _by_rows(_quantize_int4, w, lambda: (torch.empty(N, K // 2, dtype=torch.uint8),
                                                torch.empty(groups, dtype=torch.float16),
                                                torch.empty(groups, dtype=torch.float16)))


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K = w.shape
    wg = w.float().reshape(N, K // INT4_GROUP, INT4_GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    if w.device.type != "meta" and bool((hi.abs() > 65504).any() or (lo.abs() > 65504).any()):
        raise LongattnError("int4 stores float16 steps: a weight exceeds float16's range; use int8")
    d = ((hi - lo) / 15).half()
    m = lo.half()
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    u = torch.round((wg - m.float()[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    u = torch.where(df[..., None] > 0, u, torch.zeros_like(u))
    half = INT4_GROUP // 2
    codes = (u[..., :half] | (u[..., half:] << 4)).reshape(N, K // 2)
    return codes.contiguous(), d.contiguous(), m.contiguous()


def effective_state_dict(state_dict: dict, weights: str) -> dict:
    """The float32 weights a model built with ``weights`` really multiplies by.

    For ``int8`` every 2-D tensor is quantized and dequantized per row; ``int4`` does the same in
    groups (int8 for rows that are not a multiple of 32; values rounded to float32); bf16 rounds
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
        else:
            out[k] = dequantize_int8(*quantize_int8(t))
    return out
