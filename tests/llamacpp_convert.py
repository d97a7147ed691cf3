"""Run llama.cpp's own ``convert_hf_to_gguf.py`` on tiny checkpoints (a helper the GGUF tests
start in a subprocess: ``python llamacpp_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf [HF_DIR OUT.gguf ...]``).

The tiny checkpoints have no tokenizer, so each converter class's ``set_vocab`` is replaced
by one that writes a placeholder vocabulary of ``vocab_size`` tokens; everything else (the
metadata and every tensor) is the converter's own work. (The Gemma 3 converter also cuts the
embedding to the tokenizer's size, read from ``tokenizer.json``: a copy of such a checkpoint
gets a placeholder ``tokenizer.json`` of ``vocab_size`` tokens, which cuts nothing.)
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path


def _with_tokenizer_size(src: str) -> str:
    """``src``, or a copy with a placeholder tokenizer.json where the converter reads one."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    if not cfg.get("model_type", "").startswith("gemma3") or (Path(src) / "tokenizer.json").exists():
        return src
    d = Path(tempfile.mkdtemp(prefix="llamacpp-src-")) / Path(src).name
    shutil.copytree(src, d)
    vocab = {f"<t{i}>": i for i in range(cfg["vocab_size"])}
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    return str(d)


def main() -> None:
    llama_dir, pairs = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, llama_dir)
    import convert_hf_to_gguf as convert

    def set_vocab(self):
        n = self.hparams["vocab_size"]
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
        self.gguf_writer.add_token_types([1] * n)
        self.gguf_writer.add_token_merges([])

    lookup = convert.get_model_class

    def get_model_class(*a, **k):
        cls = lookup(*a, **k)
        for klass in cls.__mro__:
            if "set_vocab" in klass.__dict__:
                klass.set_vocab = set_vocab
        return cls

    convert.get_model_class = get_model_class
    for src, out in zip(pairs[::2], pairs[1::2]):
        sys.argv = ["convert_hf_to_gguf.py", _with_tokenizer_size(src), "--outfile", out, "--outtype", "f32"]
        convert.main()


if __name__ == "__main__":
    main()
