"""Drivers: the round loop around the server and the client runtime, and the in-process simulation.

A round is ``server.plan_round`` -> each active client trained from its
ClientStart (:meth:`Driver.train_clients`: here by the local runtime, in
``fedllm/flower/`` by the sites) -> ``server.finish_round`` -> the merged
update applied to the evaluation base -> evaluation -> one metrics row and a
checkpoint. A driver holds no algorithm logic: it moves messages and writes
the run directory. In the simulation the processes of a launch share the work
as ``fedllm/parallel.py`` says: clients split over processes (every process
then aggregates the same sorted list), or every process on every client with
the batches split (data layout).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from data_prep.prompts import tokenize_examples
from eval.data import MMLUDataError
from eval.mmlu import Benchmark, load_benchmark
from fedllm.aggregation import strategy_from_config
from fedllm.client import ALGORITHMS
from fedllm.client.runtime import ClientData, ClientHook, ClientRuntime
from fedllm.config import Config
from fedllm.evaluation import evaluate_global
from fedllm.factors import lora_scale
from fedllm.mixture import MixtureSpec
from fedllm.modeling import context_length, is_quantized, load_base
from fedllm.parallel import resolve_layout
from fedllm.partitions import load_partitions, max_seq_len, prompt_template, tokenize_client
from fedllm.protocol import ClientInfo, derive_seed
from fedllm.rundir import RunWriter
from fedllm.server import Sampling, Server

log = logging.getLogger(__name__)


def assign_ranks(cfg: Config) -> list[int]:
    """Client ranks: the configured list cycled, or draws from ``rank_distribution``."""
    import random

    n = cfg.federation.num_clients
    if cfg.lora.rank_distribution:
        rng = random.Random(derive_seed(cfg.federation.seed, 17))
        ranks, probs = zip(*sorted(cfg.lora.rank_distribution.items()), strict=True)
        return [rng.choices(ranks, probs)[0] for _ in range(n)]
    return [cfg.lora.ranks[k % len(cfg.lora.ranks)] for k in range(n)]


def resolve_benchmark(cfg: Config) -> Benchmark | None:
    """The benchmark a run scores (see ``eval.benchmark``).

    Loaded here, so bad data fails before the model loads.

    With ``auto`` and a user's own data the built-in benchmark would measure
    nothing the data teaches, so MMLU is used when a copy can be loaded and
    held-out loss alone otherwise (said once, with the fix).
    """
    e = cfg.eval
    if e.benchmark == "none":
        return None
    if e.benchmark != "auto":
        return load_benchmark(e.benchmark, e.shots, e.subjects or None, e.limit)
    if cfg.data.dataset == "builtin":
        return load_benchmark("builtin", e.shots, e.subjects or None, e.limit)
    try:
        return load_benchmark("cais/mmlu", e.shots, e.subjects or None, e.limit)
    except MMLUDataError as err:
        log.warning(
            "eval.benchmark = auto: MMLU cannot be loaded (%s); evaluating held-out loss only. Set "
            "eval.benchmark to a local MMLU copy (or none to silence this)",
            str(err).split(":")[0],
        )
        return None


def make_runtime(
    cfg: Config, strategy, layout, accelerator, model, tokenizer, ranks: list[int], progress: bool = False
) -> ClientRuntime:
    """A client runtime on ``model`` with one adapter per rank in ``ranks`` (adapter ranks: FLoRAL's
    C * r).
    """
    agg = cfg.aggregation
    mixture = (
        MixtureSpec(
            agg.num_adaptors,
            ranks[0] // agg.num_adaptors,
            agg.router_temperature,
            agg.router_noise,
            agg.router_per_layer,
            agg.stateful_routers,
            agg.router_lr,
            agg.precondition_eps,
            agg.bias_adaptors,
        )
        if strategy.uses_routers
        else None
    )
    # merged updates cannot be written into 4/8-bit weights (or ZeRO-3 shards): keep them as a frozen adapter
    residual = strategy.merges_into_base and (is_quantized(model) or layout.zero_stage == 3)
    return ClientRuntime(
        model,
        tokenizer,
        ranks,
        cfg.lora,
        cfg.client,
        cfg.federation.seed,
        layout,
        accelerator,
        mixture,
        residual,
        cfg.federation.client_timeout_s,
        progress=progress,
    )


def client_infos(cfg: Config, strategy, sizes: dict[int, int]) -> list[ClientInfo]:
    """What the server knows of each client, from its example count (``sizes``) and the configured ranks."""
    ranks = assign_ranks(cfg)
    out = []
    for k, n in sorted(sizes.items()):
        r = strategy.adapter_rank(ranks[k])
        out.append(ClientInfo(k, ranks[k], lora_scale(cfg.lora.alpha_ratio * r, r, cfg.lora.use_rslora), n))
    return out


class Driver(abc.ABC):
    """The round loop shared by every driver; subclasses say where the clients train (see module docstring).

    After :meth:`setup` a driver has ``server``, ``runtime`` (the base the
    global model is evaluated on; in the simulation also where the clients
    train), ``eval_data`` and ``benchmark``.
    """

    def __init__(self, cfg: Config, run_dir: Path, accelerator=None):
        from accelerate import Accelerator

        self.cfg, self.run_dir = cfg, Path(run_dir)
        # the launch decides the device, the process group, DeepSpeed and mixed precision
        self.acc = accelerator or Accelerator(log_with=cfg.output.log_with or None, project_dir=str(run_dir))
        self.layout = resolve_layout(cfg.federation.parallel, self.acc, cfg)
        self.strategy = strategy_from_config(cfg.aggregation)
        self.start_round, self.wall_before = 1, 0.0
        self.t_start = time.perf_counter()
        self.writer = RunWriter(
            self.run_dir,
            self.acc.is_main_process,
            cfg.output.keep_checkpoints,
            cfg.output.save_every_round,
            self.acc.log if cfg.output.log_with else None,
        )

    # -------------------------------------------------------- the pieces
    def load_model(self):
        """The base and its tokenizer (the built-in base is built once, by the main process)."""
        with self.acc.main_process_first():
            return load_base(self.cfg.model, self.acc.device)

    def build_runtime(self, model, tokenizer, ranks: list[int]) -> ClientRuntime:
        return make_runtime(
            self.cfg,
            self.strategy,
            self.layout,
            self.acc,
            model,
            tokenizer,
            ranks,
            progress=self.quiet() is None,
        )

    def build_server(self, clients: list[ClientInfo]) -> Server:
        cfg, fed = self.cfg, self.cfg.federation
        dense = self.runtime.initial_dense()
        n_dense = sum(t.numel() for t in dense.values())
        if n_dense > 5_000_000:
            log.warning(
                "lora.trainable_modules %s add %.1fM parameters to every upload and download; "
                "set lora.trainable_modules=[] for a LoRA-only federation",
                cfg.lora.trainable_modules,
                n_dense / 1e6,
            )
        algorithm = ALGORITHMS[cfg.client.algorithm].server_half.from_config(cfg.client)
        return Server(
            self.strategy,
            clients,
            algorithm,
            Sampling(fed.seed, fed.clients_per_round, fed.client_fraction, fed.dropout),
            dense,
            fed.min_clients,
            cfg.aggregation.clip_norm_ratio,
            fed.client_timeout_s,
        )

    def client_infos(self, sizes: dict[int, int]) -> list[ClientInfo]:
        return client_infos(self.cfg, self.strategy, sizes)

    # ----------------------------------------------- where clients train
    @abc.abstractmethod
    def setup(self) -> None:
        """Data, benchmark, the evaluation base (``runtime``) and the server; bad input fails before the
        model.
        """

    @abc.abstractmethod
    def train_clients(self, plan) -> dict[int, Any]:
        """Each active client's update (or why it failed), trained from ``plan.starts``."""

    @abc.abstractmethod
    def personalized(self, round_idx: int) -> dict[str, Any]:
        """Per-client rows of the personalized evaluation after ``round_idx`` (see
        ClientRuntime.personalized).
        """

    def client_state_tensors(self) -> dict[str, Any]:
        """Client state the run's checkpoint holds (the simulation's clients; a real site keeps its own)."""
        return {}

    def load_client_state_tensors(self, tensors: dict[str, Any]) -> None:
        """Restore what :meth:`client_state_tensors` returned."""

    # ------------------------------------------------------------- a round
    def quiet(self) -> bool | None:
        """tqdm's ``disable``: bars on the main process's terminal only (None: tqdm checks for a TTY)."""
        return None if self.acc.is_main_process else True

    def elapsed(self) -> float:
        """Seconds this run has spent so far, over every attempt (resumes add to it)."""
        return self.wall_before + time.perf_counter() - self.t_start

    def run_round(self, round_idx: int) -> dict[str, Any]:
        plan = self.server.plan_round(round_idx)
        t0 = time.perf_counter()
        results = self.train_clients(plan)
        train_s = time.perf_counter() - t0
        row = self.server.finish_round(plan, results)
        if self.server.last_merged:
            self.runtime.apply_merges([(round_idx, self.server.last_merged)])
        return {**row, "time_train_s": train_s}

    # ----------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        return evaluate_global(
            self.runtime,
            self.server.global_adapter(),
            self.eval_data,
            self.benchmark,
            self.cfg.eval.batch_size,
        )

    # -------------------------------------------------------- checkpointing
    def checkpoint(self, round_idx: int) -> None:
        tensors, meta = self.server.state_dict()
        tensors.update(self.client_state_tensors())
        meta.update(
            {
                "seed": self.cfg.federation.seed,
                "rng": "derived from (seed, round, client)",
                "wall_s": self.elapsed(),
            }
        )
        self.writer.checkpoint(round_idx, tensors, meta)

    def restore(self) -> None:
        """Continue after the newest intact checkpoint of the run directory (a damaged newer one is passed
        over).
        """
        from fedllm import checkpoint as ckpt

        found = ckpt.load_latest(self.run_dir)
        if found is None:
            log.info("no checkpoint in %s: starting from round 1", self.run_dir)
            return
        path, tensors, meta = found
        if meta["strategy"] != self.strategy.name:
            raise ckpt.CheckpointError(
                f"{path}: written by strategy {meta['strategy']!r}, config says {self.strategy.name!r}"
            )
        self.server.load_state_dict(tensors, meta)
        self.load_client_state_tensors(tensors)
        self.runtime.restore_base(self.server.state.residual, meta["round"])
        self.start_round = meta["round"] + 1
        self.wall_before = meta.get("wall_s", 0.0)
        log.info("resuming %s after round %d", self.run_dir, meta["round"])

    # ------------------------------------------------------------------ run
    def run(self, resume: bool = False) -> dict:
        cfg = self.cfg
        if cfg.output.log_with:
            self.acc.init_trackers("fedllm", config=_flat_config(cfg))
        rows: list[dict] = []
        if resume:
            self.restore()
            rows = self.writer.keep_rows_before(self.start_round)
        else:
            self.writer.start(cfg, self.partition_stats)
        self.t_start = time.perf_counter()
        if not rows:  # the evaluation before round 1 (kept from the first attempt when there was one)
            row = {"round": 0, **self.evaluate()}
            self.writer.log(row)
            log.info(
                "before round 1: eval loss %s, accuracy %s",
                _fmt(row.get("eval_loss")),
                _fmt(row.get("accuracy")),
            )
        for r in tqdm(
            range(self.start_round, cfg.federation.rounds + 1), desc="rounds", disable=self.quiet()
        ):
            row = self.run_round(r)
            if r % cfg.eval.every == 0 or r == cfg.federation.rounds:
                row.update(self.evaluate())
                if cfg.eval.personalized:
                    row.update(self.personalized(r))
            row["cumulative"] = {k: v for k, v in self.server.ledger.totals().items() if k != "per_client"}
            self.writer.log(row)
            self.checkpoint(r)
            log.info(
                "round %d: train loss %s, eval loss %s, accuracy %s, up %d / down %d params",
                r,
                _fmt(row["train_loss"]),
                _fmt(row.get("eval_loss")),
                _fmt(row.get("accuracy")),
                row["up_params"],
                row["down_params"],
            )
        summary = self.finish()
        if cfg.output.log_with:
            self.acc.end_training()
        return summary

    def finish(self) -> dict:
        from fedllm.export import save_global_adapter

        cfg, rt = self.cfg, self.runtime
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "strategy": self.strategy.name,
            "algorithm": cfg.client.algorithm,
            "rounds": cfg.federation.rounds,
            "wall_s": self.elapsed(),
            "ranks": [self.strategy.adapter_rank(c.rank) for c in self.server.clients.values()],
            "processes": self.acc.num_processes,
            "parallel": self.layout.mode,
            "benchmark": self.benchmark.source if self.benchmark is not None else None,
            "mixed_precision": str(self.acc.mixed_precision),
            "communication": self.server.ledger.totals(),
            "global_adapter": str(self.run_dir / "global_adapter") if self.server.updated_rounds else None,
        }
        if self.layout.deepspeed:
            summary["deepspeed_zero_stage"] = self.layout.zero_stage
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
                f"{rt.residual_rank}) instead of being written into the base weights; the exported "
                "adapter holds it"
            )
        elif self.strategy.merges_into_base:
            summary["note"] = (
                "the global update is merged into the base; the exported adapter holds the residual"
            )
        summary = self.writer.finish(summary, lambda path: save_global_adapter(self.server, cfg, path))
        self.acc.wait_for_everyone()
        return summary


