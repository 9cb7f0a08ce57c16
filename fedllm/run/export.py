"""Export: peft adapter folders, merged models, model cards, Hub push; loading for eval.

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

from fedllm.factors import PEFT_PREFIX, Adapter, concat
from fedllm.lowrank import compact, pad_rank
from fedllm.run.checkpoint import atomic_write_text, honour_umask, save_tensors_atomic
from fedllm.run.model_card import write_model_card

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


def run_config(run_dir: Path):
    from fedllm.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ExportError(f"{run_dir} is not a fedllm run directory (no config.yaml)")
    return load_config(path)


def adapter_from_run(
    run_dir: Path, round_idx: int | None = None
) -> tuple[Adapter, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Global adapter (+ residual), dense modules and LoRA biases of a run's round (latest if None)."""
    from fedllm.aggregation import strategy_from_config
    from fedllm.run import checkpoint as ckpt
    from fedllm.server import global_state

    run_dir = Path(run_dir)
    have = [ckpt.checkpoint_round(p) for p in ckpt.round_checkpoints(run_dir)]
    if round_idx is None:
        found = ckpt.load_latest(run_dir)
        if found is None:
            raise ExportError(f"{run_dir}: no checkpoint yet (no round finished)")
        path, tensors, meta = found
    else:
        path = run_dir / "checkpoints" / f"round-{round_idx:04d}"
        if round_idx < 1 or not (path / "meta.json").exists():
            raise ExportError(
                f"{run_dir}: no checkpoint for round {round_idx} (kept: rounds {have}; rounds start at "
                "1 and only the newest output.keep_checkpoints are kept)"
            )
        tensors, meta = ckpt.load_checkpoint(path)
    cfg = run_config(run_dir)
    state = global_state(tensors, meta)
    strategy = strategy_from_config(cfg.aggregation)
    adapter = concat(strategy.global_adapter(state), state.residual)
    if not adapter:
        raise ExportError(
            f"{path}: the run has no global update at round {meta['round']} (every round so far was "
            "skipped): nothing to export"
        )
    return adapter, state.dense, strategy.global_biases(state)


def personalized_adapter(
    run_dir: Path, client: int
) -> tuple[Adapter, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A client's personalized model: the global model plus its algorithm's personalization steps.

    The run is rebuilt from its directory (same data split, same seed) and the
    client's k personalization steps (``client.personalize_steps``) are taken
    on its own training data, as in the run's personalized evaluation.
    """
    from accelerate import Accelerator

    from fedllm import assembly

    cfg = run_config(run_dir)
    if not 0 <= client < cfg.federation.num_clients:
        raise ExportError(f"--client {client}: the run has clients 0..{cfg.federation.num_clients - 1}")
    from fedllm.client.store import ClientStore

    fed = assembly.assemble(cfg, Accelerator(cpu=not torch.cuda.is_available()))
    store = ClientStore(Path(run_dir) / "clients", writes=False)
    meta = assembly.restore(fed.server, fed.runtime, fed.clients, Path(run_dir), store)
    start = fed.server.client_start((meta["round"] if meta else 0) + 1, client)
    store.load(fed.clients[client])
    return fed.runtime.personalized_adapter(fed.clients[client], start)


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


def export_run(
    run_dir: Path,
    out: Path,
    round_idx: int | None = None,
    merge: bool = False,
    client: int | None = None,
    overwrite: bool = False,
) -> Path:
    """``fedllm export``: adapter folder (or merged model) + model card.

    Written into a temporary sibling of ``out`` and renamed into place, so a
    failed export leaves ``out`` as it was; an existing ``out`` is replaced
    only with ``overwrite`` and never when it is (or holds) the run itself.
    """
    check_export_target(run_dir, out, overwrite)
    cfg = run_config(run_dir)
    if client is not None and round_idx is not None:
        raise ExportError(
            "--client exports a client's personalization of the latest round: leave --round out"
        )
    adapter, dense, biases = (
        personalized_adapter(run_dir, client) if client is not None else adapter_from_run(run_dir, round_idx)
    )
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
        write_model_card(tmp, run_dir, cfg, base, merged=merge, client=client, round_idx=round_idx)
        honour_umask(tmp, directory=True)
        if out.exists():  # only with overwrite (checked above): swap, then remove the old export
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


def _merge(base: str, adapter_dir: Path, out: Path, cfg) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
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


def load_for_eval(
    model: str | None,
    adapter: str | None,
    run: str | None,
    round_idx: int | None,
    client: int | None,
    dtype: str,
    device,
):
    """A model for ``fedllm eval``: base, base + adapter, merged folder, or a run's global model.

    With ``run`` the base is the run's own (``model.name`` in its config.yaml);
    a different ``model`` is refused, since the run's adapter means nothing on
    another base. The run's adapter goes through a temporary folder that is
    removed once peft has read it.
    """
    from peft import PeftModel

    from fedllm.config import ModelConfig
    from fedllm.model.modeling import load_base

    if run is not None:
        cfg = run_config(Path(run))
        if (
            model is not None
            and model != cfg.model.name
            and resolve_base(model, cfg) != base_model_reference(cfg)
        ):
            raise ExportError(
                f"--model {model} is not the base of run {run} ({cfg.model.name!r}, model.name in its "
                "config.yaml): leave --model out to evaluate the run on its own base"
            )
        adapter_, dense, biases = (
            personalized_adapter(Path(run), client)
            if client is not None
            else adapter_from_run(Path(run), round_idx)
        )
        base, tokenizer = run_base(cfg, dtype, device)
        with tempfile.TemporaryDirectory(prefix="fedllm-eval-") as tmp:
            write_peft_adapter(
                Path(tmp),
                adapter_,
                dense,
                base_model_reference(cfg),
                cfg.lora.target_modules,
                cfg.lora.trainable_modules,
                biases,
            )
            base = PeftModel.from_pretrained(base, tmp).to(device)
        return base.eval(), tokenizer
    if adapter is not None and not (Path(adapter) / "adapter_config.json").exists():
        raise ExportError(f"--adapter {adapter}: no adapter_config.json there")
    base, tokenizer = load_base(ModelConfig(name=model or "builtin", dtype=dtype), device)
    if adapter is not None:
        base = PeftModel.from_pretrained(base, adapter).to(device).eval()
    return base, tokenizer


def run_base(cfg, dtype: str, device):
    """A run's own base model and tokenizer in ``dtype``, from its whole model config (the built-in base
    with the run's pretraining steps, its quantization), never a default of the same name."""
    from fedllm.model.modeling import load_base

    cfg.model.dtype = dtype
    return load_base(cfg.model, device)


def resolve_base(model: str, cfg) -> str:
    """What ``--model`` names, resolved the way the run's base was (the built-in base by its cache path)."""
    from fedllm.model.modeling import resolve_model_path

    return (
        resolve_model_path(model, cfg.model.builtin_pretrain_steps)
        if model == "builtin"
        else str(Path(model).expanduser().resolve())
        if Path(model).expanduser().exists()
        else model
    )


__all__ = ["export_run", "load_for_eval", "push_to_hub", "save_global_adapter", "write_peft_adapter"]
