"""The round loop: sample, broadcast, train, aggregate, evaluate, checkpoint.

One base model per process. Each round the sampled clients are split over the
processes (client-parallel); every update is gathered to the main process,
which aggregates and broadcasts the new global state. All randomness of a
client's work derives from ``(seed, round, client)``, so the result does not
depend on how many processes ran it, and a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from data_prep.loaders import load_examples
from data_prep.partition import client_stats, partition
from data_prep.prompts import TokenizedExample, collate, tokenize_examples
from eval.data import MMLUDataError
from eval.mmlu import Benchmark, load_benchmark
from eval.mmlu import evaluate as mmlu_evaluate
from fedllm import checkpoint as ckpt
from fedllm.aggregation import ClientUpdate, GlobalState, strategy_from_config
from fedllm.client import ALGORITHMS, LocalPlan
from fedllm.client.base import batch_stream
from fedllm.comm import Ledger
from fedllm.config import Config, save_config
from fedllm.factors import (
    Adapter,
    LoraFactors,
    dense_param_names,
    fresh_factors,
    lora_scale,
    module_key,
    read_dense,
    read_factors,
    write_dense,
    write_factors,
)
from fedllm.mixture import MixtureSession, MixtureSpec
from fedllm.modeling import (
    RESIDUAL,
    activate,
    adapter_name,
    adapter_params,
    attach_lora,
    context_length,
    install_adapter,
    install_residual,
    is_quantized,
    load_base,
    merge_into_base,
    restore_dequant_layers,
    set_trainable_modules,
)
from fedllm.parallel import evaluation_engine, full_tensors, resolve_layout

log = logging.getLogger(__name__)

ClientHook = Callable[[int, int, ClientUpdate], ClientUpdate]


class ClientFailure(RuntimeError):
    """A client's update is unusable (raised, timed out, non-finite, mis-shaped)."""


@dataclass
class ClientData:
    client_id: int
    rank: int
    scale: float
    train: list[TokenizedExample]
    test: list[TokenizedExample]
    num_examples: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (independent of process layout)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def assign_ranks(cfg: Config) -> list[int]:
    """Client ranks: the configured list cycled, or draws from ``rank_distribution``."""
    n = cfg.federation.num_clients
    if cfg.lora.rank_distribution:
        rng = random.Random(derive_seed(cfg.federation.seed, 17))
        ranks, probs = zip(*sorted(cfg.lora.rank_distribution.items()), strict=True)
        return [rng.choices(ranks, probs)[0] for _ in range(n)]
    return [cfg.lora.ranks[k % len(cfg.lora.ranks)] for k in range(n)]


def sample_clients(cfg: Config, round_idx: int) -> list[int]:
    fed = cfg.federation
    m = fed.clients_per_round or max(1, round(fed.client_fraction * fed.num_clients))
    rng = random.Random(derive_seed(fed.seed, round_idx, 1))
    return sorted(rng.sample(range(fed.num_clients), m))


def validate_update(update: ClientUpdate, expected: Adapter) -> None:
    """Reject non-finite or mis-shaped factors before they reach the server math."""
    if set(update.factors) != set(expected):
        raise ClientFailure("update covers other modules than the adapter")
    for key, f in update.factors.items():
        ref = expected[key]
        if f.A.shape != ref.A.shape or f.B.shape != ref.B.shape:
            raise ClientFailure(f"wrong shape at {key}: A{tuple(f.A.shape)} B{tuple(f.B.shape)}, "
                                f"expected A{tuple(ref.A.shape)} B{tuple(ref.B.shape)}")
        if not (torch.isfinite(f.A).all() and torch.isfinite(f.B).all()):
            raise ClientFailure(f"non-finite values at {key}")
    for key, t in list(update.dense.items()) + list(update.extras.items()):
        if not torch.isfinite(t).all():
            raise ClientFailure(f"non-finite values in {key}")


