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
import yaml

from fedllm.aggregation._linalg import compact, pad_rank
from fedllm.checkpoint import atomic_write_text, save_tensors_atomic
from fedllm.factors import PEFT_PREFIX, Adapter, concat

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """An export cannot be made; says what is missing."""


def write_peft_adapter(path: Path, adapter: Adapter, dense: dict[str, torch.Tensor], base_model: str,
                       target_modules: list[str], modules_to_save: list[str]) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (scale 1: lora_alpha = r)."""
    from peft import LoraConfig

    adapter = compact(adapter)
    rank = max(f.rank for f in adapter.values())
    tensors = {}
    for key, f in adapter.items():
        g = pad_rank(f, rank)
        tensors[f"{PEFT_PREFIX}{key}.lora_A.weight"] = g.A.contiguous()
        tensors[f"{PEFT_PREFIX}{key}.lora_B.weight"] = g.B.contiguous()
    for key, t in dense.items():
        tensors[f"{PEFT_PREFIX}{key}"] = t.contiguous()
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model,
                        modules_to_save=sorted(modules_to_save) or None)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors_atomic(path / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
    atomic_write_text(path / "adapter_config.json", json.dumps(config.to_dict(), indent=2, default=list))


def base_model_reference(cfg) -> str:
    """What ``base_model_name_or_path`` should say: the Hub id, path, or built-in cache path."""
    from fedllm.modeling import resolve_model_path

    return resolve_model_path(cfg.model.name, cfg.model.builtin_pretrain_steps)


def save_global_adapter(fed, path: Path) -> None:
    """The run's global model as a peft adapter folder (see module docstring)."""
    adapter = concat(fed.strategy.global_adapter(fed.state), fed.state.residual)
    if not adapter:
        log.warning("no global update to export (no round completed)")
        return
    dense = {k: v for k, v in fed.state.dense.items()}
    write_peft_adapter(path, adapter, dense, base_model_reference(fed.cfg), fed.cfg.lora.target_modules,
                       fed.cfg.lora.trainable_modules)


def run_config(run_dir: Path):
    from fedllm.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ExportError(f"{run_dir} is not a fedllm run directory (no config.yaml)")
    return load_config(path)


def adapter_from_run(run_dir: Path, round_idx: int | None = None) -> tuple[Adapter, dict[str, torch.Tensor]]:
    """Global adapter (+ residual) and dense modules of a run's round (latest if None)."""
    from fedllm import checkpoint as ckpt
    from fedllm.aggregation import STRATEGIES, GlobalState

    run_dir = Path(run_dir)
    path = ckpt.latest_checkpoint(run_dir) if round_idx is None else run_dir / "checkpoints" / f"round-{round_idx:04d}"
    if path is None or not (path / "meta.json").exists():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("round-*"))
        raise ExportError(f"{run_dir}: no checkpoint for round {round_idx if round_idx else 'latest'} (have {have})")
    tensors, meta = ckpt.load_checkpoint(path)
    state = GlobalState(ckpt.adapter_from_tensors(tensors, meta["scales"], "global."),
                        ckpt.adapter_from_tensors(tensors, meta["scales"], "residual."))
    strategy = STRATEGIES[meta["strategy"]]()
    dense = {k[len("dense."):]: v for k, v in tensors.items() if k.startswith("dense.")}
    return concat(strategy.global_adapter(state), state.residual), dense


def personalized_adapter(run_dir: Path, client: int) -> tuple[Adapter, dict[str, torch.Tensor]]:
    """A client's personalized model: the global model plus its algorithm's personalization steps.

    The run is rebuilt from its directory (same data split, same seed) and the
    client's k personalization steps (``client.personalize_steps``) are taken
    on its own training data, as in the run's personalized evaluation.
    """
    from fedllm.client.base import batch_stream
    from fedllm.factors import read_dense, read_factors
    from fedllm.federation import Federation
    from fedllm.modeling import adapter_name

    cfg = run_config(run_dir)
    if not 0 <= client < cfg.federation.num_clients:
        raise ExportError(f"--client {client}: the run has clients 0..{cfg.federation.num_clients - 1}")
    fed = Federation(cfg, Path(run_dir))
    fed.setup()
    fed.restore()
    c = fed.clients[client]
    params, _, _ = fed.load_client(c, fed.start_round)
    fed.model.eval()
    session = fed.open_mixture(c, own_router=True)
    if session is not None:  # FLoRAL: bake the client's router into its stacked adaptors
        mine = session.bake(read_factors(fed.model, adapter_name(c.rank)))
        session.close()
    else:
        plan = fed.plan_for(c, fed.start_round)
        batches = batch_stream(c.train, plan.batch_size, fed.tokenizer.pad_token_id, plan.seed + 1)
        fed.algorithm.personalize(fed.model, params, batches, cfg.client.personalize_steps, plan, fed.acc)
        mine = read_factors(fed.model, adapter_name(c.rank))
    return concat(mine, fed.state.residual), read_dense(fed.model, fed.dense_names)


