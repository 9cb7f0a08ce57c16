"""The round loop every driver shares: plan, train, finish, merge, evaluate, log, checkpoint.

A round is ``server.plan_round`` -> each active client trained from its
ClientStart (:meth:`RoundLoop.train_clients`: the in-process simulation's
runtime, or the Flower sites) -> ``server.finish_round`` -> the merged update
applied to the evaluation base -> evaluation -> one metrics row and a
checkpoint. Flower's ``Strategy.start`` is the model: the loop is written once
here and a driver fills in where clients train (:meth:`train_clients`), how
their personalized models are scored (:meth:`personalized`) and what it must
build first (:meth:`setup`). Tests and benchmarks run this same loop
(:meth:`run_round`, a subclass's ``train_clients``) instead of copying it, and ``fedllm reproduce``'s
small-model federations run :func:`one_round`, the round this loop runs.
"""

from __future__ import annotations

import abc
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eval.general import GeneralCheck
from eval.mmlu import Benchmark
from fedllm import assembly
from fedllm.client.runtime import ClientData, ClientRuntime
from fedllm.client.store import ClientStore
from fedllm.config import Config, ConfigError, flat_config, settle_clip
from fedllm.logs import set_names_clients
from fedllm.model import precision
from fedllm.model.evaluation import Generation
from fedllm.protocol import SummedUpdates, derive_seed
from fedllm.run.evaluations import RunEvaluator
from fedllm.run.export import save_global_adapter
from fedllm.run.folder import RunWriter
from fedllm.server import RoundPlan, RoundReport, Server
from fedllm.server.ledger import FLOWERTUNE_BUDGET_MIB, MIB

log = logging.getLogger(__name__)


@dataclass
class Round:
    """What :meth:`RoundLoop.run_round` returns: the round's metrics row (evaluation comes after) and the
    server's report of it (the update merged into the base, if any)."""

    row: dict[str, Any]
    report: RoundReport
    plan: RoundPlan


def one_round(
    server: Server,
    round_idx: int,
    train_clients: Callable[[RoundPlan], dict[int, Any] | SummedUpdates],
    merge: Callable[[int, Any], None] | None = None,
) -> Round:
    """One round up to the merged base (no evaluation), each phase timed in the row: the server's plan, the
    clients' training (``train_clients``: a driver's, or a reproduction's module runtime), the server's
    acceptance and aggregation, and ``merge(round, update)`` of what the strategy merges into the base.
    The one place a round is run: :meth:`RoundLoop.run_round` and ``fedllm reproduce`` call it."""
    t0 = time.perf_counter()
    plan = server.plan_round(round_idx)
    t1 = time.perf_counter()
    results = train_clients(plan)
    t2 = time.perf_counter()
    report = server.finish_round(plan, results)
    t3 = time.perf_counter()
    if report.merged:
        if merge is None:
            raise RuntimeError(f"round {round_idx}: the strategy merges into the base, and nothing keeps one")
        merge(round_idx, report.merged)
    times = {
        "time_plan_s": t1 - t0,
        "time_train_s": t2 - t1,
        "time_server_s": t3 - t2,  # acceptance, clipping and aggregation (time_aggregate_s: the last)
        "time_merge_s": time.perf_counter() - t3,
    }
    return Round({**report.row, **times}, report, plan)


