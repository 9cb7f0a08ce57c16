"""Atomic writes and the run checkpoint (global state, server state, RNG, ledger).

Every file goes to a temporary name in the same folder, is flushed and
fsync'ed, then renamed over the target: a crash or SIGKILL leaves either the
old file or the new one, never half of one. A checkpoint is a folder
``round-NNNN`` written the same way (temporary folder, then rename), and
``latest`` names the last complete one. Its ``meta.json`` carries the SHA-256
of its tensor file, so a checkpoint whose bytes changed on disk is recognised
and passed over for the previous intact one instead of being trained from.

Files get the permissions any other tool's output would (``0666 & ~umask``),
not the ``0600`` of a temporary file. Temporary names start with a dot and end
in ``.tmp`` (files) or are ``.round-*`` / ``.export-*`` folders, so what a
killed process left behind can be found and removed (:func:`clean_temporaries`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2
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


def _cause(e: BaseException) -> str:
    """The human part of an I/O error (safetensors wraps the OS message in a Rust debug string)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    m = re.search(r'I/O error: (.+?) \(os error \d+\)|message: "([^"]+)"', str(e))
    return (m.group(1) or m.group(2)) if m else str(e)


def save_checkpoint(
    run_dir: Path, round_idx: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> Path:
    """Write ``checkpoints/round-NNNN`` atomically and point ``latest`` at it.

    The previous checkpoint is kept until the new one is complete, so a
    failure (no space, no permission, a kill) leaves it intact and nothing
    half-written behind; the error names the folder and the cause.
    """
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"round-{round_idx:04d}"
    tmp: Path | None = None
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".round-{round_idx:04d}.", dir=ckpt_root))
        save_tensors_atomic(tmp / "state.safetensors", tensors)
        digest = file_sha256(tmp / "state.safetensors")
        atomic_write_text(
            tmp / "meta.json", json.dumps({"format": CHECKPOINT_FORMAT, "sha256": digest, **meta}, indent=1)
        )
        honour_umask(tmp, directory=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        tmp = None
        _fsync_dir(ckpt_root)
        atomic_write_text(ckpt_root / "latest", final.name)
    except Exception as e:  # OSError, or safetensors' own error type for the same failures
        raise CheckpointError(f"could not write checkpoint {final}: {_cause(e)}") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest round checkpoints (``keep`` <= 0: keep all)."""
    if keep <= 0:
        return
    for old in round_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify one checkpoint folder; any problem is a CheckpointError naming the file."""
    path = Path(path)
    meta_path, state_path = path / "meta.json", path / "state.safetensors"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path} is not readable JSON ({_cause(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{path}: checkpoint format {fmt} was written by another fedllm version "
            f"(this one reads format {CHECKPOINT_FORMAT})"
        )
    try:
        digest = file_sha256(state_path)
    except OSError as e:
        raise CheckpointError(f"{state_path} cannot be read ({_cause(e)})") from None
    if digest != meta.get("sha256"):
        raise CheckpointError(
            f"{state_path} does not match the checksum in {meta_path.name}: the file was changed "
            "or damaged after it was written"
        )
    try:
        return load_file(str(state_path)), meta
    except Exception as e:  # safetensors raises its own error type for unparsable files
        raise CheckpointError(f"{state_path} is not a readable safetensors file ({_cause(e)})") from None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder that has a meta.json (not verified: see :func:`load_latest`)."""
    complete = [p for p in round_checkpoints(run_dir) if (p / "meta.json").exists()]
    return complete[-1] if complete else None


def load_latest(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies, newest first; a damaged one is skipped with a warning naming it.

    None when the run has no checkpoint at all; a CheckpointError naming the
    newest damaged file when checkpoints exist but none verifies.
    """
    candidates = [
        p
        for p in round_checkpoints(run_dir)
        if (p / "meta.json").exists() or (p / "state.safetensors").exists()
    ]
    first_error: CheckpointError | None = None
    for path in reversed(candidates):
        try:
            tensors, meta = load_checkpoint(path)
        except CheckpointError as e:
            first_error = first_error or e
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path, e)
            continue
        if first_error is not None:
            log.warning("using %s, the newest intact checkpoint", path)
        return path, tensors, meta
    if first_error is not None:
        raise CheckpointError(f"no intact checkpoint in {Path(run_dir) / 'checkpoints'}: {first_error}")
    return None


def clean_temporaries(folder: Path) -> list[Path]:
    """Remove what killed writers left anywhere in ``folder`` (``.*.tmp`` files, ``.round-*``/``.export-*``
    folders).
    """
    removed = []
    for root, dirs, files in os.walk(folder):
        for d in list(dirs):
            if d.startswith((".round-", ".export-")):
                shutil.rmtree(Path(root) / d, ignore_errors=True)
                removed.append(Path(root) / d)
                dirs.remove(d)
        for f in files:
            if f.startswith(".") and f.endswith(".tmp"):
                (Path(root) / f).unlink(missing_ok=True)
                removed.append(Path(root) / f)
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted process in %s", len(removed), folder)
    return removed


def client_state(tensors: dict[str, torch.Tensor], client_id: int) -> dict[str, torch.Tensor]:
    """One client's state from the tensors of a checkpoint written before client state moved to its own files
    (``client.<id>.<name>``; see ``fedllm/client/store.py``)."""
    prefix = f"client.{client_id}."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
