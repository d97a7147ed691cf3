"""Chat messages -> prompt token ids through the checkpoint's own chat template."""

from __future__ import annotations

from .errors import LongattnError


def chat_ids(tok, messages: list, add_generation_prompt: bool = True) -> list:
    """``messages`` ([{"role": ..., "content": str}, ...]) rendered by ``tok``'s chat template
    and tokenized; a checkpoint without a template is refused."""
    if not getattr(tok, "chat_template", None):
        raise LongattnError("this checkpoint has no chat template")
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
