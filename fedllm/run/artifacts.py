"""What is made from a run folder: its exports, and its models for ``fedllm eval`` and ``fedllm generate``.

Reads through :class:`~fedllm.run.reader.RunFolder` and writes through ``fedllm/run/export.py``; the card
comes from ``fedllm/run/model_card.py``. The CLI and tests call these.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from fedllm.factors import Adapter
from fedllm.run.export import (
    ExportError,
    base_model_reference,
    check_export_target,
    write_export,
    write_peft_adapter,
)
from fedllm.run.model_card import card_text
from fedllm.run.reader import RunFolder, RunReadError


def run_model(
    folder: RunFolder, round_idx: int | None = None, client: int | None = None
) -> tuple[Adapter, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The run's global model at ``round_idx`` (default: the newest), or client ``client``'s personalized
    one (after the newest round)."""
    if client is not None and round_idx is not None:
        raise ExportError(
            "--client exports a client's personalization of the latest round: leave --round out"
        )
    try:
        if client is not None:
            return folder.client_model(client)
        return folder.global_model(round_idx)[:3]
    except RunReadError as e:
        raise ExportError(str(e)) from None


def export_run(
    run_dir: Path,
    out: Path,
    round_idx: int | None = None,
    merge: bool = False,
    client: int | None = None,
    overwrite: bool = False,
) -> Path:
    """``fedllm export``: a run's adapter folder (or merged model) with its model card; ``out`` is checked
    first (never the run itself, never a non-empty folder without ``overwrite``)."""
    check_export_target(run_dir, out, overwrite)
    folder = RunFolder(run_dir)
    try:
        cfg = folder.config()
    except RunReadError as e:
        raise ExportError(str(e)) from None
    model = run_model(folder, round_idx, client)
    card = card_text(folder, cfg, base_model_reference(cfg), merged=merge, client=client, round_idx=round_idx)
    return write_export(Path(out), model, cfg, card, merge=merge, overwrite=overwrite)


def load_for_eval(
    model: str | None,
    adapter: str | None,
    run: str | None,
    round_idx: int | None,
    client: int | None,
    dtype: str,
    device,
    quantization: str = "none",
    quant_type: str = "nf4",
):
    """A model for ``fedllm eval``: base, base + adapter, merged folder, or a run's global model.

    ``quantization`` (none, 4bit, 8bit) loads the base through bitsandbytes; with a run, its own
    quantization unless one is given.

    With ``run`` the base is the run's own (``model.name`` in its config.yaml);
    a different ``model`` is refused, since the run's adapter means nothing on
    another base. The run's adapter goes through a temporary folder that is
    removed once peft has read it.
    """
    from peft import PeftModel

    from fedllm.config import ModelConfig
    from fedllm.model.modeling import load_base

    if run is not None:
        folder = RunFolder(run)
        cfg = folder.config()
        if (
            model is not None
            and model != cfg.model.name
            and resolve_base(model, cfg) != base_model_reference(cfg)
        ):
            raise ExportError(
                f"--model {model} is not the base of run {run} ({cfg.model.name!r}, model.name in its "
                "config.yaml): leave --model out to evaluate the run on its own base"
            )
        adapter_, dense, biases = run_model(folder, round_idx, client)
        if quantization != "none":
            cfg.model.quantization, cfg.model.quant_type = quantization, quant_type
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
    base, tokenizer = load_base(
        ModelConfig(
            name=model or "builtin",
            dtype=dtype,
            quantization=quantization,
            quant_type=quant_type,
            quant_compute_dtype="float32" if quant_type == "fp4" else "auto",
        ),
        device,
    )
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
    from fedllm.model.gguf import is_gguf
    from fedllm.model.modeling import resolve_model_path

    return (
        resolve_model_path(model, cfg.model.builtin_pretrain_steps)
        if model in ("builtin", "builtin-testbed") or is_gguf(model)
        else str(Path(model).expanduser().resolve())
        if Path(model).expanduser().exists()
        else model
    )