def clip_updates(updates: list[ClientUpdate], ratio: float, dense_start: dict[str, torch.Tensor]) -> int:
    """Scale each update's change to at most ``ratio`` x the round's median norm; returns how many were clipped.

    The change is measured from what the client started with (factors and
    dense modules), so one hostile or broken client cannot dominate the
    aggregate by sending a huge update.
    """
    def delta_norm(u: ClientUpdate) -> float:
        sq = sum(float((f.A - u.start[k].A).pow(2).sum() + (f.B - u.start[k].B).pow(2).sum())
                 for k, f in u.factors.items())
        sq += sum(float((t - dense_start[k]).pow(2).sum()) for k, t in u.dense.items())
        return sq ** 0.5

    norms = [delta_norm(u) for u in updates]
    cap = ratio * float(torch.tensor(norms).median())
    clipped = 0
    for u, n in zip(updates, norms, strict=True):
        if n <= cap or n == 0:
            continue
        c = cap / n
        u.factors = {k: LoraFactors(u.start[k].A + c * (f.A - u.start[k].A), u.start[k].B + c * (f.B - u.start[k].B),
                                    f.scale) for k, f in u.factors.items()}
        u.dense = {k: dense_start[k] + c * (t - dense_start[k]) for k, t in u.dense.items()}
        clipped += 1
    return clipped


def revive_empty_directions(start: Adapter, fresh: Adapter) -> Adapter:
    """Give zero rank directions (zero A row and B column) a fresh A row.

    Zero-padding leaves directions whose gradients are zero forever; a fresh
    A row with the zero B column keeps the product unchanged and lets them learn.
    """
    out = {}
    for key, f in start.items():
        dead = (f.A.abs().sum(1) == 0) & (f.B.abs().sum(0) == 0)
        if dead.any():
            A = f.A.clone()
            A[dead] = fresh[key].A[dead]
            f = LoraFactors(A, f.B, f.scale)
        out[key] = f
    return out


