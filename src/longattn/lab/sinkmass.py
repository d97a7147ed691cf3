"""Attention sinks: how much attention each layer and head puts on the first token(s).

The attention probabilities are rebuilt explicitly: a forward pre-hook on every layer's
``self_attn`` captures its input (after the input norm) and positions; from them q and k
are recomputed with the layer's own projections, q/k norms and RoPE, and
``softmax(q k^T * scale)`` (Gemma's softcap when set) is taken under the mask the policy
gives that layer (``allowed_mask``: causal, the layer's window, its sinks). The mass of a
query on the first ``first`` keys is averaged over the queries at positions
``>= from_position`` (queries at position < first read nothing but sinks, mass 1).
Under a window a query more than W-1 past the first tokens cannot read them: its mass is 0
there unless they are sinks.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import LongattnError
from ..models.rope import apply_rope
from ..ops.masks import allowed_mask
from ..policy import AttentionPolicy


def attention_probs(attn, x: torch.Tensor, pos: torch.Tensor, window=None, sinks: int = 0) -> torch.Tensor:
    """Probabilities ``[B, H, T, T]`` (float64) of one ``Attention`` module on its input ``x [B, T, hidden]``."""
    B, T, _ = x.shape
    if attn.sinks is not None:
        raise LongattnError("sink mass is measured over cached tokens; this model's learned sink logits "
                            "(gpt-oss) take a share of each softmax that no token holds")
    H, Hkv, D = attn.H, attn.Hkv, attn.D
    q, k, _ = attn.project_qkv(x)  # [B, T, H, D], [B, T, Hkv, D]
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, Hkv, T, D]
    cos, sin = attn.rope(pos)
    q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
    k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
    k = k.repeat_interleave(H // Hkv, dim=1)  # [B, H, T, D]: query head h reads key head h // rep
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * attn.scale  # [B, H, T, T]
    if attn.softcap:
        s = attn.softcap * torch.tanh(s / attn.softcap)
    mask = allowed_mask(pos, pos, window, sinks)  # [B, 1, T, T]
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


def sink_mass(model, ids: torch.Tensor, policy=None, first: int = 1, from_position: Optional[int] = None) -> dict:
    """Mean attention mass on keys ``0..first-1`` per layer and head.

    Args:
        model: a Transformer.
        ids: ``[T]`` token ids (one passage).
        policy: AttentionPolicy (default: the checkpoint's windows).
        first: how many leading keys count as "the first tokens".
        from_position: average over queries at positions >= this (default ``first``).
    Returns:
        dict with ``mass`` ``[L][H]`` floats in [0, 1], ``per_layer`` means, settings.
    """
    cfg = model.config
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(1, -1)
    T = ids.shape[1]
    if first < 1:
        raise LongattnError("--first must be >= 1")
    start = first if from_position is None else from_position
    if not 0 <= start < T:
        raise LongattnError(f"no query at positions >= {start} in a {T}-token input")
    if policy is None:
        policy = AttentionPolicy.from_config(cfg)
    captured: dict = {}
    hooks = []
    for i, block in enumerate(model.model.layers):
        def hook(mod, args, i=i):
            captured[i] = (args[0].detach(), args[1].detach())  # x [B, T, hidden], pos [B, T]
        hooks.append(block.self_attn.register_forward_pre_hook(hook))
    try:
        model(ids, policy=policy, logits="none")
    finally:
        for h in hooks:
            h.remove()
    mass = []
    for i, block in enumerate(model.model.layers):
        x, pos = captured[i]
        lp = policy.layers[i]
        p = attention_probs(block.self_attn, x, pos, lp.window, lp.sinks)  # [1, H, T, T]
        m = p[0, :, start:, :first].sum(-1).mean(-1)  # [H]
        mass.append([float(v) for v in m])
    return {"experiment": "sinks", "model": cfg.name, "tokens": T, "first": first, "from_position": start,
            "windows": list(policy.windows), "sinks": [lp.sinks for lp in policy.layers],
            "mass": mass, "per_layer": [sum(r) / len(r) for r in mass],
            "mean": sum(sum(r) for r in mass) / sum(len(r) for r in mass)}


def plot_sinks(result: dict, path) -> None:
    """Heatmap layer x head of the mass on the first token(s)."""
    from .plots import new_figure, save_figure
    m = result["mass"]
    fig, ax = new_figure(width=max(4.5, 0.45 * len(m[0]) + 3), height=max(4.0, 0.22 * len(m) + 1.5))
    im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="upper")
    fig.colorbar(im, ax=ax, label=f"mean attention on the first {result['first']} token(s)")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(len(m[0])))
    for i, w in enumerate(result["windows"]):
        if w is not None:
            ax.text(len(m[0]) - 0.5, i, f" W{w}", va="center", fontsize=6)
    ax.set_title(f"{result['model']}: {result['tokens']} tokens, queries >= {result['from_position']}",
                 fontsize=9)
    save_figure(fig, path)
