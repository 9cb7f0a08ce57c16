"""A run's identity: what, beside its config, decides its numbers, recorded in ``run_info.json`` and checked
before ``fedllm compare`` reuses the run.

A comparison is evidence only if every row comes from the same code, data and arithmetic. The config alone
does not say that: a strategies table once resumed runs made before a fix to the tokenization (the version
string ``0.1.0`` had not moved), so 8 of its rows trained on other tokens than the rest. The identity
therefore names:

- ``source``: a digest of fedllm's own source files (``fedllm/``, ``data_prep/``, ``eval/``: every ``.py``
  and ``.json``) as the running process imports them, so an uncommitted edit counts and a change to the docs
  or tests does not; with the git commit (and whether the tracked files differ from it) for a reader;
- ``tokens``: the tokenized-data cache's version (``data_prep.tokenized.VERSION``);
- ``model`` / ``data`` / ``benchmark``: sha256 digests of the files a run reads (the base's weights and
  config, a data file, an MMLU file; built-in parts are covered by ``source``), hashed once per (path,
  size, modification time);
- ``precision``: the weights' dtype and the mixed precision used (``auto`` settled first);
- ``libraries``: torch, transformers, peft, accelerate, datasets and tokenizers versions.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("fedllm", "data_prep", "eval")
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "datasets", "tokenizers")
_SOURCE: dict[str, Any] = {}  # computed once per process


def _package_files() -> list[tuple[str, Path]]:
    out = []
    for name in PACKAGES:
        root = Path(importlib.import_module(name).__file__ or "").parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".json") and path.is_file() and "__pycache__" not in path.parts:
                out.append((f"{name}/{path.relative_to(root).as_posix()}", path))
    return out


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source() -> dict[str, Any]:
    """The digest of fedllm's source files as imported (see the module docstring), with the git commit and
    whether the checkout's tracked package files differ from it, where the source is a git checkout."""
    if not _SOURCE:
        h = hashlib.sha256()
        files = _package_files()
        for rel, path in files:
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
        top = Path(importlib.import_module("fedllm").__file__ or "").parent.parent
        commit = _git("rev-parse", "HEAD", cwd=top)
        _SOURCE.update({"digest": h.hexdigest()[:16], "files": len(files)})
        if commit:
            changed = _git("status", "--porcelain", "--untracked-files=no", "--", *PACKAGES, cwd=top)
            _SOURCE.update({"commit": commit[:12], "uncommitted_changes": bool(changed)})
    return dict(_SOURCE)


def _files_digest(paths: list[Path]) -> str:
    from fedllm.model.gguf import file_digest

    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + file_digest(path).encode())
    return h.hexdigest()[:16]


def model_digest(path: str) -> str:
    """A digest of a checkpoint folder's weights and config files (a Hub id: the id itself)."""
    folder = Path(path)
    if not folder.is_dir():
        return f"id:{path}"
    names = ("*.safetensors", "*.bin", "config.json", "tokenizer.json", "tokenizer_config.json")
    files = sorted({p for pattern in names for p in folder.glob(pattern) if p.is_file()})
    return _files_digest(files) if files else f"folder:{folder}"


def data_digest(dataset: str) -> str:
    """A digest of the data a run reads: the prepared ShareGPT file, a local file, a folder's files; the
    built-in data is built by the source (``source``'s digest covers it); a Hub id is named."""
    if dataset in ("builtin", "testbed"):
        return f"built-in:{dataset}"
    if dataset == "sharegpt":
        from data_prep import sharegpt

        return _files_digest([sharegpt.prepared_file()])
    from data_prep import natural_instructions as ni

    folder = ni.resolve(dataset)
    if folder is not None:
        return _files_digest(sorted(folder.glob(f"subtask*/{ni.TASK_FILE}")))
    path = Path(dataset).expanduser()
    if path.is_file():
        return _files_digest([path])
    return f"id:{dataset}"


def benchmark_digest(benchmark: str) -> str:
    """A digest of the benchmark file a run scores (a packaged one's too); built-in or none: named."""
    from eval.mmlu_data import resolve_source

    if benchmark in ("none", "auto", "builtin", "testbed"):
        return f"built-in:{benchmark}"
    path = Path(resolve_source(benchmark)).expanduser()
    return _files_digest([path]) if path.is_file() else f"id:{benchmark}"


def libraries() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def identity_inputs(cfg: Any) -> tuple[Any, ...]:
    """The config keys :func:`run_identity` reads (the base, its built-in pretraining, the data, the
    benchmark, the precision): two configs equal here have one identity, so a caller computes it once for
    them, and a grid over any of these keys gets one identity per point, not its first point's."""
    from fedllm.model.precision import resolve

    m = cfg.model
    return (m.name, m.builtin_pretrain_steps, cfg.data.dataset, cfg.eval.benchmark, m.dtype, resolve(cfg))


def run_identity(cfg: Any, model_path: str | None = None) -> dict[str, Any]:
    """What decides a run of ``cfg`` besides its config (the module docstring); ``model_path``: the base's
    resolved folder where the caller has it (else resolved here, converting a GGUF once)."""
    from data_prep.tokenized import VERSION
    from fedllm.model.modeling import resolve_model_path
    from fedllm.model.precision import resolve

    path = model_path or resolve_model_path(cfg.model.name, cfg.model.builtin_pretrain_steps)
    return {
        "source": source(),
        "tokens": VERSION,
        "model": model_digest(path),
        "data": data_digest(cfg.data.dataset),
        "benchmark": benchmark_digest(cfg.eval.benchmark),
        "precision": {"dtype": cfg.model.dtype, "mixed_precision": resolve(cfg)},
        "libraries": libraries(),
    }


def differences(have: dict[str, Any] | None, want: dict[str, Any]) -> list[str]:
    """The parts of two identities that differ, each as ``part there -> here`` (one short phrase each); a
    run without a recorded identity differs in every part."""
    if not have:
        return ["no identity recorded (a run made before fedllm recorded one)"]
    if have.get("mixed"):
        return [f"resumed with other code or data than started it ({'; '.join(have['mixed'])})"]
    out = []
    for part, value in want.items():
        old = have.get(part)
        if part == "source" and isinstance(old, dict):  # the digest decides; the commit is for a reader
            if old.get("digest") != value.get("digest"):
                there = f"{old.get('digest')} ({old.get('commit', 'no git')})"
                out.append(f"source {there} -> {value.get('digest')} ({value.get('commit', 'no git')})")
        elif part == "libraries" and isinstance(old, dict):
            out += [f"{k} {old.get(k)} -> {v}" for k, v in value.items() if old.get(k) != v]
        elif old != value:
            out.append(f"{part} {old} -> {value}")
    return out
