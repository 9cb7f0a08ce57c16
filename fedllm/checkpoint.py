"""Atomic writes and the run checkpoint (global state, server state, RNG, ledger).

Every file goes to a temporary name in the same folder, is flushed and
fsync'ed, then renamed over the target: a crash or SIGKILL leaves either the
old file or the new one, never half of one. A checkpoint is a folder
``round-NNNN`` written the same way (temporary folder, then rename), and
``latest`` names the last complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fedllm.factors import Adapter, LoraFactors

CHECKPOINT_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; says where."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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


def adapter_tensors(adapter: Adapter, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    tensors, scales = {}, {}
    for key, f in adapter.items():
        tensors[f"{prefix}{key}.A"] = f.A.contiguous()
        tensors[f"{prefix}{key}.B"] = f.B.contiguous()
        scales[f"{prefix}{key}"] = f.scale
    return tensors, scales


def adapter_from_tensors(tensors: dict[str, torch.Tensor], scales: dict[str, float], prefix: str) -> Adapter:
    out = {}
    for name, scale in scales.items():
        if name.startswith(prefix):
            key = name[len(prefix):]
            out[key] = LoraFactors(tensors[f"{name}.A"], tensors[f"{name}.B"], float(scale))
    return out


def save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        seen: set[int] = set()
        unique = {}
        for k, v in tensors.items():  # safetensors refuses tensors that share storage
            ptr = v.untyped_storage().data_ptr()
            unique[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(unique, tmp, metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: Path, round_idx: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``checkpoints/round-NNNN`` atomically and point ``latest`` at it.

    The previous checkpoint is kept until the new one is complete, so a
    failure (no space, no permission, a kill) leaves it intact; the error names
    the folder that could not be written.
    """
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"round-{round_idx:04d}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".round-{round_idx:04d}.", dir=ckpt_root))
        save_tensors_atomic(tmp / "state.safetensors", tensors)
        atomic_write_text(tmp / "meta.json", json.dumps({"format": CHECKPOINT_FORMAT, **meta}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        atomic_write_text(ckpt_root / "latest", final.name)
    except OSError as e:
        shutil.rmtree(locals().get("tmp", final.with_suffix(".none")), ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {e.strerror or e}") from e
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` round checkpoints."""
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("round-*"))
    for old in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / "meta.json").exists():
            return path
    complete = [p for p in sorted(root.glob("round-*")) if (p / "meta.json").exists()]
    return complete[-1] if complete else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    meta = json.loads((Path(path) / "meta.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format')} was written by another fedllm version "
            f"(this one reads format {CHECKPOINT_FORMAT})"
        )
    return load_file(str(Path(path) / "state.safetensors")), meta