class Federation:
    """A federated fine-tuning run (see module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, accelerator=None, client_hook: ClientHook | None = None):
        from accelerate import Accelerator

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # the launch decides the device, the process group, DeepSpeed and mixed precision
        self.acc = accelerator or Accelerator(log_with=cfg.output.log_with or None, project_dir=str(run_dir))
        self.layout = resolve_layout(cfg.federation.parallel, self.acc, cfg)
        self.client_hook = client_hook
        self.strategy = strategy_from_config(cfg.aggregation)
        self.algorithm = ALGORITHMS[cfg.client.algorithm].from_config(cfg.client)
        self.ledger = Ledger()
        self.state = GlobalState()
        self.last_merged: Adapter = {}
        self.start_round = 1
        self.wall_before = 0.0
        self.t_start = time.perf_counter()
        self.updated_rounds = 0  # rounds whose aggregate changed the global state
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Load data and model, partition, attach adapters; fails fast on bad input."""
        cfg = self.cfg
        examples = load_examples(cfg.data.dataset, cfg.data.format, cfg.data.max_examples,
                                 cfg.data.builtin_examples_per_skill, cfg.federation.seed)
        rng = random.Random(derive_seed(cfg.federation.seed, 3))
        order = list(range(len(examples)))
        rng.shuffle(order)
        n_eval = min(cfg.data.eval_size, len(examples) // 5)
        eval_examples = [examples[i] for i in order[:n_eval]]
        pool = [examples[i] for i in order[n_eval:]]
        parts = partition(pool, cfg.data.partition, cfg.federation.num_clients, cfg.federation.seed,
                          cfg.data.dirichlet_alpha, cfg.data.shards_per_client, cfg.data.min_examples_per_client)
        self.partition_stats = client_stats(pool, parts)

        self.benchmark = resolve_benchmark(cfg)
        with self.acc.main_process_first():  # the built-in base is built once, by the main process
            self.model, self.tokenizer = load_base(cfg.model, self.acc.device)
        max_ctx = context_length(self.model)
        max_len = cfg.data.max_seq_len or min(512, max_ctx or 512)
        if max_ctx is not None and max_len > max_ctx:
            raise ValueError(f"data.max_seq_len = {max_len} exceeds the model's context length "
                             f"{max_ctx}: lower data.max_seq_len")
        template = cfg.data.template if cfg.data.template != "auto" else (
            "plain" if cfg.data.dataset == "builtin" else "alpaca")
        ranks = [self.strategy.adapter_rank(r) for r in assign_ranks(cfg)]
        self.model = attach_lora(self.model, ranks, cfg.lora)
        # merged updates cannot be written into 4/8-bit weights: keep them as a frozen adapter instead
        # (ZeRO-3 shards the base weights over processes: the same holds there)
        self.residual_adapter = self.strategy.merges_into_base and (
            is_quantized(self.model) or self.layout.zero_stage == 3)
        self.residual_rank = 0
        agg = cfg.aggregation
        self.mixture = MixtureSpec(agg.num_adaptors, ranks[0] // agg.num_adaptors, agg.router_temperature,
                                   agg.router_noise, agg.router_per_layer, agg.stateful_routers, agg.router_lr,
                                   agg.precondition_eps, agg.bias_adaptors) if self.strategy.uses_routers else None
        self.dense_names = dense_param_names(self.model, cfg.lora.trainable_modules)
        with self.whole_adapters():
            self.state.dense = read_dense(self.model, self.dense_names)
        n_dense = sum(t.numel() for t in self.state.dense.values())
        if n_dense > 5_000_000:
            log.warning("lora.trainable_modules %s add %.1fM parameters to every upload and download; "
                        "set lora.trainable_modules=[] for a LoRA-only federation",
                        cfg.lora.trainable_modules, n_dense / 1e6)

        def tok(exs):
            return tokenize_examples(exs, self.tokenizer, template, max_len)

        self.eval_data = tok(eval_examples)
        self.clients: list[ClientData] = []
        for k, idx in enumerate(parts):
            crng = random.Random(derive_seed(cfg.federation.seed, 5, k))
            idx = list(idx)
            crng.shuffle(idx)
            n_test = int(len(idx) * cfg.data.client_test_fraction)
            mine = [pool[i] for i in idx]
            if cfg.data.label_shift_groups:
                from data_prep.builtin import shift_labels

                mine = [shift_labels(e, k % cfg.data.label_shift_groups) for e in mine]
            train, test = tok(mine[n_test:]), tok(mine[:n_test])
            if not train:
                raise ValueError(f"client {k}: no training example survives data.max_seq_len = {max_len}")
            if self.layout.data_parallel and len(train) < cfg.client.batch_size:
                raise ValueError(f"client {k} has {len(train)} training examples, fewer than client.batch_size = "
                                 f"{cfg.client.batch_size}, which federation.parallel=data splits over "
                                 f"{self.layout.num_processes} processes: raise data.min_examples_per_client or "
                                 "lower client.batch_size")
            alpha = cfg.lora.alpha_ratio * ranks[k]
            self.clients.append(ClientData(k, ranks[k], lora_scale(alpha, ranks[k], cfg.lora.use_rslora),
                                           train, test, len(train)))
        for stat, c in zip(self.partition_stats, self.clients, strict=True):
            stat.update({"rank": c.rank, "train": len(c.train), "test": len(c.test)})

    def write_run_files(self) -> None:
        if not self.acc.is_main_process:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        ckpt.atomic_write_text(self.run_dir / "partition.json", json.dumps(self.partition_stats, indent=1))
        for s in self.partition_stats:
            log.info("client %d: rank %d, %d train / %d test examples, categories %s",
                     s["client"], s["rank"], s["train"], s["test"], s["categories"])

    # ------------------------------------------------------------- training
    def local_steps(self, client: ClientData) -> int:
        c = self.cfg.client
        if c.local_steps_per_client:
            return c.local_steps_per_client[client.client_id % len(c.local_steps_per_client)]
        if c.local_steps:
            return c.local_steps
        return max(1, math.ceil(c.local_epochs * len(client.train) / (c.batch_size * c.grad_accum)))

    def download_numel(self, client: ClientData) -> int:
        """Parameters ``client`` downloads this round (same on every process)."""
        start = self.strategy.client_start(self.state, client.rank, client.scale, self.last_merged,
                                           client_id=client.client_id)
        params = adapter_params(self.model, adapter_name(client.rank))
        dense = sum(t.numel() for t in self.state.dense.values())
        return start.numel() + dense + self.algorithm.download_numel(params)

    def load_client(self, client: ClientData, round_idx: int):
        """Switch ``client`` in: its adapter active, loaded with what it downloads.

        Returns its trainable parameters by name, the fresh init (the shapes
        its update is checked against) and the factors it started from (for
        norm clipping). Only factors and dense modules move; the base stays.
        """
        cfg = self.cfg
        name = adapter_name(client.rank)
        activate(self.model, name)
        set_trainable_modules(self.model, cfg.lora.trainable_modules)
        restore_dequant_layers(self.model)  # the packed CPU 4-bit kernel has no backward
        start = self.strategy.client_start(self.state, client.rank, client.scale, self.last_merged,
                                           client_id=client.client_id)
        with self.whole_adapters(modify=True):
            fresh = fresh_factors(self.model, name, derive_seed(cfg.federation.seed, round_idx, 7))
            factors = revive_empty_directions(start.factors, fresh) if start.factors else fresh
            write_factors(self.model, name, factors)
            write_dense(self.model, self.state.dense)
        params = adapter_params(self.model, name)
        params.update({module_key(k): p for k, p in self.model.named_parameters()
                       if p.requires_grad and "lora_" not in k})
        return params, fresh, factors

    def whole_adapters(self, modify: bool = False):
        """Context in which every LoRA and dense tensor is whole on this process (ZeRO-3 shards them)."""
        params = [p for n, p in self.model.named_parameters() if "lora_" in n or module_key(n) in self.dense_names]
        return full_tensors(self.layout, params, modify)

    def open_mixture(self, client: ClientData, own_router: bool) -> MixtureSession | None:
        """The client's router hooks (FLoRAL); ``own_router=False`` gives the uniform mixture."""
        if self.mixture is None:
            return None
        router = None
        if own_router and (self.mixture.stateful or not self.model.training):
            router = {k[len("router."):]: v for k, v in client.state.items() if k.startswith("router.")} or None
        start = self.strategy.client_start(self.state, client.rank, client.scale, self.last_merged, client.client_id)
        biases = {k[len("bias."):]: v for k, v in start.extras.items() if k.startswith("bias.")}
        return MixtureSession(self.model, adapter_name(client.rank), self.mixture, router, biases)

    def plan_for(self, client: ClientData, round_idx: int) -> LocalPlan:
        cfg = self.cfg
        return LocalPlan(
            round=round_idx, client_id=client.client_id, steps=self.local_steps(client),
            seed=derive_seed(cfg.federation.seed, round_idx, client.client_id, 11), lr=cfg.client.lr,
            sgd_lr=cfg.client.sgd_lr,
            batch_size=cfg.client.batch_size, grad_accum=cfg.client.grad_accum, scheduler=cfg.client.scheduler,
            warmup_ratio=cfg.client.warmup_ratio, weight_decay=cfg.client.weight_decay,
            max_grad_norm=cfg.client.max_grad_norm, layout=self.layout,
            # stopped between steps; not in the data layout, where every process must take every step
            deadline=(time.monotonic() + cfg.federation.client_timeout_s
                      if cfg.federation.client_timeout_s and not self.layout.data_parallel else None),
            progress=self.quiet() is None,
        )

    def train_client(self, client: ClientData, round_idx: int) -> ClientUpdate:
        """Load the client's start, run its algorithm, read back its update."""
        cfg = self.cfg
        name = adapter_name(client.rank)
        params, fresh, start = self.load_client(client, round_idx)
        plan = self.plan_for(client, round_idx)
        algo_state = {k[len("algo."):]: v for k, v in client.state.items() if k.startswith("algo.")}
        client_state = {k: v for k, v in client.state.items() if not k.startswith("algo.")}
        self.model.train()
        session = self.open_mixture(client, own_router=self.mixture is not None and self.mixture.stateful)
        if session is not None:  # the router is the client's own: trained, never corrected, pulled or uploaded
            plan.local_params, plan.local_lr = session.params(), self.mixture.router_lr
            params.update(session.bias_params())  # bias adaptors are shared like the LoRA adaptors
        t0 = time.perf_counter()
        batches = batch_stream(client.train, plan.batch_size, self.tokenizer.pad_token_id, plan.seed)
        if self.layout.data_parallel:
            batches = self.layout.split_batches(batches)
        try:
            result = self.algorithm.train(self.model, params, batches, plan, self.acc, algo_state)
        finally:
            if session is not None:
                session.close()
        client_state.update({f"algo.{k}": v for k, v in algo_state.items()})
        if session is not None:
            result.extras.update(session.upload())
            client_state.update({f"router.{g}": t for g, t in session.router_state().items()})
        with self.whole_adapters():
            factors, dense = read_factors(self.model, name), read_dense(self.model, self.dense_names)
        log.info("round %d, client %d (rank %d): %d steps, loss %.4f -> %.4f, %.1f s", round_idx, client.client_id,
                 client.rank, plan.steps, result.losses[0], result.losses[-1], time.perf_counter() - t0)
        update = ClientUpdate(
            client.client_id, client.num_examples, factors, dense, result.extras,
            {"loss_first": result.losses[0], "loss_last": result.losses[-1], "loss_mean": result.mean_loss,
             "train_s": time.perf_counter() - t0, "steps": plan.steps},
            client_state,
            start,
        )
        if self.client_hook is not None:
            update = self.client_hook(round_idx, client.client_id, update)
        timeout = cfg.federation.client_timeout_s
        if timeout and update.metrics["train_s"] > timeout:
            raise ClientFailure(f"ran {update.metrics['train_s']:.1f}s, past federation.client_timeout_s={timeout}")
        validate_update(update, fresh)
        return update

    def run_round(self, round_idx: int) -> dict:
        cfg = self.cfg
        self.ledger.start_round()
        sampled = sample_clients(cfg, round_idx)
        drop_rng = random.Random(derive_seed(cfg.federation.seed, round_idx, 2))
        n_drop = round(cfg.federation.dropout * len(sampled))
        dropped = sorted(drop_rng.sample(sampled, n_drop)) if n_drop else []
        active = [k for k in sampled if k not in dropped]
        mine = self.layout.my_clients(active)
        for k in active:
            self.ledger.download(k, self.download_numel(self.clients[k]))
        t0 = time.perf_counter()
        results: list[tuple[int, ClientUpdate | None, str]] = []
        for k in tqdm(mine, desc=f"round {round_idx} clients", leave=False, disable=self.quiet()):
            try:
                results.append((k, self.train_client(self.clients[k], round_idx), ""))
            except Exception as e:  # a faulty client must not take the round down
                log.warning("round %d: client %d left out: %s", round_idx, k, e)
                log.debug("client %d traceback", k, exc_info=True)
                results.append((k, None, f"{type(e).__name__}: {e}"))
        results = self._gather(results)
        train_s = time.perf_counter() - t0
        updates = [u for _, u, _ in results if u is not None]
        failures = {str(k): why for k, u, why in results if u is None}
        for u in updates:
            self.ledger.upload(u.client_id, u.numel())
            self.clients[u.client_id].state = u.client_state
        t1 = time.perf_counter()
        info: dict[str, Any] = {}
        if cfg.aggregation.clip_norm_ratio and updates:
            info["clipped"] = clip_updates(updates, cfg.aggregation.clip_norm_ratio, self.state.dense)
        skipped = len(updates) < cfg.federation.min_clients
        if skipped:
            log.warning("round %d skipped: %d valid update(s) < federation.min_clients = %d",
                        round_idx, len(updates), cfg.federation.min_clients)
            self.last_merged = {}
        else:
            updates.sort(key=lambda u: u.client_id)
            result = self.strategy.aggregate(updates, self.state)
            self.updated_rounds += 1
            self.algorithm.server_update(updates, sum(c.num_examples for c in self.clients))
            self.state, self.last_merged = result.state, result.merged
            info.update(result.info)
            if self.last_merged:
                self.absorb(self.last_merged)
        agg_s = time.perf_counter() - t1
        losses = [u.metrics["loss_mean"] for u in updates]
        return {
            "round": round_idx, "sampled": sampled, "dropped": dropped, "failed": failures,
            "n_updates": len(updates), "skipped": skipped,
            "train_loss": sum(losses) / len(losses) if losses else None,
            "client_loss": {str(u.client_id): [u.metrics["loss_first"], u.metrics["loss_last"]] for u in updates},
            **{f"agg_{k}": v for k, v in info.items()},
            "n_failed": len(failures), "n_dropped": len(dropped),
            **self.ledger.round_summary(),
            "time_train_s": train_s, "time_aggregate_s": agg_s,
        }

    def absorb(self, merged: Adapter) -> None:
        """Make ``merged`` part of every later forward pass.

        Full-precision bases take it into their weights; a quantized base keeps
        the whole cumulative residual (``state.residual``) as a frozen adapter
        that stays active under every client's adapter.
        """
        if self.residual_adapter:
            with self.whole_adapters(modify=True):
                self.residual_rank = install_residual(self.model, self.state.residual, self.cfg.lora)
        else:
            merge_into_base(self.model, merged)

    def _gather(self, results):
        if not self.layout.gathers:  # one process, or data mode: every process has every result
            return results
        from accelerate.utils import gather_object

        merged = gather_object([results])
        flat = [r for part in merged for r in part]
        return sorted(flat, key=lambda r: r[0])

    # ----------------------------------------------------------- evaluation
    def install_global(self) -> bool:
        """Make the global model active for evaluation; False when it is the (merged) base."""
        adapter = self.strategy.global_adapter(self.state)
        with self.whole_adapters(modify=True):
            write_dense(self.model, self.state.dense)
            if adapter:
                install_adapter(self.model, "global", adapter, self.cfg.lora,
                                biases=self.strategy.global_biases(self.state))
        if adapter:
            activate(self.model, "global")
            return True
        if RESIDUAL in self.model.peft_config:
            activate(self.model, RESIDUAL)
            return True
        return False

    @torch.no_grad()
    def heldout(self, data: list[TokenizedExample]) -> tuple[float | None, float | None]:
        """Mean response-token loss, and accuracy of the first response token."""
        if not data:
            return None, None
        total, tokens, hits = 0.0, 0, 0
        bs = self.cfg.eval.batch_size
        for i in range(0, len(data), bs):
            batch = {k: v.to(self.acc.device) for k, v in collate(data[i:i + bs], self.tokenizer.pad_token_id).items()}
            out = self.model(**batch)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += out.loss.item() * n
            tokens += n
            labels = batch["labels"]
            first = (labels != -100).int().argmax(1)
            rows = torch.arange(labels.shape[0], device=labels.device)
            hits += int((out.logits[rows, first - 1].argmax(-1) == labels[rows, first]).sum())
        return total / tokens, hits / len(data)

    def personalized(self, round_idx: int) -> dict:
        """Each client's test data: the global model, then the global model + k local steps."""
        steps = self.cfg.client.personalize_steps
        rows = {}
        for client in self.layout.my_clients(self.clients):
            if not client.test:
                continue
            params, _, _ = self.load_client(client, round_idx + 1)
            self.model.eval()
            uniform = self.open_mixture(client, own_router=False)
            g_loss, g_acc = self.heldout(client.test)
            if uniform is not None:  # FLoRAL: the client's own router is its personalization
                uniform.close()
                own = self.open_mixture(client, own_router=True)
                p_loss, p_acc = self.heldout(client.test)
                own.close()
            else:
                plan = self.plan_for(client, round_idx + 1)
                batches = batch_stream(client.train, plan.batch_size, self.tokenizer.pad_token_id, plan.seed + 1)
                self.algorithm.personalize(self.model, params, batches, steps, plan, self.acc)
                p_loss, p_acc = self.heldout(client.test)
            rows[str(client.client_id)] = {"global_loss": g_loss, "global_acc": g_acc,
                                           "personal_loss": p_loss, "personal_acc": p_acc}
        if self.layout.gathers:
            from accelerate.utils import gather_object

            rows = {k: v for part in gather_object([rows]) for k, v in part.items()}
        if not rows:
            return {}

        def mean(key: str) -> float:
            return sum(r[key] for r in rows.values()) / len(rows)

        return {"personal": rows, "global_client_acc": mean("global_acc"), "personal_acc": mean("personal_acc"),
                "global_client_loss": mean("global_loss"), "personal_loss": mean("personal_loss")}

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        has_adapter = self.install_global()
        ctx = torch.no_grad() if has_adapter else self.model.disable_adapter()
        out: dict[str, Any] = {}
        # ZeRO-3: every process runs every forward pass (weights are gathered layer by layer)
        lockstep = self.layout.zero_stage == 3
        with ctx, evaluation_engine(self.acc, self.layout, self.model, self.cfg.eval.batch_size):
            out["eval_loss"], out["eval_token_acc"] = self.heldout(self.eval_data)
            if self.benchmark is not None:
                result, _ = mmlu_evaluate(self.model, self.tokenizer, self.benchmark,
                                          batch_size=self.cfg.eval.batch_size,
                                          accelerator=None if lockstep else self.acc)
                out["accuracy"] = result["accuracy"]
                out["accuracy_categories"] = result["categories"]
        out["time_eval_s"] = time.perf_counter() - t0
        return out

    def quiet(self) -> bool | None:
        """tqdm's ``disable``: bars on the main process's terminal only (None: tqdm checks for a TTY)."""
        return None if self.acc.is_main_process else True

    def elapsed(self) -> float:
        """Seconds this run has spent so far, over every attempt (resumes add to it)."""
        return self.wall_before + time.perf_counter() - self.t_start

    # -------------------------------------------------------- checkpointing
    def checkpoint(self, round_idx: int) -> None:
        if not self.acc.is_main_process or not self.cfg.output.save_every_round:
            return
        tensors, scales = ckpt.adapter_tensors(self.state.factors, "global.")
        t2, s2 = ckpt.adapter_tensors(self.state.residual, "residual.")
        t3, s3 = ckpt.adapter_tensors(self.last_merged, "merged.")
        tensors.update(t2)
        tensors.update(t3)
        scales.update(s2)
        scales.update(s3)
        tensors.update({f"dense.{k}": v for k, v in self.state.dense.items()})
        tensors.update({f"extra.{k}": v for k, v in self.state.extras.items() if isinstance(v, torch.Tensor)})
        tensors.update({f"algo.{k}": v for k, v in self.algorithm.server_state().items()})
        for c in self.clients:
            tensors.update({f"client.{c.client_id}.{k}": v for k, v in c.state.items()})
        meta = {"round": round_idx, "scales": scales, "ledger": self.ledger.state(), "strategy": self.strategy.name,
                "seed": self.cfg.federation.seed, "rng": "derived from (seed, round, client)",
                "wall_s": self.elapsed(), "updated": self.updated_rounds}
        ckpt.save_checkpoint(self.run_dir, round_idx, tensors, meta)
        ckpt.prune_checkpoints(self.run_dir, keep=self.cfg.output.keep_checkpoints)

    def restore(self) -> None:
        """Continue after the newest intact checkpoint of ``run_dir`` (a damaged newer one is passed over)."""
        found = ckpt.load_latest(self.run_dir)
        if found is None:
            log.info("no checkpoint in %s: starting from round 1", self.run_dir)
            return
        path, tensors, meta = found
        if meta["strategy"] != self.strategy.name:
            raise ckpt.CheckpointError(f"{path}: written by strategy {meta['strategy']!r}, "
                                       f"config says {self.strategy.name!r}")
        self.state = GlobalState(
            ckpt.adapter_from_tensors(tensors, meta["scales"], "global."),
            ckpt.adapter_from_tensors(tensors, meta["scales"], "residual."),
            {k[len("dense."):]: v for k, v in tensors.items() if k.startswith("dense.")} or self.state.dense,
            {k[len("extra."):]: v for k, v in tensors.items() if k.startswith("extra.")},
        )
        self.last_merged = ckpt.adapter_from_tensors(tensors, meta["scales"], "merged.")
        self.algorithm.load_server_state({k[len("algo."):]: v for k, v in tensors.items() if k.startswith("algo.")})
        for c in self.clients:
            prefix = f"client.{c.client_id}."
            c.state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if self.state.residual:
            self.absorb(self.state.residual)
        self.ledger = Ledger.from_state(meta["ledger"])
        self.start_round = meta["round"] + 1
        self.wall_before = meta.get("wall_s", 0.0)
        self.updated_rounds = meta.get("updated", meta["round"])
        log.info("resuming %s after round %d", self.run_dir, meta["round"])

    # ------------------------------------------------------------------ run
    def log_metrics(self, row: dict) -> None:
        if self.acc.is_main_process:
            ckpt.append_line(self.metrics_path, json.dumps(row))
            scalars = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            if self.cfg.output.log_with:
                self.acc.log(scalars, step=row["round"])

    def run(self, resume: bool = False) -> dict:
        cfg = self.cfg
        if cfg.output.log_with:
            self.acc.init_trackers("fedllm", config=_flat_config(cfg))
        rows: list[dict] = []
        if resume:
            self.restore()
            rows = [r for r in ckpt.read_jsonl(self.metrics_path) if r["round"] < self.start_round]
            if self.acc.is_main_process:
                ckpt.atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
        else:
            self.write_run_files()
        self.t_start = time.perf_counter()
        if not rows:  # the evaluation before round 1 (kept from the first attempt when there was one)
            row = {"round": 0, **self.evaluate()}
            self.log_metrics(row)
            log.info("before round 1: eval loss %s, accuracy %s", _fmt(row.get("eval_loss")),
                     _fmt(row.get("accuracy")))
        for r in tqdm(range(self.start_round, cfg.federation.rounds + 1), desc="rounds", disable=self.quiet()):
            row = self.run_round(r)
            if r % cfg.eval.every == 0 or r == cfg.federation.rounds:
                row.update(self.evaluate())
                if cfg.eval.personalized:
                    row.update(self.personalized(r))
            row["cumulative"] = {k: v for k, v in self.ledger.totals().items() if k != "per_client"}
            self.log_metrics(row)
            self.checkpoint(r)
            log.info("round %d: train loss %s, eval loss %s, accuracy %s, up %d / down %d params",
                     r, _fmt(row["train_loss"]), _fmt(row.get("eval_loss")), _fmt(row.get("accuracy")),
                     row["up_params"], row["down_params"])
        summary = self.finish(self.elapsed())
        if cfg.output.log_with:
            self.acc.end_training()
        return summary

    def finish(self, wall_s: float) -> dict:
        from fedllm.export import save_global_adapter

        rows = ckpt.read_jsonl(self.metrics_path) if self.acc.is_main_process else []
        summary: dict[str, Any] = {"run_dir": str(self.run_dir), "strategy": self.strategy.name,
                                   "algorithm": self.algorithm.name, "rounds": self.cfg.federation.rounds,
                                   "ranks": [c.rank for c in self.clients], "wall_s": wall_s,
                                   "processes": self.acc.num_processes, "parallel": self.layout.mode,
                                   "benchmark": self.benchmark.source if self.benchmark is not None else None,
                                   "mixed_precision": str(self.acc.mixed_precision)}
        if self.layout.deepspeed:
            summary["deepspeed_zero_stage"] = self.layout.zero_stage
        evals = [r for r in rows if "accuracy" in r or "eval_loss" in r]
        if evals:
            summary.update({
                "loss_before": evals[0].get("eval_loss"), "loss_after": evals[-1].get("eval_loss"),
                "accuracy_before": evals[0].get("accuracy"), "accuracy_after": evals[-1].get("accuracy"),
                "accuracy_best": max((r["accuracy"] for r in evals if r.get("accuracy") is not None), default=None),
            })
        summary["communication"] = self.ledger.totals()
        summary["failed_client_calls"] = sum(len(r.get("failed", {})) for r in rows)
        summary["skipped_rounds"] = [r["round"] for r in rows if r.get("skipped")]
        if self.cfg.model.quantization != "none":
            summary["quantization"] = self.cfg.model.quantization
            kernel = getattr(self.model.get_base_model(), "fedllm_cpu_4bit_kernel", None)
            if kernel:
                summary["quant_cpu_kernel"] = kernel
        if self.residual_adapter:
            why = (f"the base is {self.cfg.model.quantization}-quantized" if self.cfg.model.quantization != "none"
                   else "DeepSpeed ZeRO-3 shards the base weights")
            summary["residual_adapter_rank"] = self.residual_rank
            summary["note"] = (f"{why}, so the merged global update is kept as a frozen residual adapter (rank "
                               f"{self.residual_rank}) instead of being written into the base weights; the exported "
                               "adapter holds it")
        elif self.strategy.merges_into_base:
            summary["note"] = "the global update is merged into the base; the exported adapter holds the residual"
        summary["global_adapter"] = str(self.run_dir / "global_adapter") if self.updated_rounds else None
        if not self.updated_rounds:
            log.error("no round produced a global update (all %d were skipped): no adapter is written",
                      self.cfg.federation.rounds)
        if self.acc.is_main_process:
            if self.updated_rounds:
                save_global_adapter(self, self.run_dir / "global_adapter")
            ckpt.atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        self.acc.wait_for_everyone()
        return summary


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


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _flat_config(cfg: Config) -> dict:
    flat = {}
    for section, values in dataclasses.asdict(cfg).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, int | float | str | bool) else str(v)
    return flat
