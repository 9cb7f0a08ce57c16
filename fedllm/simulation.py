"""The simulation driver: the server and a client runtime in one job (also under ``accelerate launch``).

A round is ``server.plan_round`` -> each of this process's clients trained by
the runtime from its ClientStart -> the updates gathered (client-parallel
layout) -> ``server.finish_round`` -> the merged update applied to the base ->
evaluation -> one metrics row and a checkpoint. The driver holds no algorithm
logic: it moves messages and writes the run directory. Processes share the
work as ``fedllm/parallel.py`` says: clients split over processes (every
process then aggregates the same sorted list), or every process on every
client with the batches split (data layout).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

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
    """The benchmark a run scores (see ``eval.benchmark``); loaded here, so bad data fails before the model loads.

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
        log.warning("eval.benchmark = auto: MMLU cannot be loaded (%s); evaluating held-out loss only. Set "
                    "eval.benchmark to a local MMLU copy (or none to silence this)", str(err).split(":")[0])
        return None


class Simulation:
    """A federated fine-tuning run with every client simulated by this job (see module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, accelerator=None, client_hook: ClientHook | None = None):
        from accelerate import Accelerator

        self.cfg, self.run_dir, self.client_hook = cfg, Path(run_dir), client_hook
        # the launch decides the device, the process group, DeepSpeed and mixed precision
        self.acc = accelerator or Accelerator(log_with=cfg.output.log_with or None, project_dir=str(run_dir))
        self.layout = resolve_layout(cfg.federation.parallel, self.acc, cfg)
        self.strategy = strategy_from_config(cfg.aggregation)
        self.start_round, self.wall_before = 1, 0.0
        self.t_start = time.perf_counter()
        self.writer = RunWriter(self.run_dir, self.acc.is_main_process, cfg.output.keep_checkpoints,
                                cfg.output.save_every_round, self.acc.log if cfg.output.log_with else None)

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Data, benchmark, base model, runtime and server; bad input fails before the model loads."""
        cfg = self.cfg
        parts = load_partitions(cfg)
        self.benchmark = resolve_benchmark(cfg)
        with self.acc.main_process_first():  # the built-in base is built once, by the main process
            model, tokenizer = load_base(cfg.model, self.acc.device)
        max_len = max_seq_len(cfg, context_length(model))
        lora_ranks = assign_ranks(cfg)
        ranks = [self.strategy.adapter_rank(r) for r in lora_ranks]
        agg = cfg.aggregation
        mixture = MixtureSpec(agg.num_adaptors, ranks[0] // agg.num_adaptors, agg.router_temperature, agg.router_noise,
                              agg.router_per_layer, agg.stateful_routers, agg.router_lr, agg.precondition_eps,
                              agg.bias_adaptors) if self.strategy.uses_routers else None
        # merged updates cannot be written into 4/8-bit weights (or ZeRO-3 shards): keep them as a frozen adapter
        residual = self.strategy.merges_into_base and (is_quantized(model) or self.layout.zero_stage == 3)
        self.runtime = ClientRuntime(model, tokenizer, ranks, cfg.lora, cfg.client, cfg.federation.seed, self.layout,
                                     self.acc, mixture, residual, cfg.federation.client_timeout_s,
                                     progress=self.quiet() is None)
        template = prompt_template(cfg)
        from data_prep.prompts import tokenize_examples

        self.eval_data = tokenize_examples(parts.eval_examples, tokenizer, template, max_len)
        self.clients: list[ClientData] = []
        for k, (examples, n_test) in enumerate(zip(parts.clients, parts.test_sizes, strict=True)):
            train, test = tokenize_client(examples, n_test, tokenizer, template, max_len, k)
            if self.layout.data_parallel and len(train) < cfg.client.batch_size:
                raise ValueError(f"client {k} has {len(train)} training examples, fewer than client.batch_size = "
                                 f"{cfg.client.batch_size}, which federation.parallel=data splits over "
                                 f"{self.layout.num_processes} processes: raise data.min_examples_per_client or "
                                 "lower client.batch_size")
            scale = lora_scale(cfg.lora.alpha_ratio * ranks[k], ranks[k], cfg.lora.use_rslora)
            self.clients.append(ClientData(k, ranks[k], scale, train, test))
        self.partition_stats = parts.stats
        for stat, c in zip(self.partition_stats, self.clients, strict=True):
            stat.update({"rank": c.rank, "train": len(c.train), "test": len(c.test)})
        dense = self.runtime.initial_dense()
        n_dense = sum(t.numel() for t in dense.values())
        if n_dense > 5_000_000:
            log.warning("lora.trainable_modules %s add %.1fM parameters to every upload and download; "
                        "set lora.trainable_modules=[] for a LoRA-only federation", cfg.lora.trainable_modules,
                        n_dense / 1e6)
        fed = cfg.federation
        algorithm = ALGORITHMS[cfg.client.algorithm].server_half.from_config(cfg.client)
        self.server = Server(self.strategy, [ClientInfo(c.client_id, lora_ranks[c.client_id], c.scale,
                                                        c.num_examples) for c in self.clients], algorithm,
                             Sampling(fed.seed, fed.clients_per_round, fed.client_fraction, fed.dropout), dense,
                             fed.min_clients, agg.clip_norm_ratio, fed.client_timeout_s)

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
        results: list[tuple[int, Any, dict]] = []
        for k in tqdm(self.layout.my_clients(plan.active), desc=f"round {round_idx} clients", leave=False,
                      disable=self.quiet()):
            client = self.clients[k]
            try:
                results.append((k, self.runtime.train(client, plan.starts[k], self.client_hook), client.state))
            except Exception as e:  # a faulty client must not take the round down
                log.warning("round %d: client %d left out: %s", round_idx, k, e)
                log.debug("client %d traceback", k, exc_info=True)
                results.append((k, f"{type(e).__name__}: {e}", client.state))
        results = self._gather(results)
        for k, _, state in results:  # every process keeps every client's state (it may train it next round)
            self.clients[k].state = state
        train_s = time.perf_counter() - t0
        row = self.server.finish_round(plan, {k: got for k, got, _ in results})
        if self.server.last_merged:
            self.runtime.apply_merges([(round_idx, self.server.last_merged)])
        return {**row, "time_train_s": train_s}

    def _gather(self, results: list) -> list:
        if not self.layout.gathers:  # one process, or data mode: every process has every result
            return results
        from accelerate.utils import gather_object

        return sorted((r for part in gather_object([results]) for r in part), key=lambda r: r[0])

    # ----------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        return evaluate_global(self.runtime, self.server.global_adapter(), self.eval_data, self.benchmark,
                               self.cfg.eval.batch_size)

    def personalized(self, round_idx: int) -> dict[str, Any]:
        """Each client's test data: the global model, then its personalization (see ClientRuntime.personalized)."""
        rows = {}
        for client in self.layout.my_clients(self.clients):
            if client.test:
                start = self.server.client_start(round_idx + 1, client.client_id)
                rows[str(client.client_id)] = self.runtime.personalized(client, start, self.cfg.eval.batch_size)
        if self.layout.gathers:
            from accelerate.utils import gather_object

            rows = {k: v for part in gather_object([rows]) for k, v in part.items()}
        if not rows:
            return {}

        def mean(key: str) -> float:
            return sum(r[key] for r in rows.values()) / len(rows)

        return {"personal": rows, "global_client_acc": mean("global_acc"), "personal_acc": mean("personal_acc"),
                "global_client_loss": mean("global_loss"), "personal_loss": mean("personal_loss")}

    # -------------------------------------------------------- checkpointing
    def checkpoint(self, round_idx: int) -> None:
        tensors, meta = self.server.state_dict()
        for c in self.clients:
            tensors.update({f"client.{c.client_id}.{k}": v for k, v in c.state.items()})
        meta.update({"seed": self.cfg.federation.seed, "rng": "derived from (seed, round, client)",
                     "wall_s": self.elapsed()})
        self.writer.checkpoint(round_idx, tensors, meta)

    def restore(self) -> None:
        """Continue after the newest intact checkpoint of the run directory (a damaged newer one is passed over)."""
        from fedllm import checkpoint as ckpt

        found = ckpt.load_latest(self.run_dir)
        if found is None:
            log.info("no checkpoint in %s: starting from round 1", self.run_dir)
            return
        path, tensors, meta = found
        if meta["strategy"] != self.strategy.name:
            raise ckpt.CheckpointError(f"{path}: written by strategy {meta['strategy']!r}, "
                                       f"config says {self.strategy.name!r}")
        self.server.load_state_dict(tensors, meta)
        for c in self.clients:
            prefix = f"client.{c.client_id}."
            c.state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
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
            log.info("before round 1: eval loss %s, accuracy %s", _fmt(row.get("eval_loss")),
                     _fmt(row.get("accuracy")))
        for r in tqdm(range(self.start_round, cfg.federation.rounds + 1), desc="rounds", disable=self.quiet()):
            row = self.run_round(r)
            if r % cfg.eval.every == 0 or r == cfg.federation.rounds:
                row.update(self.evaluate())
                if cfg.eval.personalized:
                    row.update(self.personalized(r))
            row["cumulative"] = {k: v for k, v in self.server.ledger.totals().items() if k != "per_client"}
            self.writer.log(row)
            self.checkpoint(r)
            log.info("round %d: train loss %s, eval loss %s, accuracy %s, up %d / down %d params",
                     r, _fmt(row["train_loss"]), _fmt(row.get("eval_loss")), _fmt(row.get("accuracy")),
                     row["up_params"], row["down_params"])
        summary = self.finish()
        if cfg.output.log_with:
            self.acc.end_training()
        return summary

    def finish(self) -> dict:
        from fedllm.export import save_global_adapter

        cfg, rt = self.cfg, self.runtime
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir), "strategy": self.strategy.name, "algorithm": cfg.client.algorithm,
            "rounds": cfg.federation.rounds, "ranks": [c.rank for c in self.clients], "wall_s": self.elapsed(),
            "processes": self.acc.num_processes, "parallel": self.layout.mode,
            "benchmark": self.benchmark.source if self.benchmark is not None else None,
            "mixed_precision": str(self.acc.mixed_precision), "communication": self.server.ledger.totals(),
            "global_adapter": str(self.run_dir / "global_adapter") if self.server.updated_rounds else None}
        if self.layout.deepspeed:
            summary["deepspeed_zero_stage"] = self.layout.zero_stage
        if cfg.model.quantization != "none":
            summary["quantization"] = cfg.model.quantization
            kernel = getattr(rt.model.get_base_model(), "fedllm_cpu_4bit_kernel", None)
            if kernel:
                summary["quant_cpu_kernel"] = kernel
        if rt.residual_merges:
            why = (f"the base is {cfg.model.quantization}-quantized" if cfg.model.quantization != "none"
                   else "DeepSpeed ZeRO-3 shards the base weights")
            summary["residual_adapter_rank"] = rt.residual_rank
            summary["note"] = (f"{why}, so the merged global update is kept as a frozen residual adapter (rank "
                               f"{rt.residual_rank}) instead of being written into the base weights; the exported "
                               "adapter holds it")
        elif self.strategy.merges_into_base:
            summary["note"] = "the global update is merged into the base; the exported adapter holds the residual"
        summary = self.writer.finish(summary, lambda path: save_global_adapter(self.server, cfg, path))
        self.acc.wait_for_everyone()
        return summary


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _flat_config(cfg: Config) -> dict:
    flat = {}
    for section, values in dataclasses.asdict(cfg).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, int | float | str | bool) else str(v)
    return flat
