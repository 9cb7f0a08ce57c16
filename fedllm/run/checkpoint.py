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

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fedllm.files import (
    CheckpointError,
    _fsync_dir,
    atomic_write_text,
    file_sha256,
    honour_umask,
    io_cause,
    round_checkpoints,
    save_tensors_atomic,
)

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2


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
        raise CheckpointError(f"could not write checkpoint {final}: {io_cause(e)}") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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
        raise CheckpointError(f"{meta_path} is not readable JSON ({io_cause(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{path}: checkpoint format {fmt} was written by another fedllm version "
            f"(this one reads format {CHECKPOINT_FORMAT})"
        )
    try:
        digest = file_sha256(state_path)
    except OSError as e:
        raise CheckpointError(f"{state_path} cannot be read ({io_cause(e)})") from None
    if digest != meta.get("sha256"):
        raise CheckpointError(
            f"{state_path} does not match the checksum in {meta_path.name}: the file was changed "
            "or damaged after it was written"
        )
    try:
        return load_file(str(state_path)), meta
    except Exception as e:  # safetensors raises its own error type for unparsable files
        raise CheckpointError(f"{state_path} is not a readable safetensors file ({io_cause(e)})") from None


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
