"""Files a run writes, written so that a crash or a kill never leaves half of one; below everything that
writes (the client store, the config's record of a run, the run folder, reproduce).

Every file goes to a temporary name in the same folder, is flushed and fsync'ed, then renamed over the
target: a crash or SIGKILL leaves either the old file or the new one. Files get the permissions any other
tool's output would (``0666 & ~umask``), not the ``0600`` of a temporary file; temporary names start with a
dot and end in ``.tmp``. :func:`io_cause` words an I/O error for a one-line message.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

_ROUND_DIR = re.compile(r"round-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; says where and why."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(path: Path, directory: bool = False) -> None:
    """Give a file made by mkstemp/mkdtemp (0600/0700) the permissions a plain open/mkdir would."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replaced_atomically(path: Path):
    """Yield a temporary sibling of ``path`` to write; on success fsync it, honour the umask and rename it
    over ``path``; on any failure remove it (nothing half-written is left)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        honour_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _replaced_atomically(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync (metrics.jsonl: a torn last line is skipped on read)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line.rstrip("\n") + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict]:
    """Lines of a jsonl file; a torn (unparsable) last line from a crash is ignored."""
    if not Path(path).exists():
        return []
    out = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise CheckpointError(f"{path}, line {i + 1}: not valid JSON") from None
    return out


def save_tensors_atomic(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    seen: set[int] = set()
    unique = {}
    for k, v in tensors.items():  # safetensors refuses tensors that share storage
        ptr = v.untyped_storage().data_ptr()
        unique[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
        seen.add(ptr)
    with _replaced_atomically(Path(path)) as tmp:
        save_file(unique, tmp, metadata=metadata)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def io_cause(e: BaseException) -> str:
    """The human part of an I/O error (safetensors wraps the OS message in a Rust debug string)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    m = re.search(r'I/O error: (.+?) \(os error \d+\)|message: "([^"]+)"', str(e))
    return (m.group(1) or m.group(2)) if m else str(e)


def checkpoint_round(path: Path) -> int | None:
    """The round of a ``round-NNNN`` folder (any number of digits), else None."""
    m = _ROUND_DIR.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def round_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint folders, oldest round first (by number: round-10000 is after
    round-9999).
    """
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.glob("round-*") if p.is_dir() and checkpoint_round(p) is not None]
    return sorted(found, key=checkpoint_round)
