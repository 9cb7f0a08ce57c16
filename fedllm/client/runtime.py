"""The client runtime: one base model, one adapter per rank, clients switched in from their ClientStart.

It hosts many simulated clients on one base (a client is only its factors,
its data and its state: switching one in costs milliseconds, never a model
load) or exactly one real site (Flower). ``train`` takes a client's
:class:`~fedllm.protocol.ClientStart`, runs the client algorithm and returns
its :class:`~fedllm.protocol.ClientUpdate`; nothing else crosses to the
server. What stays on the client lives here: the algorithm's state (SCAFFOLD's
c_k, under ``algo.``), the strategy's client-side state (FLoRAL's router,
under ``hook.``) and the merges applied to the base (FLoRA/FLoRIST), which a
4/8-bit base (or ZeRO-3) keeps as a frozen residual adapter because its
weights cannot absorb them.

The strategy's client side is a :class:`~fedllm.protocol.ClientHook` handed in
by the assembly; the runtime calls it and never asks which strategy it serves.

Where tensors live: the server, every message and every client's state are on
the CPU; the model (and what is computed from it) is on the launch's device.
Tensors cross at two places only: when a client is switched in
(``write_factors``/``write_dense`` copy its download onto the device; an
algorithm's ``begin`` moves its downloaded and kept state there) and when its
update is read out (``read_factors``/``read_dense``, the algorithm's
``finish`` and the hook session's ``upload``/``state`` return CPU tensors).
``tests/test_devices.py`` runs every algorithm and strategy with the model on
a pretend device, where any other mix raises as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from data_prep.prompts import TokenizedExample
from fedllm.client.base import ALGORITHMS, ClientAlgorithm, LocalWork, batch_stream
from fedllm.client.batched import ensure_slot, slot_name, train_together, why_not_batched_model
from fedllm.factors import (
    Adapter,
    add_to_residual,
    concat,
    dense_param_names,
    fresh_factors,
    module_key,
    module_shapes,
    prefixed,
    read_dense,
    read_factors,
    unprefixed,
    write_dense,
    write_factors,
)
from fedllm.logs import names_clients, redact
from fedllm.model.evaluation import heldout
from fedllm.model.modeling import (
    RESIDUAL,
    activate,
    adapter_name,
    adapter_params,
    attach_lora,
    install_adapter,
    install_residual,
    merge_into_base,
    restore_dequant_layers,
    set_trainable_modules,
)
from fedllm.model.parallel import Layout, full_tensors
from fedllm.protocol import (
    Catchup,
    ClientHook,
    ClientStart,
    ClientUpdate,
    HookSession,
    UploadContext,
    UploadTransform,
    derive_seed,
    fit_download,
)

log = logging.getLogger(__name__)

ALGO, HOOK = "algo.", "hook."  # where a client's state keeps its algorithm's and its strategy's part
PENDING, PENDING_ROUND = "pending.", "pending-round"  # algorithm state that waits for the server's acceptance


@dataclass
class ClientData:
    """A client as its runtime holds it: data, adapter rank (FLoRAL: C * r) and layer scale, local state."""

    client_id: int
    rank: int
    scale: float
    train: list[TokenizedExample]
    test: list[TokenizedExample]
    state: dict[str, Tensor] = field(default_factory=dict)  # algo.* and hook.*: never uploaded

    @property
    def num_examples(self) -> int:
        return len(self.train)


@dataclass
class TrainingJob:
    """One client switched in for training: what its algorithm trains and what its update is read from."""

    client: ClientData
    start: ClientStart
    adapter: str  # the peft adapter it trains in (its rank's, or a client-batched slot)
    params: dict[str, torch.nn.Parameter]
    started: Adapter  # the factors it started from
    work: LocalWork
    algo_state: dict[str, Tensor]
    session: HookSession | None
    batches: Iterator[dict[str, Tensor]]


def round_lr(lr: float, lr_min: float, schedule: str, round_idx: int, rounds: int) -> float:
    """The AdamW learning rate of round ``round_idx``: ``client.lr`` every round (constant), or annealed
    over the rounds from ``client.lr`` towards ``client.lr_min`` as FlowerTune's templates do
    (``cosine_annealing``: lr_min + (lr - lr_min) (1 + cos(pi r / R)) / 2, so round R trains at lr_min)."""
    if schedule == "constant":
        return lr
    return lr_min + 0.5 * (lr - lr_min) * (1 + math.cos(math.pi * round_idx / max(rounds, 1)))


class ClientRuntime:
    """See module docstring. ``ranks`` are the adapter ranks its clients train (one peft adapter per rank)."""

    def __init__(
        self,
        *,
        model,
        tokenizer,
        ranks: list[int],
        lora_cfg,
        client_cfg,
        seed: int,
        layout: Layout,
        accelerator,
        hook: ClientHook | None = None,
        residual_merges: bool = False,
        client_timeout_s: float = 0.0,
        progress: bool = False,
        transforms: list[UploadTransform] | None = None,
        rounds: int = 1,
    ) -> None:
        self.tokenizer, self.lora_cfg, self.client_cfg = tokenizer, lora_cfg, client_cfg
        self.rounds = rounds  # federation.rounds: the span of client.round_schedule
        self.seed, self.layout, self.acc = seed, layout, accelerator
        self.hook = hook or ClientHook()
        self.client_timeout_s, self.progress = client_timeout_s, progress
        self.model = attach_lora(model, ranks, lora_cfg)
        self.algorithm: ClientAlgorithm = ALGORITHMS[client_cfg.algorithm].from_config(client_cfg)
        self.dense_names = dense_param_names(self.model, lora_cfg.trainable_modules)
        self.residual_merges = residual_merges  # merges kept as a frozen adapter (4/8-bit base, ZeRO-3)
        self.residual: Adapter = {}  # everything merged into this base so far
        self.residual_rank = 0
        self.applied_round = 0  # merges of rounds up to this one are in the base
        self.timings: dict[str, float] = {}  # the last client's switch-in and read-out seconds (benchmarks)
        self.transforms = list(transforms or [])  # features' transforms of each upload, in order

    # ---------------------------------------------------------------- the base
    def whole_adapters(self, modify: bool = False):
        """Context in which every LoRA and dense tensor is whole on this process (ZeRO-3 shards them)."""
        params = [
            p for n, p in self.model.named_parameters() if "lora_" in n or module_key(n) in self.dense_names
        ]
        return full_tensors(self.layout, params, modify)

    def initial_dense(self) -> dict[str, Tensor]:
        """The fully trained modules as the base has them (the server's starting point)."""
        with self.whole_adapters():
            return read_dense(self.model, self.dense_names)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``{module: (out, in)}`` of the LoRA target modules, in model order (what the server must know)."""
        return module_shapes(self.model, next(iter(self.model.peft_config)))

    def merge(self, round_idx: int, update: Adapter) -> None:
        """Make ``update`` (merged by round ``round_idx``) part of every later forward pass.

        A full-precision base takes it into its weights; a quantized (or
        ZeRO-3-sharded) one keeps the whole cumulative residual as a frozen
        adapter that stays active under every client's adapter.
        """
        self.residual = add_to_residual(self.residual, update)
        if not self.residual_merges:
            merge_into_base(self.model, update)
        self._merged(round_idx)

    def reset_to(self, round_idx: int, residual: Adapter) -> None:
        """Bring the base to ``residual``, everything merged by round ``round_idx``, whatever it held."""
        if not self.residual_merges:
            if self.residual:
                merge_into_base(self.model, self.residual, sign=-1.0)
            merge_into_base(self.model, residual)
        self.residual = dict(residual)
        self._merged(round_idx)

    def _merged(self, round_idx: int) -> None:
        self.applied_round = round_idx
        if self.residual_merges and self.residual:
            with self.whole_adapters(modify=True):
                self.residual_rank = install_residual(self.model, self.residual, self.lora_cfg)

    def catch_up(self, catchup: Catchup | None) -> None:
        """Apply a download's catch-up: on top of this base when it starts where the base is, from the
        original base when it is the whole residual; nothing when the base already has it."""
        if catchup is None or catchup.to_round <= self.applied_round or not catchup.update:
            return
        if catchup.from_round == self.applied_round:
            self.merge(catchup.to_round, catchup.update)
        elif catchup.from_round == 0:
            self.reset_to(catchup.to_round, catchup.update)
        else:
            raise RuntimeError(
                f"the catch-up starts at round {catchup.from_round}, but this base has the merges up to "
                "round "
                f"{self.applied_round}: the next download will bring the whole residual"
            )

    def restore_base(self, residual: Adapter, round_idx: int) -> None:
        """A fresh base brought to a checkpoint's round: everything merged so far, at once."""
        self.reset_to(round_idx, residual)

    # ---------------------------------------------------------- one client
    def local_steps(self, client: ClientData) -> int:
        c = self.client_cfg
        if c.local_steps_per_client:
            return c.local_steps_per_client[client.client_id % len(c.local_steps_per_client)]
        if c.local_steps:
            return c.local_steps
        return max(1, math.ceil(c.local_epochs * len(client.train) / (c.batch_size * c.grad_accum)))

    def work_for(self, client: ClientData, round_idx: int) -> LocalWork:
        c = self.client_cfg
        return LocalWork(
            round=round_idx,
            client_id=client.client_id,
            steps=self.local_steps(client),
            seed=derive_seed(self.seed, round_idx, client.client_id, 11),
            lr=round_lr(c.lr, c.lr_min, c.round_schedule, round_idx, self.rounds),
            sgd_lr=c.sgd_lr,
            personalize_lr=c.personalize_lr,
            batch_size=c.batch_size,
            grad_accum=c.grad_accum,
            scheduler=c.scheduler,
            warmup_ratio=c.warmup_ratio,
            weight_decay=c.weight_decay,
            max_grad_norm=c.max_grad_norm,
            layout=self.layout,
            # stopped between steps; not in the data layout, where every process must take every step
            deadline=(
                time.monotonic() + self.client_timeout_s
                if self.client_timeout_s and not self.layout.data_parallel
                else None
            ),
            progress=self.progress,
            group_by_length=c.group_by_length,
        )

    def switch_in(self, client: ClientData, start: ClientStart, slot: str | None = None):
        """Make ``client`` the active adapter, loaded with what it downloaded; the base stays.

        Returns its trainable parameters by name and the factors it starts
        from (its fresh init where it downloads none). Algorithm state the
        client kept from its last training takes effect only if the server
        has since aggregated that update (``start.last_aggregated``), else it is
        dropped and the state before it stays.
        """
        t0 = time.perf_counter()
        client.state = settle_pending(
            client.state, start.last_aggregated, lambda old, new: self.algorithm.settle(old, new, start.algo)
        )
        self.catch_up(start.catchup)
        name = slot or adapter_name(client.rank)
        activate(self.model, name)
        set_trainable_modules(self.model, self.lora_cfg.trainable_modules)
        restore_dequant_layers(self.model)  # the packed CPU 4-bit kernel has no backward
        with self.whole_adapters(modify=True):
            fresh = fresh_factors(self.model, name, self.hook.fresh_seed(self.seed, start.round))
            factors = self.hook.start_factors(fit_download(start.factors, fresh), fresh)
            write_factors(self.model, name, factors)
            write_dense(self.model, start.dense)
        params = adapter_params(self.model, name)
        params.update(
            {
                module_key(k): p
                for k, p in self.model.named_parameters()
                if p.requires_grad and "lora_" not in k
            }
        )
        self.timings["switch_in_s"] = time.perf_counter() - t0
        return params, factors

    @contextlib.contextmanager
    def view(
        self, client: ClientData, start: ClientStart, view: str, slot: str | None = None
    ) -> Iterator[HookSession | None]:
        """The strategy's hooks on the active adapter (or ``slot``) for ``view`` ('train', 'global',
        'own'), removed after.
        """
        session = self.hook.for_round(start.round).session(
            self.model, slot or adapter_name(client.rank), unprefixed(client.state, HOOK), start.extras, view
        )
        try:
            yield session
        finally:
            if session is not None:
                session.close()

    def train(self, client: ClientData, start: ClientStart) -> ClientUpdate:
        """Switch ``client`` in from ``start``, run its algorithm, read back its update (state stays here)."""
        with contextlib.ExitStack() as stack:
            job = self.begin_training(client, start, stack)
            t0 = time.perf_counter()
            if self.layout.data_parallel:
                job.batches = self.layout.split_batches(job.batches)
            result = self.algorithm.train(
                self.model, job.params, job.batches, job.work, self.acc, job.algo_state, start.algo
            )
            train_s = time.perf_counter() - t0
            self.end_session(job, result)
        return self.finish_training(job, result, train_s)  # the hooks closed: what they leave is read

    def train_many(
        self, clients: list[ClientData], starts: list[ClientStart]
    ) -> list[ClientUpdate | Exception]:
        """Train ``clients`` together in one forward per step when they can be (``federation.client_batch``,
        fedllm/client/batched.py), else one at a time; each one's update, or the error that left it out.

        Should the joint training fail, each client is trained alone, so that one faulty client leaves
        only itself out. Its state (settled algorithm state, the strategy's client-side part, a transport's
        error-feedback residual) is put back first as it was before the batch: a client read out before the
        failing one has already written its own, and training it again on top of that would count its
        round twice.
        """
        reason = self.why_not_batched() if len(clients) > 1 else "one client"
        if reason is not None:
            if len(clients) > 1 and not getattr(self, "_said_unbatched", False):
                log.info("federation.client_batch: clients train one at a time: %s", reason)
                self._said_unbatched = True
            return [self._train_or_error(c, s) for c, s in zip(clients, starts, strict=True)]
        before = [{k: v.clone() for k, v in c.state.items()} for c in clients]
        try:
            with contextlib.ExitStack() as stack:
                jobs = []
                for i, (client, start) in enumerate(zip(clients, starts, strict=True)):
                    slot = slot_name(i, client.rank)
                    ensure_slot(self.model, slot, client.rank, self.lora_cfg)
                    jobs.append(self.begin_training(client, start, stack, slot))
                for job in jobs:  # a later switch-in made only its own slot trainable
                    for p in job.params.values():
                        p.requires_grad_(True)
                algos = [copy.copy(self.algorithm) for _ in jobs]  # each client's own anchors and variates
                results = train_together(self.model, self.tokenizer.pad_token_id, jobs, algos, self.acc)
                for job, (result, _) in zip(jobs, results, strict=True):
                    self.end_session(job, result)
            return [self.finish_training(j, r, s) for j, (r, s) in zip(jobs, results, strict=True)]
        except Exception as e:
            log.warning(
                "client-batched training failed (%s: %s); training each client alone",
                type(e).__name__,
                redact(str(e)),
            )
            for client, state in zip(clients, before, strict=True):
                client.state = state
            return [self._train_or_error(c, s) for c, s in zip(clients, starts, strict=True)]

    def why_not_batched(self) -> str | None:
        """None when this runtime's clients can train together (``federation.client_batch``), else why not
        (one line)."""
        if not self.algorithm.batchable:
            return f"client.algorithm={self.algorithm.name} takes several forwards per local step"
        if self.hook.local_params:
            return "the strategy's clients train parameters of their own (FLoRAL's routers)"
        if self.dense_names:
            return "lora.trainable_modules are trained by every client (one shared copy)"
        if self.layout.data_parallel or self.layout.deepspeed:
            return (
                "the data layout splits each client's batches over processes (or DeepSpeed wraps the model)"
            )
        if self.client_timeout_s:
            return "federation.client_timeout_s stops clients one by one"
        return why_not_batched_model(self.model)

    def _train_or_error(self, client: ClientData, start: ClientStart) -> ClientUpdate | Exception:
        try:
            return self.train(client, start)
        except Exception as e:  # a faulty client must not take the round down
            return e

    def log_client(self, msg: str, *args) -> None:
        """A per-client line: INFO for a few clients a round, DEBUG above ``quiet_above`` (the round line
        summarizes them); none while the round's clients may not be named (a secret sample: its rank and
        losses would name it too)."""
        if not names_clients():
            return
        log.log(logging.DEBUG if self.clients_per_round > self.quiet_above else logging.INFO, msg, *args)

    clients_per_round = 0  # set by the driver each round
    quiet_above = 20

    def begin_training(
        self, client: ClientData, start: ClientStart, stack: contextlib.ExitStack, slot: str | None = None
    ) -> TrainingJob:
        """``client`` switched into its adapter (or ``slot``) with the strategy's training hooks open on
        ``stack``: its trainable parameters, local work, algorithm state and batches."""
        params, started = self.switch_in(client, start, slot)
        work = self.work_for(client, start.round)
        algo_state = unprefixed(client.state, ALGO)
        self.model.train()
        session = stack.enter_context(self.view(client, start, "train", slot))
        if session is not None:  # client-only parameters: trained, never corrected, pulled or uploaded
            work = session.local_work(work)
            work.local_params, work.local_lr = session.local_params(), session.local_lr
            work.local_optimizer = session.local_optimizer
            params = trained_params(params, session)  # FFA-LoRA freezes A; Fed-SB trains R
        batches = batch_stream(
            client.train, work.batch_size, self.tokenizer.pad_token_id, work.seed, work.group_by_length
        )
        adapter = slot or adapter_name(client.rank)
        return TrainingJob(client, start, adapter, params, started, work, algo_state, session, batches)

    def end_session(self, job: TrainingJob, result) -> None:
        """What the strategy's hooks upload and keep, read while they are still open."""
        if job.session is not None:
            result.extras.update(job.session.upload())
            state = job.session.state()
            job.client.state = {**prefixed(state, HOOK), **without_prefix(job.client.state, HOOK)}

    def finish_training(self, job: TrainingJob, result, train_s: float) -> ClientUpdate:
        """The update of a trained ``job``, read once its hooks are closed (HetLoRA's zeroes its pruned
        tail as it closes)."""
        client, start, work = job.client, job.start, job.work
        client.state = keep_pending(client.state, job.algo_state, start.round)
        t1 = time.perf_counter()
        with self.whole_adapters():
            trained, dense = read_factors(self.model, job.adapter), read_dense(self.model, self.dense_names)
        tenth = max(1, len(result.losses) // 10)
        first, last = result.losses[:tenth], result.losses[-tenth:]
        self.log_client(
            "round %d, client %d (rank %d): %d steps, loss %.4f -> %.4f (mean of the first and last 10%% of "
            "steps), %.1f s",
            start.round,
            client.client_id,
            client.rank,
            work.steps,
            sum(first) / len(first),
            sum(last) / len(last),
            train_s,
        )
        update = ClientUpdate(
            client_id=client.client_id,
            num_examples=client.num_examples,
            factors=self.hook.for_round(start.round).outgoing(trained),  # what stays here travels empty
            dense=dense,
            extras=result.extras,
            metrics={
                "loss_first": result.losses[0],
                "loss_last": result.losses[-1],
                "loss_mean": result.mean_loss,
                "train_s": train_s,
                "steps": work.steps,
            },
            round=start.round,
            token=start.token,
        )
        ctx = UploadContext(start, job.started, client.state, self.hook.shared_extras)
        for transform in self.transforms:
            update = transform.apply(update, ctx)
        self.timings["read_out_s"] = time.perf_counter() - t1
        return update

    # ------------------------------------------------------- evaluation
    def install_global(self, adapter: Adapter, dense: dict[str, Tensor], biases: dict[str, Tensor]) -> bool:
        """Make the global model active for evaluation; False when it is the (merged) base itself."""
        with self.whole_adapters(modify=True):
            write_dense(self.model, dense)
            if adapter:
                install_adapter(self.model, "global", adapter, self.lora_cfg, biases=biases)
        if adapter:
            activate(self.model, "global")
            return True
        if RESIDUAL in self.model.peft_config:
            activate(self.model, RESIDUAL)
            return True
        return False

    def is_base(self, adapter: Adapter, dense: dict[str, Tensor], biases: dict[str, Tensor]) -> bool:
        """Whether this global model computes exactly what the base does: no residual merged in, no bias,
        every adapter's product zero (one factor all zeros: peft's B at the start, FedSVD's too) and the
        dense modules the base's own values."""
        if RESIDUAL in self.model.peft_config or biases:
            return False
        if any(bool(f.A.count_nonzero()) and bool(f.B.count_nonzero()) for f in adapter.values()):
            return False
        base = self.initial_dense() if dense else {}
        return all(torch.equal(v.to(base[k].device), base[k]) for k, v in dense.items())

    def personalized(
        self, client: ClientData, start: ClientStart, batch_size: int
    ) -> dict[str, float | None]:
        """``client``'s test data scored by the global model, then by its personalization of it.

        A strategy whose client side personalizes (FLoRAL: the client's own
        router against the uniform mixture) gives both models; for the others
        the personalization is ``client.personalize_steps`` plain SGD steps on
        the client's own training data, on what its training trains (the
        hook's training view: FFA-LoRA's B, Fed-SB's R); with none, the
        personalized model is the global one.
        """
        params, _ = self.switch_in(client, start)
        self.model.eval()
        with self.view(client, start, "global"):
            g_loss, g_acc = heldout(self.model, self.tokenizer, client.test, batch_size)
        if self.hook.personalizes:
            with self.view(client, start, "own"):
                p_loss, p_acc = heldout(self.model, self.tokenizer, client.test, batch_size)
        elif self.client_cfg.personalize_steps == 0:
            # no view of its own and no personalization steps: the client's model is the global one as it
            # gets it, already scored (a second pass would cost as much again)
            p_loss, p_acc = g_loss, g_acc
        else:  # the personalization steps train what the client's training trains (the hook's train view)
            with self.view(client, start, "train") as session:
                self.personalize(client, start, trained_params(params, session))
                p_loss, p_acc = heldout(self.model, self.tokenizer, client.test, batch_size)
        return {"global_loss": g_loss, "global_acc": g_acc, "personal_loss": p_loss, "personal_acc": p_acc}

    def personalize(self, client: ClientData, start: ClientStart, params) -> None:
        work = self.work_for(client, start.round)
        batches = batch_stream(
            client.train, work.batch_size, self.tokenizer.pad_token_id, work.seed + 1, work.group_by_length
        )
        self.algorithm.personalize(
            self.model, params, batches, self.client_cfg.personalize_steps, work, self.acc
        )

    def personalized_adapter(
        self, client: ClientData, start: ClientStart
    ) -> tuple[Adapter, dict[str, Tensor], dict[str, Tensor]]:
        """A client's personalized model as one adapter (merges included), its dense modules and LoRA
        biases.
        """
        params, _ = self.switch_in(client, start)
        self.model.eval()
        view = "own" if self.hook.personalizes else "train"  # else: personalized as in personalized()
        with self.view(client, start, view) as session:
            if not self.hook.personalizes:
                self.personalize(client, start, trained_params(params, session))
            mine = read_factors(self.model, adapter_name(client.rank))
            mine, biases = session.bake(mine) if session is not None else (mine, {})
        return concat(mine, self.residual), read_dense(self.model, self.dense_names), biases


def trained_params(params: dict, session: HookSession | None) -> dict:
    """The parameters a client trains in ``session``: its adapter's and dense modules', the session's shared
    ones (Fed-SB's R), less what the session froze (FFA-LoRA's A)."""
    if session is None:
        return params
    return {k: p for k, p in {**params, **session.shared_params()}.items() if p.requires_grad}


def keep_pending(
    state: dict[str, Tensor], algo_state: dict[str, Tensor], round_idx: int
) -> dict[str, Tensor]:
    """``state`` with the algorithm's new state waiting beside the old one until the server has taken the
    update of ``round_idx`` (a stateless algorithm leaves the client without state: no file to keep)."""
    if not algo_state:
        return state
    return {
        **{k: v for k, v in state.items() if not k.startswith((PENDING, PENDING_ROUND))},
        **prefixed(algo_state, PENDING),
        PENDING_ROUND: torch.tensor(round_idx),
    }


def settle_pending(state: dict[str, Tensor], last_aggregated: int, settle=None) -> dict[str, Tensor]:
    """A client's state once the server's word on its last update is in.

    The pending algorithm state replaces the current one if that update's
    round was aggregated (``last_aggregated`` >= it), as ``settle(old, new)`` says
    (the algorithm's own rule; default: the new one); else it is dropped.
    """
    if PENDING_ROUND not in state:
        return state
    kept = {k: v for k, v in state.items() if not k.startswith((PENDING, PENDING_ROUND))}
    if last_aggregated >= int(state[PENDING_ROUND]):
        new = unprefixed(state, PENDING)
        if settle is not None:
            new = settle(unprefixed(kept, ALGO), new)
        kept = {**without_prefix(kept, ALGO), **prefixed(new, ALGO)}
    return kept


def without_prefix(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of ``state`` that are not under ``prefix`` (the other owners' parts of a client's
    state).
    """
    return {k: v for k, v in state.items() if not k.startswith(prefix)}
