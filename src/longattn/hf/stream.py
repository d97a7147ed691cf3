"""Score a long text through a transformers model in bounded memory (``longattn stream``'s loop)."""

from __future__ import annotations

from typing import Iterable, Union

import torch

from ..errors import LongattnError
from ..policy import AttentionPolicy
from ..lab.stream import StreamResult, stream_score as _stream_score
from .attention import attached


def stream_ids(tokenizer, text_iter: Iterable[str]) -> torch.Tensor:
    """Token ids ``[N]`` of the pieces of ``text_iter`` in order; special tokens (a BOS) only
    on the first piece, so the stream tokenizes as one text split at piece boundaries."""
    ids: list = []
    for n, piece in enumerate(text_iter):
        if not isinstance(piece, str):
            raise LongattnError(f"text_iter must yield strings, got {type(piece).__name__}")
        ids.extend(tokenizer(piece, add_special_tokens=(n == 0))["input_ids"])
    return torch.tensor(ids, dtype=torch.int64)


def stream_score(model, tokenizer, text_iter: Iterable[str], policy: Union[str, AttentionPolicy] = "sink",
                 chunk: int = 256, **kw) -> StreamResult:
    """bits/token of a text streamed through ``model`` under ``policy``, K/V memory bounded.

    Args:
        model: a transformers causal LM that ``longattn.hf.apply`` serves.
        tokenizer: ``tokenizer(text, add_special_tokens=...)["input_ids"]`` (any HF tokenizer).
        text_iter: the text, as strings in order (one string is fine).
        policy, **kw: as for ``apply`` (e.g. ``window=1024, sinks=4``).
        chunk: tokens per forward.
    Returns:
        longattn.lab.stream.StreamResult: positions 1..N-1 scored, each from everything the
        policy lets it read; cache bytes per chunk (constant once the rings are full).

    The token ids are held (8 bytes a token); the K/V cache is what stays bounded.
    """
    ids = stream_ids(tokenizer, text_iter)
    with attached(model, policy, **kw) as cache:
        def forward(x, cache, policy, logits):  # longattn's model signature over transformers'
            with torch.inference_mode():
                return model(input_ids=x, past_key_values=cache, use_cache=True).logits  # [1, t, V]
        return _stream_score(forward, ids, cache.policy, cache, chunk=chunk)
