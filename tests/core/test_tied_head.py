"""Tied or untied output head, decided as transformers decides it.

With ``tie_word_embeddings: true`` transformers ties ``lm_head.weight`` to the embedding unless
the checkpoint stores both with different values (then the stored head is used, untied); a
checkpoint that stores only the head has the embedding tied to it. Without the flag a missing
head is refused (transformers would start it from random values).
"""

import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_dir
from longattn.errors import LongattnError


def _dir(tmp_path, family, edit, tie=True) -> Path:
    """A copy of the tiny ``family`` checkpoint whose tensors ``edit(state_dict)`` changes."""
    from safetensors.torch import load_file, save_file
    d = tmp_path / family
    shutil.copytree(tiny_dir(family, tie_word_embeddings=tie), d)
    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _logits(d):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    ck = load_checkpoint(str(d), with_tokenizer=False)
    with torch.no_grad():
        return build_model(ck.config, ck.state_dict)(ids), hf(ids).logits, ck.config


def _other_head(sd):
    sd["lm_head.weight"] = torch.randn(sd["model.embed_tokens.weight"].shape,
                                       generator=torch.Generator().manual_seed(1)) * 0.3


def _head_only(sd):
    sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")


def _equal_head(sd):
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("edit, tied", [(_other_head, False), (_head_only, True), (_equal_head, True)],
                         ids=["other-head", "head-only", "equal-head"])
def test_head_tied_as_transformers_ties_it(tmp_path, family, edit, tied):
    ours, hf, cfg = _logits(_dir(tmp_path, family, edit))
    assert cfg.tie_embeddings == tied
    err = (ours - hf).abs().max().item()
    assert err < 1e-4, f"{family}: max |delta logit| {err:.2e}"
    if edit is _other_head:  # the stored head is what transformers uses: tying would change the logits
        tied_logits = _logits(tiny_dir(family, tie_word_embeddings=True))[1]
        assert (hf - tied_logits).abs().max().item() > 1e-2


def test_missing_untied_head_refused(tmp_path):
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = _dir(tmp_path, "llama", lambda sd: sd.pop("lm_head.weight"), tie=False)
    ck = load_checkpoint(str(d), with_tokenizer=False)
    with pytest.raises(LongattnError, match=r"missing \['lm_head.weight'\]"):
        build_model(ck.config, ck.state_dict)