def export_run(run_dir: Path, out: Path, round_idx: int | None = None, merge: bool = False,
               client: int | None = None) -> Path:
    """``fedllm export``: adapter folder (or merged model) + model card."""
    cfg = run_config(run_dir)
    if client is not None:
        adapter, dense = personalized_adapter(run_dir, client)
    else:
        adapter, dense = adapter_from_run(run_dir, round_idx)
    base = base_model_reference(cfg)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=Path(out).parent if Path(out).parent.exists() else None))
    try:
        write_peft_adapter(tmp, adapter, dense, base, cfg.lora.target_modules, cfg.lora.trainable_modules)
        if merge:
            merged_dir = Path(tempfile.mkdtemp(prefix=".merged-", dir=tmp.parent))
            _merge(base, tmp, merged_dir, cfg)
            shutil.rmtree(tmp)
            tmp = merged_dir
        write_model_card(tmp, run_dir, cfg, base, merged=merge, client=client)
        if Path(out).exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out)


def _merge(base: str, adapter_dir: Path, out: Path, cfg) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    if getattr(merged, "generation_config", None) is not None:
        merged.generation_config.save_pretrained(out)


def write_model_card(folder: Path, run_dir: Path, cfg, base: str, merged: bool, client: int | None = None) -> None:
    """README.md with YAML metadata (base_model, library_name, tags, metrics) for the Hub."""
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    base_id = "builtin-tiny-llama" if cfg.model.name == "builtin" else cfg.model.name
    meta = {
        "base_model": base_id,
        "library_name": "transformers" if merged else "peft",
        "license": "apache-2.0",
        "datasets": [cfg.data.dataset],
        "tags": ["federated-learning", "lora", "fedllm", cfg.aggregation.name, cfg.client.algorithm],
    }
    if summary.get("accuracy_after") is not None:
        meta["model-index"] = [{
            "name": f"fedllm-{cfg.aggregation.name}",
            "results": [{
                "task": {"type": "multiple-choice", "name": "MMLU-format benchmark"},
                "dataset": {"type": cfg.eval.benchmark, "name": cfg.eval.benchmark},
                "metrics": [{"type": "accuracy", "value": round(summary["accuracy_after"], 4)}],
            }],
        }]
    comm = summary.get("communication", {})
    body = [
        f"# fedllm {cfg.aggregation.name} adapter",
        "",
        f"Federated fine-tuning of `{base_id}` with **{cfg.aggregation.name}** aggregation and "
        f"**{cfg.client.algorithm}** clients: {cfg.federation.num_clients} clients, {cfg.federation.rounds} rounds, "
        f"LoRA ranks {summary.get('ranks', cfg.lora.ranks)}."
        + (f" Personalized for client {client}." if client is not None else ""),
        "",
        "| metric | value |",
        "|---|---|",
        f"| accuracy before | {summary.get('accuracy_before')} |",
        f"| accuracy after | {summary.get('accuracy_after')} |",
        f"| held-out loss after | {summary.get('loss_after')} |",
        f"| total upload (params) | {comm.get('total_up_params')} |",
        f"| total download (params) | {comm.get('total_down_params')} |",
    ]
    text = "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(body) + "\n"
    atomic_write_text(folder / "README.md", text)


def push_to_hub(folder: Path, repo_id: str, private: bool = False) -> str:
    """Create the repo and upload the folder; the token comes from the environment or login only."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message="Upload fedllm export")
    return repo_id


def load_for_eval(model: str, adapter: str | None, run: str | None, round_idx: int | None, client: int | None,
                  dtype: str, device):
    """A model for ``fedllm eval``: base, base + adapter, merged folder, or a run's global model."""
    from peft import PeftModel

    from fedllm.config import ModelConfig
    from fedllm.modeling import load_base

    if run is not None:
        cfg = run_config(Path(run))
        model_cfg = cfg.model
        model_cfg.dtype = dtype
        tmp = Path(tempfile.mkdtemp(prefix="fedllm-eval-"))
        sub = personalized_adapter(Path(run), client) if client is not None else adapter_from_run(Path(run), round_idx)
        write_peft_adapter(tmp, *sub, base_model_reference(cfg), cfg.lora.target_modules,
                           cfg.lora.trainable_modules)
        adapter = str(tmp)
    else:
        model_cfg = ModelConfig(name=model, dtype=dtype)
        if adapter is not None and not (Path(adapter) / "adapter_config.json").exists():
            raise ExportError(f"--adapter {adapter}: no adapter_config.json there")
    base, tokenizer = load_base(model_cfg, device)
    if adapter is not None:
        base = PeftModel.from_pretrained(base, adapter).to(device)
        base.eval()
    return base, tokenizer


__all__ = ["export_run", "load_for_eval", "push_to_hub", "save_global_adapter", "write_peft_adapter"]
