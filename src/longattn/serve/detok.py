"""Token ids -> text, one token at a time, at a bounded cost per token.

Decoding the whole output after every token costs O(n) per token. Instead, as in vLLM's
incremental detokenizer, two short runs are decoded: the held ids up to ``read`` (a few
tokens of context, their text already emitted) and all held ids; the new text is the
difference. Decoding from a few tokens back keeps tokenizers that strip a leading space or
merge byte pieces (SentencePiece, byte-level BPE) right, and text that ends in an incomplete
UTF-8 sequence (U+FFFD) is held back until the next token completes it.
"""

from __future__ import annotations


class IncrementalText:
    """``push(token_id) -> str``: the text that token settles (possibly empty). Holds the last
    ``CONTEXT`` ids and those not yet settled, however many were pushed."""

    # tokens of context decoded before the unread ones
    CONTEXT = 6

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list = []  # the context, then the ids not yet settled
        self.read = 0        # held ids before this have been turned into emitted text

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[:self.read])
        now = self._decode(self.ids)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        # only the context is decoded again: drop the ids before it (bounded memory however
        # long the output)
        del self.ids[:max(0, len(self.ids) - self.CONTEXT)]
        self.read = len(self.ids)
        return now[len(before):]
