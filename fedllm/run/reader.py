"""The one reader of a run folder, beside its writer (``folder.py``'s :class:`~fedllm.run.folder.RunWriter`).

torchtune's checkpoint client owns both load and save; here the writer writes and :class:`RunFolder` reads:
the resolved config, the metrics rows, the summary, the version that made the run, a checkpoint at round
r, the global model at round r and a client's personalized model. Report, compare, the model card, export
and the CLI read through it and never open a run's files by name.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from torch import Tensor

from fedllm.factors import Adapter

CONFIG, ROWS, SUMMARY, INFO, PARTITION, GENERATIONS = (
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "run_info.json",
    "partition.json",
    "generations.jsonl",  # the Rouge-L evaluation's answers (eval.generate_size)
)
GENERAL_REFERENCE = "general_reference.json"  # the base's answers to eval.general_prompts


class RunReadError(ValueError):
    """A run folder cannot be read as asked; says what is missing."""


class RunFolder:
    """A run's folder, read (see module docstring). Reading never changes it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    # ------------------------------------------------------------------ what it holds
    def is_run(self) -> bool:
        return (self.path / CONFIG).is_file()

    def has_rows(self) -> bool:
        return (self.path / ROWS).exists()

    def is_finished(self) -> bool:
        return (self.path / SUMMARY).exists()

    def config(self, overrides: list[str] | None = None):
        """The run's resolved config (``config.yaml``), validated as any config is, with ``overrides``."""
        from fedllm.config import load_config

        if not self.is_run():
            raise RunReadError(f"{self.path} is not a fedllm run directory (no {CONFIG})")
        return load_config(self.path / CONFIG, overrides, written=True)

    @cached_property
    def raw_config(self) -> dict:
        """``config.yaml`` as plain YAML (for reports that group runs; no validation)."""
        import yaml

        path = self.path / CONFIG
        return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}

    def rows(self) -> list[dict]:
        """The ``metrics.jsonl`` rows, in order (a torn last line from a crash is skipped)."""
        from fedllm.files import read_jsonl

        return read_jsonl(self.path / ROWS)

    def evaluations(self) -> list[dict]:
        """The rows that hold an evaluation (held-out loss or benchmark accuracy)."""
        return [r for r in self.rows() if r.get("eval_loss") is not None or r.get("accuracy") is not None]

    def summary(self) -> dict[str, Any]:
        """``summary.json`` (empty when the run has not finished)."""
        path = self.path / SUMMARY
        return json.loads(path.read_text()) if path.exists() else {}

    def version(self) -> str | None:
        """The fedllm version that made the run (``run_info.json``), None when unknown."""
        path = self.path / INFO
        return json.loads(path.read_text()).get("fedllm_version") if path.exists() else None

    def identity(self) -> dict[str, Any] | None:
        """What made the run besides its config (``run_info.json``; ``fedllm.run.identity``), None when it
        was not recorded."""
        path = self.path / INFO
        return json.loads(path.read_text()).get("identity") if path.exists() else None

    def partition(self) -> list[dict]:
        path = self.path / PARTITION
        return json.loads(path.read_text()) if path.exists() else []

    def rounds_done(self) -> int:
        """The newest round with a checkpoint (0 when none)."""
        from fedllm.files import checkpoint_round
        from fedllm.run.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.path)
        return checkpoint_round(latest) if latest is not None else 0

    def kept_rounds(self) -> list[int]:
        from fedllm.files import checkpoint_round, round_checkpoints

        return [checkpoint_round(p) for p in round_checkpoints(self.path)]

    # ------------------------------------------------------------------ checkpoints and models
    def checkpoint(self, round_idx: int | None = None) -> tuple[Path, dict[str, Tensor], dict[str, Any]]:
        """The verified checkpoint of ``round_idx`` (default: the newest intact one)."""
        from fedllm.run import checkpoint as ckpt

        if round_idx is None:
            found = ckpt.load_latest(self.path)
            if found is None:
                raise RunReadError(f"{self.path}: no checkpoint yet (no round finished)")
            return found
        path = self.path / "checkpoints" / f"round-{round_idx:04d}"
        if round_idx < 1 or not (path / "meta.json").exists():
            raise RunReadError(
                f"{self.path}: no checkpoint for round {round_idx} (kept: rounds {self.kept_rounds()}; "
                "rounds "
                "start at 1 and only the newest output.keep_checkpoints are kept)"
            )
        return (path, *ckpt.load_checkpoint(path))

    def global_model(
        self, round_idx: int | None = None
    ) -> tuple[Adapter, dict[str, Tensor], dict[str, Tensor], int]:
        """The global model at ``round_idx`` (default: the newest): one adapter (the global adapter plus
        everything merged into the base), the dense modules, the LoRA biases, and the round."""
        from fedllm.aggregation import strategy_from_config
        from fedllm.factors import concat
        from fedllm.server import global_state

        path, tensors, meta = self.checkpoint(round_idx)
        state = global_state(tensors, meta)
        strategy = strategy_from_config(self.config().aggregation)
        adapter = concat(strategy.global_adapter(state), state.residual)
        if not adapter:
            raise RunReadError(
                f"{path}: the run has no global update at round {meta['round']} (every round so far was "
                "skipped): nothing to export"
            )
        return adapter, state.dense, strategy.global_biases(state), int(meta["round"])

    def client_model(self, client: int) -> tuple[Adapter, dict[str, Tensor], dict[str, Tensor]]:
        """Client ``client``'s personalized model after the newest checkpoint: the run rebuilt from its
        folder (same data split, same seed), the client's state read back, and its personalization (its
        algorithm's steps on its own data, or its strategy's own view: FLoRAL's router)."""
        import torch
        from accelerate import Accelerator

        from fedllm import assembly
        from fedllm.client.store import ClientStore

        cfg = self.config()
        if not 0 <= client < cfg.federation.num_clients:
            raise RunReadError(f"--client {client}: the run has clients 0..{cfg.federation.num_clients - 1}")
        fed = assembly.assemble(cfg, Accelerator(cpu=not torch.cuda.is_available()))
        store = ClientStore(self.path / "clients", writes=False)
        meta = assembly.restore(fed.server, fed.runtime, fed.clients, self.path, store)
        start = fed.server.client_start((meta["round"] if meta else 0) + 1, client)
        store.load(fed.clients[client])
        return fed.runtime.personalized_adapter(fed.clients[client], start)

    # ------------------------------------------------------------------ numbers for cards and reports
    def facts(self, round_idx: int | None = None) -> dict[str, Any]:
        """What a model card says of a round: its evaluation and the traffic up to it."""
        upto = round_idx if round_idx is not None else self.rounds_done()
        rows = [r for r in self.rows() if r["round"] <= upto]
        evals = [r for r in rows if r.get("eval_loss") is not None or r.get("accuracy") is not None]
        first, last = (evals[0], evals[-1]) if evals else ({}, {})
        comm = next((r["cumulative"] for r in reversed(rows) if "cumulative" in r), {})
        return {
            "round": upto,
            "eval_round": last.get("round"),
            "accuracy_before": first.get("accuracy"),
            "accuracy": last.get("accuracy"),
            "loss_before": first.get("eval_loss"),
            "loss": last.get("eval_loss"),
            "up_params": comm.get("total_up_params"),
            "down_params": comm.get("total_down_params"),
            "up_bytes": comm.get("total_up_bytes"),
            "down_bytes": comm.get("total_down_bytes"),
        }

    def client_facts(self, client: int) -> dict | None:
        """Client ``client``'s own held-out numbers from the newest evaluation that visited it (None: "
        "none)."""
        for row in reversed(self.rows()):
            mine = row.get("personal", {}).get(str(client))
            if mine:
                return {"round": row["round"], **mine}
        return None
