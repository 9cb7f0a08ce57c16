"""Export: peft adapter folders, merged models and their cards, the Hub push. It writes what it is given
(a run's models are read by ``fedllm/run/reader.py``; ``fedllm/run/artifacts.py`` composes the two).

The exported adapter is the *whole* global model on top of the original base:
the global adapter plus everything a strategy merged into the base (the
residual), concatenated into one LoRA (exact), compressed by an SVD only when
its rank exceeds the layer's dimensions (still exact). Fully trained modules
(``lora.trainable_modules``) go in as peft ``modules_to_save``. The folder is
written by hand in peft's own format so that no live model has to be
re-wrapped, and it loads with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from fedllm.factors import PEFT_PREFIX, Adapter, compact, concat, pad_rank
from fedllm.files import atomic_write_text, honour_umask, save_tensors_atomic

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An export cannot be made; says what is missing."""


def write_peft_adapter(
    path: Path,
    adapter: Adapter,
    dense: dict[str, torch.Tensor],
    base_model: str,
    target_modules: list[str],
    modules_to_save: list[str],
    biases: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (scale 1: lora_alpha = r).

    ``biases`` (FLoRAL's mixed bias adaptors) become peft's ``lora_B`` biases (``lora_bias``).
    """
    from peft import LoraConfig

    adapter = compact(adapter)
    rank = max(f.rank for f in adapter.values())
    tensors = {}
    for key, f in adapter.items():
        g = pad_rank(f, rank)
        tensors[f"{PEFT_PREFIX}{key}.lora_A.weight"] = g.A.contiguous()
        tensors[f"{PEFT_PREFIX}{key}.lora_B.weight"] = g.B.contiguous()
        if biases:
            tensors[f"{PEFT_PREFIX}{key}.lora_B.bias"] = biases[key].contiguous()
    for key, t in dense.items():
        tensors[f"{PEFT_PREFIX}{key}"] = t.contiguous()
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=sorted(target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        modules_to_save=sorted(modules_to_save) or None,
        lora_bias=bool(biases),
    )
    path.mkdir(parents=True, exist_ok=True)
    save_tensors_atomic(path / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
    atomic_write_text(path / "adapter_config.json", json.dumps(config.to_dict(), indent=2, default=list))


def base_model_reference(cfg) -> str:
    """What ``base_model_name_or_path`` should say: the Hub id, path, or built-in cache path."""
    from fedllm.model.modeling import resolve_model_path

    return resolve_model_path(cfg.model.name, cfg.model.builtin_pretrain_steps)


def save_global_adapter(server, cfg, path: Path) -> None:
    """The run's global model (``Server.global_adapter()`` plus everything merged) as a peft adapter
    folder.
    """
    adapter, dense, biases = server.global_adapter()
    adapter = concat(adapter, server.state.residual)
    if not adapter:
        log.warning("no global update to export (no round completed)")
        return
    write_peft_adapter(
        path,
        adapter,
        dense,
        base_model_reference(cfg),
        cfg.lora.target_modules,
        cfg.lora.trainable_modules,
        biases,
    )


def check_export_target(run_dir: Path, out: Path, overwrite: bool) -> None:
    """Refuse an ``--output`` that would destroy the run or a user's files (see ``fedllm export --help``)."""
    from fedllm.run.folder import RUN_ENTRIES, check_writable_folder

    run, target = Path(run_dir).resolve(), Path(out).resolve()
    if target == run or run.is_relative_to(target):
        raise ExportError(
            f"--output {out} would replace the run directory {run_dir} itself: choose another folder"
        )
    if target.is_relative_to(run) and target.relative_to(run).parts[0] in RUN_ENTRIES:
        raise ExportError(
            f"--output {out} is inside the run's own files ({target.relative_to(run).parts[0]}): "
            "choose another folder"
        )
    try:
        check_writable_folder(target, "--output")
    except ValueError as e:
        raise ExportError(str(e)) from None
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ExportError(
            f"--output {out} is not empty: pass --overwrite to replace it, or choose another folder"
        )


def write_export(
    out: Path,
    model: tuple[Adapter, dict[str, torch.Tensor], dict[str, torch.Tensor]],
    cfg,
    card: str,
    merge: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (adapter, dense modules, LoRA biases) as a peft adapter folder, or as a merged model,
    with ``card`` as its ``README.md``: everything it writes is given to it.

    Written into a temporary sibling of ``out`` and renamed into place, so a failed export leaves ``out``
    as it was; an existing ``out`` is replaced only with ``overwrite`` (the caller checks the target with
    :func:`check_export_target` first).
    """
    adapter, dense, biases = model
    if merge and biases:
        raise ExportError(
            "--merge cannot fold FLoRAL's bias adaptors into a base whose layers have no bias: export "
            "the adapter (without --merge)"
        )
    base = base_model_reference(cfg)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".export-{out.name}-", dir=out.parent))
    old: Path | None = None
    try:
        write_peft_adapter(
            tmp, adapter, dense, base, cfg.lora.target_modules, cfg.lora.trainable_modules, biases
        )
        if merge:
            merged_dir = Path(tempfile.mkdtemp(prefix=f".export-{out.name}-", dir=out.parent))
            _merge(base, tmp, merged_dir, cfg)
            shutil.rmtree(tmp)
            tmp = merged_dir
        else:
            _save_tokenizer(base, tmp)
        atomic_write_text(tmp / "README.md", card)
        for path in tmp.rglob("*"):  # every file as a plain open would make it (a colleague can read it)
            honour_umask(path, directory=path.is_dir())
        honour_umask(tmp, directory=True)
        if out.exists():  # only with overwrite (checked before): swap, then remove the old export
            old = Path(tempfile.mkdtemp(prefix=f".export-{out.name}-", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old / out.name, out)  # put the previous export back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _base_tokenizer(base: str):
    """The base's tokenizer as the run used it: with its family's turn format where the checkpoint has no
    chat template (``fedllm.model.modeling.load_base`` gives Gemma 3's its own), so the export chats as it
    was trained to."""
    from transformers import AutoConfig, AutoTokenizer

    from data_prep.prompts import TURN_FORMATS

    tokenizer = AutoTokenizer.from_pretrained(base)
    if not getattr(tokenizer, "chat_template", None):
        turns = TURN_FORMATS.get(getattr(AutoConfig.from_pretrained(base), "model_type", ""))
        if turns is not None:
            tokenizer.chat_template = turns
    return tokenizer


def _save_tokenizer(base: str, out: Path) -> None:
    """The base's tokenizer beside the adapter, so ``AutoTokenizer.from_pretrained(export)`` works."""
    try:
        _base_tokenizer(base).save_pretrained(out)
    except (OSError, ValueError) as e:
        log.warning("export: the base's tokenizer (%s) could not be saved beside the adapter: %s", base, e)


def _merge(base: str, adapter_dir: Path, out: Path, cfg) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, use_kernels=False)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out)
    _base_tokenizer(base).save_pretrained(out)
    if getattr(merged, "generation_config", None) is not None:
        merged.generation_config.save_pretrained(out)


def push_to_hub(folder: Path, repo_id: str, private: bool = False) -> str:
    """Create the repo and upload the folder; the token comes from the environment or login only.

    Failures (offline, no token, no permission, a bad repo id) become one
    ExportError line; the export on disk is kept either way.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message="Upload fedllm export"
        )
    except OfflineModeIsEnabled:
        raise ExportError(
            f"--push-to-hub {repo_id}: HF_HUB_OFFLINE=1 is set; the export is in {folder}: push it "
            f"later with `hf upload {repo_id} {folder}`"
        ) from None
    except Exception as e:  # HTTP errors, the HTTP client's own network errors, bad ids: all one line here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(
            f"--push-to-hub {repo_id} failed ({first}); the export is in {folder}: push it later with "
            f"`hf upload {repo_id} {folder}`"
        ) from None
    return repo_id


__all__ = ["check_export_target", "push_to_hub", "save_global_adapter", "write_export", "write_peft_adapter"]