class Simulation(Driver):
    """Every client simulated by this job, on one base per process (see module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, accelerator=None, client_hook: ClientHook | None = None):
        super().__init__(cfg, run_dir, accelerator)
        self.client_hook = client_hook  # fault injection for tests: (round, client, update) -> update

    def setup(self) -> None:
        cfg = self.cfg
        parts = load_partitions(cfg)
        self.benchmark = resolve_benchmark(cfg)
        model, tokenizer = self.load_model()
        max_len = max_seq_len(cfg, context_length(model))
        infos = self.client_infos({k: 0 for k in range(cfg.federation.num_clients)})
        self.runtime = self.build_runtime(
            model, tokenizer, [self.strategy.adapter_rank(c.rank) for c in infos]
        )
        template = prompt_template(cfg)
        self.eval_data = tokenize_examples(parts.eval_examples, tokenizer, template, max_len)
        self.clients: list[ClientData] = []
        for info, examples, n_test in zip(infos, parts.clients, parts.test_sizes, strict=True):
            k = info.client_id
            train, test = tokenize_client(examples, n_test, tokenizer, template, max_len, k)
            if self.layout.data_parallel and len(train) < cfg.client.batch_size:
                raise ValueError(
                    f"client {k} has {len(train)} training examples, fewer than client.batch_size = "
                    f"{cfg.client.batch_size}, which federation.parallel=data splits over "
                    f"{self.layout.num_processes} processes: raise data.min_examples_per_client or "
                    "lower client.batch_size"
                )
            self.clients.append(ClientData(k, self.strategy.adapter_rank(info.rank), info.scale, train, test))
            info.num_examples = len(train)
        self.partition_stats = parts.stats
        for stat, c in zip(self.partition_stats, self.clients, strict=True):
            stat.update({"rank": c.rank, "train": len(c.train), "test": len(c.test)})
        self.server = self.build_server(infos)

    def train_clients(self, plan) -> dict[int, Any]:
        results: list[tuple[int, Any, dict]] = []
        for k in tqdm(
            self.layout.my_clients(plan.active),
            desc=f"round {plan.round} clients",
            leave=False,
            disable=self.quiet(),
        ):
            client = self.clients[k]
            try:
                results.append(
                    (k, self.runtime.train(client, plan.starts[k], self.client_hook), client.state)
                )
            except Exception as e:  # a faulty client must not take the round down
                log.warning("round %d: client %d left out: %s", plan.round, k, e)
                log.debug("client %d traceback", k, exc_info=True)
                results.append((k, f"{type(e).__name__}: {e}", client.state))
        results = self._gather(results)
        for k, _, state in results:  # every process keeps every client's state (it may train it next round)
            self.clients[k].state = state
        return {k: got for k, got, _ in results}

    def _gather(self, results: list) -> list:
        if not self.layout.gathers:  # one process, or data mode: every process has every result
            return results
        from accelerate.utils import gather_object

        return sorted((r for part in gather_object([results]) for r in part), key=lambda r: r[0])

    def personalized(self, round_idx: int) -> dict[str, Any]:
        """Each client's test data: the global model, then its personalization (see
        ClientRuntime.personalized).
        """
        rows = {}
        for client in self.layout.my_clients(self.clients):
            if client.test:
                start = self.server.client_start(round_idx + 1, client.client_id)
                rows[str(client.client_id)] = self.runtime.personalized(
                    client, start, self.cfg.eval.batch_size
                )
        if self.layout.gathers:
            from accelerate.utils import gather_object

            rows = {k: v for part in gather_object([rows]) for k, v in part.items()}
        return personal_summary(rows)

    def client_state_tensors(self) -> dict[str, Any]:
        return {f"client.{c.client_id}.{k}": v for c in self.clients for k, v in c.state.items()}

    def load_client_state_tensors(self, tensors: dict[str, Any]) -> None:
        for c in self.clients:
            prefix = f"client.{c.client_id}."
            c.state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


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


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _flat_config(cfg: Config) -> dict:
    flat = {}
    for section, values in dataclasses.asdict(cfg).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, int | float | str | bool) else str(v)
    return flat
