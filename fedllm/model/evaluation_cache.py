"""The base model's evaluation, computed once and reused (``eval.reuse_base``).

Every run evaluates its global model before round 1, and at that point the
global model is the base itself (peft's B starts at zero; nothing is merged).
A comparison's variants share the base, the data and the held-out sample of a
seed, so that evaluation is the same for all of them: on the real run it is a
minute and a half of held-out loss, MMLU and generated answers, paid once per
variant and seed. Here it is paid once per seed and read back after.

The key is everything the numbers depend on, taken from the inputs themselves
rather than from config keys that make them: the model's files (names, sizes,
modification times of the resolved checkpoint folder), its dtype and
quantization settings, the held-out examples' tokens, the benchmark's
questions and shots, the generation's prompts, references and lengths, the
evaluation batch size, the mixed precision, the thread count, the device, the
evaluation code's own files and the versions of fedllm, torch and transformers.
A change to any of them is another key. A
model named by a Hub id rather than a local folder has no files to read here,
so its evaluation is never reused. Entries are JSON files in
``$FEDLLM_CACHE/evals``, written atomically; a damaged one is recomputed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# the code that computes the evaluation: a change to any of these files is another key (fedllm's version
# string does not move with every fix)
_EVALUATION_CODE = (
    "eval.mmlu",
    "eval.scoring",
    "eval.rouge",
    "eval.general",
    "data_prep.prompts",
    "fedllm.model.evaluation",
    "fedllm.model.generate",
    "fedllm.model.loss",
)


def _code_digest() -> str:
    import importlib.util

    h = hashlib.sha256()
    for name in _EVALUATION_CODE:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"the evaluation cache cannot find module {name}'s file")
        h.update(name.encode())
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()


def _device() -> dict[str, Any]:
    """Where the evaluation runs: the kernels, and so the last digits, differ between devices."""
    import torch

    if not torch.cuda.is_available():
        return {"type": "cpu", "capability": torch.backends.cpu.get_cpu_capability()}
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def cache_folder() -> Path:
    """``$FEDLLM_CACHE/evals`` (default ``~/.cache/fedllm/evals``)."""
    from fedllm.model.builtin_base import default_cache_dir

    return default_cache_dir() / "evals"


def _plain(obj: Any) -> Any:
    """``obj`` as JSON values, element by element: a sequence that is not a list (the held-out rows read on
    demand from the token cache) by its items, never by its ``repr``, which names no content."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"the evaluation cache cannot key on a {type(obj).__name__}: say what it holds")


def model_files(path: str) -> list[tuple[str, int, int]] | None:
    """The resolved model folder's files as (relative name, size, mtime in ns); None for a name that is not a
    local folder (a Hub id: nothing here says which revision it resolves to)."""
    root = Path(path)
    if not root.is_dir():
        return None
    out = []
    for f in sorted(root.rglob("*")):
        if f.is_file():
            st = f.stat()
            out.append((str(f.relative_to(root)), st.st_size, st.st_mtime_ns))
    return out


def base_key(
    model_path: str,
    model_settings: dict[str, Any],
    eval_data: list[Any],
    benchmark: Any,
    generation: Any,
    batch_size: int,
    mixed_precision: str,
) -> str | None:
    """The key of the base's evaluation under these inputs (None: not reusable, see the module docstring)."""
    import torch
    import transformers

    from fedllm import __version__

    files = model_files(model_path)
    if files is None:
        return None
    text = json.dumps(
        {
            "model": files,
            "model_settings": model_settings,
            "eval_data": _plain(eval_data),
            "benchmark": _plain(benchmark),
            "generation": _plain(generation),
            "batch_size": batch_size,
            "mixed_precision": mixed_precision,
            "threads": torch.get_num_threads(),
            "device": _device(),
            "code": _code_digest(),
            "versions": [__version__, torch.__version__, transformers.__version__],
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load(key: str) -> dict[str, Any] | None:
    """A stored evaluation, or None (absent, or unreadable: then it is recomputed and rewritten)."""
    path = cache_folder() / f"{key}.json"
    try:
        out = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("the stored base evaluation %s cannot be read (%s): evaluating again", path, e)
        return None
    return out if isinstance(out, dict) else None


def store(key: str, out: dict[str, Any]) -> None:
    """Keep ``out`` (the evaluation, with its answers) under ``key``."""
    from fedllm.files import atomic_write_text

    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{key}.json", json.dumps(out))


def reused(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored evaluation as this run's row has it: its numbers and answers, not its timings."""
    out = {k: v for k, v in stored.items() if not k.startswith("time_")}
    out["eval_reused"] = True
    return out