class RoundLoop(abc.ABC):
    """The loop (see module docstring); subclasses say where clients train.

    After :meth:`setup` a driver has ``server``, ``runtime`` (the base the
    global model is evaluated on; in the simulation also where the clients
    train), ``eval_data``, ``benchmark`` and ``partition_stats`` (written to
    ``partition.json``).
    """

    server: Server
    runtime: ClientRuntime
    eval_data: list
    benchmark: Benchmark | None
    partition_stats: list[dict]
    generation: Generation | None = None  # held-out Rouge-L (eval.generate_size), when configured
    general: GeneralCheck | None = None  # eval.general_prompts, scored against the base's answers
    _evaluator: RunEvaluator | None = None

    # whether this driver can gather a round another way than update by update (a feature's
    # ``train_exchange``: secure aggregation's sum, on Flower only)
    runs_exchanges: bool = False
    # whether the clients are other organizations (Flower's sites) rather than this job's own: what
    # ``aggregation.clip_norm_ratio: auto`` settles on (no clip within one trust domain)
    clients_are_organizations: bool = False

    def __init__(self, cfg: Config, run_dir: Path, accelerator=None):
        from accelerate import Accelerator

        self.cfg, self.run_dir = cfg, Path(run_dir)
        clip = settle_clip(cfg, self.clients_are_organizations)  # recorded in config.yaml as used
        if clip > 0:
            log.info(
                "aggregation.clip_norm_ratio = %g: each update's change is clipped to that multiple of the "
                "round's median (a robustness step no strategy's paper has)",
                clip,
            )
        self.exchange = assembly.train_exchange(cfg)
        if self.exchange is not None and not self.runs_exchanges:
            raise ConfigError(
                f"{self.exchange.option} runs on Flower only (scripts/run_flower_local.sh, "
                f"scripts/run_flower_simulation.sh, or flwr run .); {type(self).__name__} gathers each "
                "update as it is"
            )
        # the launch decides the device, the process group, DeepSpeed and mixed precision
        launch = precision.accelerator_kwargs(cfg)  # model.mixed_precision, or the launch's
        self.acc = accelerator or Accelerator(
            log_with=cfg.output.log_with or None, project_dir=str(run_dir), **launch
        )
        precision.warn_where_emulated(self.acc)
        self.start_round, self.wall_before = 1, 0.0
        self.restored: dict | None = None  # the checkpoint a resume continues from
        self.store: ClientStore | None = None  # simulated clients' state on disk (a site keeps its own)
        # callbacks (phase, seconds) after each timed phase, e.g. a benchmark's (scripts/bench_scale.py)
        self.on_phase: list[Callable[[str, float], None]] = []
        self.t_start = time.perf_counter()
        self.writer = RunWriter(
            self.run_dir,
            enabled=self.acc.is_main_process,
            keep_checkpoints=cfg.output.keep_checkpoints,
            save_every_round=cfg.output.save_every_round,
            tracker=self.acc.log if cfg.output.log_with else None,
        )

    @property
    def strategy(self):
        return self.server.strategy

    @property
    def layout(self):
        return self.runtime.layout

    def warn_other_identity(self) -> None:
        """A resumed run continues with the code, data and libraries of this process: say so where they are
        not those that started it (``fedllm compare`` refuses such a run; a user resuming by hand decides)."""
        from fedllm.run.identity import differences, run_identity
        from fedllm.run.reader import RunFolder

        if not self.acc.is_main_process:
            return
        differ = differences(RunFolder(self.run_dir).identity(), run_identity(self.cfg))
        if differ:
            log.warning(
                "resuming %s with other code or data than started it (%s): its rounds will not all come "
                "from one version",
                self.run_dir,
                "; ".join(differ),
            )
            self.writer.mark_mixed(differ)  # fedllm compare never takes such a run for either version

    # ----------------------------------------------- what a driver fills in
    @abc.abstractmethod
    def setup(self) -> None:
        """Build the pieces (``fedllm.assembly``); bad input fails before the model loads."""

    @abc.abstractmethod
    def train_clients(self, plan: RoundPlan) -> dict[int, Any] | SummedUpdates:
        """Each active client's update (or why it failed), trained from ``plan.starts``; or, under a feature's
        exchange (secure aggregation), the round's sum."""

    @abc.abstractmethod
    def personalized(self, round_idx: int, clients: list[int]) -> dict[str, Any]:
        """The metrics row's personalized part after ``round_idx``, on ``clients`` (see
        :func:`personal_summary`)."""

    def personal_clients(self, sampled: list[int]) -> list[int]:
        """Whom personalized evaluation visits: the round's sampled clients (``eval.personalized_clients =
        0``), or the same seeded subset of N clients every time; visiting all 1,000 clients every evaluation
        round would cost far more than the round's training. A sample that is not public is never named
        by whom the evaluation visits: a fixed seeded subset of as many clients stands in for it."""
        n = self.cfg.eval.personalized_clients
        if n <= 0 and self.server.sampling.public:
            return sorted(sampled)
        n = n if n > 0 else len(sampled)
        everyone = sorted(self.server.clients)
        if n >= len(everyone):
            return everyone
        return sorted(random.Random(derive_seed(self.cfg.federation.seed, 13)).sample(everyone, n))

    def personal_scope(self) -> str:
        """What the summary says personalized evaluation covered."""
        n = self.cfg.eval.personalized_clients
        if n <= 0 and self.server.sampling.public:
            return "each evaluation round's sampled clients"
        if n <= 0:
            return "a fixed seeded subset as large as a round's sample (the sample itself is not public)"
        return f"a fixed seeded subset of {min(n, len(self.server.clients))} clients"

    def local_clients(self) -> list[ClientData]:
        """The clients whose state this driver holds and checkpoints (the simulation's; a site keeps
        its own).
        """
        return []

    # ------------------------------------------------------------- a round
    def bars_disabled(self) -> bool | None:
        """tqdm's ``disable``: bars on the main process's terminal only (None: tqdm checks for a TTY)."""
        return None if self.acc.is_main_process else True

    def phase_done(self, phase: str, seconds: float) -> None:
        for callback in self.on_phase:
            callback(phase, seconds)

    def elapsed(self) -> float:
        """Seconds this run has spent so far: this attempt's, plus what its checkpoint recorded. What a killed
        attempt did after its last checkpoint is not counted, except an evaluation the resume does again (the
        row pending at that checkpoint); nor is a finished run's final evaluation when a resume adds rounds
        (the checkpoint precedes it)."""
        return self.wall_before + time.perf_counter() - self.t_start

    def run_round(self, round_idx: int) -> Round:
        """One round up to the merged base (no evaluation), each phase timed (:func:`one_round`)."""
        return one_round(self.server, round_idx, self.train_clients, self.runtime.merge)

    @property
    def evaluator(self) -> RunEvaluator:
        """What this run's evaluations read (``fedllm/run/evaluations.py``), once the setup has set it."""
        if self._evaluator is None:
            self._evaluator = RunEvaluator(
                self.cfg,
                self.runtime,
                self.acc,
                self.writer,
                self.eval_data,
                self.benchmark,
                self.generation,
                self.general,
            )
        return self._evaluator

    def evaluate(self, round_idx: int, visit: list[int] | None = None) -> dict[str, Any]:
        """The global model's evaluation after ``round_idx`` (0: the base, reused where it was evaluated
        before); a strategy without a global model (local-only) has each of ``visit``'s own models scored
        instead (:attr:`Strategy.scored_per_client`)."""
        if round_idx > 0 and visit and self.server.strategy.scored_per_client:
            own = {cid: self.server.client_model(cid) for cid in visit}
            return self.evaluator.of_clients(round_idx, own)
        return self.evaluator.of_global(round_idx, self.server.global_adapter())

    # -------------------------------------------------------- checkpointing
    def evaluate_and_log(self, row: dict[str, Any], visit: list[int]) -> None:
        """Evaluate the model of ``row``'s round (when the schedule says so) and log the row."""
        r = row["round"]
        if r % self.cfg.eval.every == 0 or r == self.cfg.federation.rounds:
            row.update(self.evaluate(r, visit))  # its time_eval_s with it
            if self.cfg.eval.personalized:
                log.info(
                    "round %d: evaluating %d clients' personalized models on their own data", r, len(visit)
                )
                t0 = time.perf_counter()
                row.update(self.personalized(r, visit))
                row["time_personal_s"] = time.perf_counter() - t0
        self.writer.log(row)

    def checkpoint(self, round_idx: int, pending: dict | None = None) -> None:
        """The server's state after ``round_idx`` (and the round's row, to finish it after a crash)."""
        t0 = time.perf_counter()
        tensors, meta = self.server.state_dict()
        if self.store is not None:  # the index of each client's state file, not the states themselves
            meta.update(self.store.meta())
        meta.update(
            {
                "seed": self.cfg.federation.seed,
                "rng": "derived from (seed, round, client)",
                "wall_s": self.elapsed(),
                **({"pending": pending} if pending is not None else {}),
            }
        )
        self.writer.checkpoint(round_idx, tensors, meta)
        if self.store is not None and self.acc.is_main_process:
            self.store.prune(self.run_dir)
        self.phase_done("checkpoint", time.perf_counter() - t0)

    def restore(self) -> None:
        """Continue after the newest intact checkpoint of the run directory (a damaged newer one is passed
        over)."""
        meta = assembly.restore(self.server, self.runtime, self.local_clients(), self.run_dir, self.store)
        self.restored = meta
        if meta is None:
            log.info("no checkpoint in %s: starting from round 1", self.run_dir)
            return
        self.start_round = meta["round"] + 1
        self.wall_before = meta.get("wall_s", 0.0)
        log.info("resuming %s after round %d", self.run_dir, meta["round"])

    # ------------------------------------------------------------------ run
    def run(self, resume: bool = False) -> dict:
        """Every round from the first not yet done, evaluated, checkpointed and logged; the summary. A round's
        clients are named in the log only when the sample is public (``fedllm.logs.client_label``)."""
        before = set_names_clients(self.server.sampling.public)
        try:
            return self._run(resume)
        finally:
            set_names_clients(before)

    def _run(self, resume: bool) -> dict:
        cfg = self.cfg
        if cfg.output.log_with:
            self.acc.init_trackers("fedllm", config=tracker_config(cfg))
        rows: list[dict] = []
        # this attempt's clock starts before a resume finishes a checkpointed round's row, so that evaluation
        # counts in wall_s (checkpoint's wall_s + this attempt's time, every attempt counted once)
        self.t_start = time.perf_counter()
        if resume:
            self.warn_other_identity()
            self.restore()
            rows = self.writer.keep_rows_before(self.start_round)
            pending = (self.restored or {}).get("pending")
            if pending and pending["row"]["round"] > max((r["round"] for r in rows), default=-1):
                # the run stopped after this round's checkpoint, before its row: finish that row now
                self.evaluate_and_log(pending["row"], pending["visit"])
                rows.append(pending["row"])
        else:
            self.writer.start(cfg, self.partition_stats)
        if not rows:  # the evaluation before round 1 (kept from the first attempt when there was one)
            row = {"round": 0, **self.evaluate(0)}
            self.writer.log(row)
            log.info(
                "before round 1: eval loss %s, accuracy %s%s",
                _fmt(row.get("eval_loss")),
                _fmt(row.get("accuracy")),
                _rouge(row),
            )
        for r in tqdm(
            range(self.start_round, cfg.federation.rounds + 1), desc="rounds", disable=self.bars_disabled()
        ):
            done = self.run_round(r)
            row = done.row
            row["cumulative"] = {k: v for k, v in self.server.ledger.totals().items() if k != "per_client"}
            visit = self.personal_clients(done.plan.sampled)
            # checkpointed before anything made from this round's result leaves the server (the sites'
            # personalized evaluation, the next round's downloads): a crash after it never makes the round
            # run again on a model that was already released
            self.checkpoint(r, pending={"row": standard_row(row), "visit": visit})
            self.evaluate_and_log(row, visit)
            log.info(
                "round %d: train loss %s, eval loss %s, accuracy %s%s, up %d / down %d params%s%s",
                r,
                _fmt(row["train_loss"]),
                _fmt(row.get("eval_loss")),
                _fmt(row.get("accuracy")),
                _rouge(row),
                row["up_params"],
                row["down_params"],
                f", {len(row.get('sampled', []))} clients" if len(row.get("sampled", [])) > 20 else "",
                "".join(  # what a wrapper of the strategy reports (the privacy spent, ...)
                    f", {k} {v:.3g}" for k, v in done.report.reported.items() if isinstance(v, int | float)
                ),
            )
            if cfg.output.comm_budget_mib:
                self.budget_line(row)
        summary = self.finish()
        if cfg.output.log_with:
            self.acc.end_training()
        return summary

    def budget_line(self, row: dict) -> None:
        """The round's communication against ``output.comm_budget_mib``, counted as FlowerTune's strategy
        counts it (every array sent down and up, in 2^20-byte 'MB'), and its warning once over."""
        budget, c = self.cfg.output.comm_budget_mib, row["cumulative"]
        used = (c["total_up_bytes"] + c["total_down_bytes"]) / MIB
        this = (row["up_bytes"] + row["down_bytes"]) / MIB
        log.info(
            "communication budget: used %.2f MiB (+%.2f MiB this round) / %s MiB",
            used,
            this,
            f"{budget:,.0f}",
        )
        if used > budget:
            log.warning(
                "the run's communication (%.2f MiB) has exceeded output.comm_budget_mib = %s MiB%s",
                used,
                f"{budget:,.0f}",
                " (the FlowerTune leaderboard's limit)" if budget == FLOWERTUNE_BUDGET_MIB else "",
            )

    def finish(self) -> dict:
        cfg, rt, layout, strategy = self.cfg, self.runtime, self.layout, self.strategy
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "strategy": strategy.name,
            "algorithm": cfg.client.algorithm,
            "rounds": cfg.federation.rounds,
            "wall_s": self.elapsed(),
            "ranks": [strategy.adapter_rank(c.rank) for c in self.server.clients.values()],
            "processes": self.acc.num_processes,
            "parallel": layout.mode,
            "benchmark": self.benchmark.source if self.benchmark is not None else None,
            "eval_split": cfg.eval.split,  # loss_before / loss_after are of this held-out set
            "mixed_precision": str(self.acc.mixed_precision),
            "communication": self.server.ledger.totals(),
            "comm_budget_mib": cfg.output.comm_budget_mib,
            "global_adapter": str(self.run_dir / "global_adapter") if self.server.updated_rounds else None,
        }
        if cfg.eval.personalized:
            summary["personalized_on"] = self.personal_scope()
        summary.update(self.strategy.run_summary(cfg.federation.rounds))  # what a wrapper reports
        if layout.deepspeed:
            summary["deepspeed_zero_stage"] = layout.zero_stage
        if cfg.model.quantization != "none":
            summary["quantization"] = cfg.model.quantization
            kernel = getattr(rt.model.get_base_model(), "fedllm_cpu_4bit_kernel", None)
            if kernel:
                summary["quant_cpu_kernel"] = kernel
        if rt.residual_merges:
            why = (
                f"the base is {cfg.model.quantization}-quantized"
                if cfg.model.quantization != "none"
                else "DeepSpeed ZeRO-3 shards the base weights"
            )
            summary["residual_adapter_rank"] = rt.residual_rank
            summary["note"] = (
                f"{why}, so the merged global update is kept as a frozen residual adapter (rank "
                f"{rt.residual_rank}) instead of being written into the base weights; the exported adapter "
                "holds it"
            )
        elif strategy.merges_into_base:
            summary["note"] = (
                "the global update is merged into the base; the exported adapter holds the residual"
            )
        summary = self.writer.finish(summary, lambda path: save_global_adapter(self.server, cfg, path))
        self.acc.wait_for_everyone()
        return summary


def personal_summary(rows: dict[str, dict]) -> dict[str, Any]:
    """The metrics row's personalized part: each client's row and the means over clients."""
    if not rows:
        return {}

    def mean(key: str) -> float:
        return sum(r[key] for r in rows.values()) / len(rows)

    return {
        "personal": rows,
        "global_client_acc": mean("global_acc"),
        "personal_acc": mean("personal_acc"),
        "global_client_loss": mean("global_loss"),
        "personal_loss": mean("personal_loss"),
    }


def standard_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as JSON holds it (non-finite numbers as None), to keep in a checkpoint's metadata."""
    import json

    from fedllm.run.folder import standard_json

    return json.loads(standard_json(row))


def tracker_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as accelerate trackers take it (scalars; lists and maps as text)."""
    return {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in flat_config(cfg).items()}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _rouge(row: dict) -> str:
    return f", Rouge-L {row['rouge_l']:.2f}" if row.get("rouge_l") is not None else ""
