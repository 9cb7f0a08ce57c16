"""The local-training protocol shared by every client algorithm.

A client is only its data, its adapter factors and its optimizer state: the
base model is shared by all clients of a process and never copied. The round
loop loads the client's starting factors into the adapter of the client's
rank, then calls :meth:`ClientAlgorithm.train`. Algorithms differ in how one
local step is taken (:meth:`ClientAlgorithm.local_step`) and in what they
upload besides the adapter; the loop around the steps is written once here.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from data_prep.prompts import TokenizedExample, collate
from eval.progress import Progress
from fedllm.logs import client_label
from fedllm.model.loss import response_loss
from fedllm.model.parallel import clips_gradients_itself, mean_over_processes, wrapped_for_training
from fedllm.options import one_of, opt
from fedllm.protocol import AlgorithmServer

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0  # a log line per client at most this often while it trains (no terminal)

ALGORITHMS: dict[str, type[ClientAlgorithm]] = {}


class ClientTimeout(RuntimeError):
    """A client ran past its time budget; it is stopped between two steps and its update is not used."""


Params = dict[str, torch.nn.Parameter]


@dataclass
class OptimizerOptions:
    """The local optimizer of an algorithm that takes the configured optimizer's steps (SFT, FedProx):
    ``client.<algorithm>.optimizer``."""

    optimizer: str = opt(
        "adamw",
        "local optimizer: adamw (at client.lr) or sgd (at client.sgd_lr)",
        *one_of("adamw", "sgd"),
    )


@dataclass
class LocalWork:
    """Everything one client needs to know about its local work this round."""

    round: int
    client_id: int
    steps: int
    seed: int
    lr: float  # AdamW's learning rate
    batch_size: int
    grad_accum: int = 1
    scheduler: str = "cosine"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    sgd_lr: float = 0.1  # plain SGD's learning rate (SGD needs a far larger step than AdamW)
    personalize_lr: float = 0.01  # the plain-SGD personalization steps' learning rate
    # Parameters that stay on the client and are trained by plain optimizer steps at their own learning rate
    # (FLoRAL's routers): never part of what an algorithm corrects, pulls back, meta-learns or uploads.
    local_params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    local_lr: float = 1e-2
    local_optimizer: str = "same"  # "same": a group of the algorithm's optimizer; "sgd": an SGD of its own
    layout: Any = None  # fedllm.model.parallel.Layout: data-parallel wrapping of the model (None: as is)
    deadline: float | None = (
        None  # time.monotonic() after which the client stops (federation.client_timeout_s)
    )
    progress: bool = False  # a progress bar over the local steps (on a terminal)
    group_by_length: bool = False  # batches of similar-length examples (client.group_by_length)


@dataclass
class LocalResult:
    """Loss curve of the local steps and algorithm-specific uploads."""

    losses: list[float]
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / max(1, len(self.losses))


def token_lengths(data: Sequence[TokenizedExample]) -> list[int]:
    """Each example's token count (read from the cached table's length column when the data is rows of it)."""
    lengths = getattr(data, "lengths", None)
    return [int(n) for n in lengths()] if callable(lengths) else [len(x.input_ids) for x in data]


def epoch_batches(
    lengths: list[int], batch_size: int, rng: random.Random, group_by_length: bool = False
) -> list[list[int]]:
    """One epoch of batches (indices), seeded by ``rng``; the last one is topped up from the epoch's start.

    ``group_by_length``: HF Trainer's convention (its ``LengthGroupedSampler``): shuffle, cut into
    mega-batches of 50 batches, sort each by length so a batch holds examples of similar length (less
    padding), then shuffle the order of the batches so training still sees them in random order.
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if group_by_length:
        mega = 50 * batch_size
        order = [
            i
            for start in range(0, len(order), mega)
            for i in sorted(order[start : start + mega], key=lambda j: -lengths[j])
        ]
    batches = []
    for i in range(0, len(order), batch_size):
        chunk = order[i : i + batch_size]
        if len(chunk) < batch_size and len(order) >= batch_size:
            chunk = chunk + order[: batch_size - len(chunk)]
        batches.append(chunk)
    if group_by_length:
        rng.shuffle(batches)
    return batches


def batch_stream(
    data: Sequence[TokenizedExample],
    batch_size: int,
    pad_id: int,
    seed: int,
    group_by_length: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Endless seeded shuffled batches (reshuffled every epoch); see :func:`epoch_batches`."""
    rng = random.Random(seed)
    lengths = token_lengths(data) if group_by_length else [0] * len(data)
    read = getattr(data, "batch", None)  # a table's rows: one read per batch, from its token buffers
    while True:
        for chunk in epoch_batches(lengths, batch_size, rng, group_by_length):
            yield read(chunk, pad_id) if read else collate([data[j] for j in chunk], pad_id)


class ClientAlgorithm:
    """One local-training algorithm; subclasses register by ``name``."""

    name: ClassVar[str] = ""
    server_half: ClassVar[type[AlgorithmServer]] = AlgorithmServer  # built by the driver, run by the server
    # what the config layer checks against the strategy (clients never look at the strategy themselves)
    needs_parameter_averaging: ClassVar[bool] = (
        False  # its state refers to parameters that persist across rounds
    )
    trains_local_params: ClassVar[bool] = (
        True  # can train client-only parameters beside its own (FLoRAL routers)
    )
    # the server half keeps state for every trainable tensor (SCAFFOLD's c): every one must be trained
    server_state_per_parameter: ClassVar[bool] = False
    uploads_extras: ClassVar[bool] = False  # it uploads tensors beside the model update (control variates)
    keeps_state: ClassVar[bool] = False  # each client keeps state between rounds (its control variate)
    changes_gradients: ClassVar[bool] = True  # it changes gradients between backward and step
    # each local step is one step of the configured optimizer on the loss's gradient, as far as the first
    # step goes (FedProx's pull is zero there); a strategy whose hook sets what one round's step is (Fed-SB's
    # initialization) needs it: not SCAFFOLD's corrected steps, not Per-FedAvg's meta-steps
    plain_first_step: ClassVar[bool] = True
    # its own options (a dataclass of fedllm.options.opt fields), collected as client.<name>.*
    options: ClassVar[type | None] = None
    # the settings of its paper's experiments, which ``client.preset=paper`` applies (keys the config does
    # not set itself): the LLM defaults (AdamW, a cosine schedule, a gradient clip) are not its paper's
    # (an algorithm whose options choose an optimizer also gets plain SGD: :meth:`paper_settings`)
    paper_preset: ClassVar[dict[str, object]] = {
        "client.scheduler": "constant",
        "client.warmup_ratio": 0.0,
        "client.max_grad_norm": 0.0,
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name or not cls.name.isidentifier():
            raise TypeError(f"client algorithm {cls.__name__} needs an identifier as name, got {cls.name!r}")
        if cls.name in ALGORITHMS:
            raise TypeError(f"client algorithm {cls.name!r} is registered twice")
        ALGORITHMS[cls.name] = cls

    def __init__(self, optimizer: str = "adamw") -> None:
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"client.{self.name}.optimizer = {optimizer!r}: expected adamw or sgd")
        self.optimizer = optimizer

    @classmethod
    def from_config(cls, client_cfg) -> ClientAlgorithm:
        """The algorithm from the client section: its general settings, and its own options under
        ``client_cfg.<name>`` (an instance of :attr:`options`; its ``optimizer`` where it declares one)."""
        return cls(optimizer=cls.own_options(client_cfg).optimizer) if cls.chooses_optimizer() else cls()

    @classmethod
    def chooses_optimizer(cls) -> bool:
        """Whether its options choose the local optimizer (``client.<name>.optimizer``: SFT, FedProx,
        SCAFFOLD)."""
        return cls.options is not None and "optimizer" in {f.name for f in dataclasses.fields(cls.options)}

    @classmethod
    def paper_settings(cls) -> dict[str, object]:
        """What ``client.preset=paper`` sets: plain SGD where the algorithm's options choose an optimizer,
        then its :attr:`paper_preset` (schedule, clip)."""
        sgd = {f"client.{cls.name}.optimizer": "sgd"} if cls.chooses_optimizer() else {}
        return {**sgd, **cls.paper_preset}

    @classmethod
    def own_options(cls, client_cfg):
        """This algorithm's own options in the client section (None when it declares none)."""
        return getattr(client_cfg, cls.name, None) if cls.options is not None else None

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse combinations this algorithm cannot run, before any work starts."""

    def step_size(self, work: LocalWork) -> float:
        """The learning rate of this algorithm's optimizer: ``client.lr`` (AdamW) or
        ``client.sgd_lr`` (SGD).
        """
        return work.sgd_lr if self.optimizer == "sgd" else work.lr

    def make_optimizer(self, params: Params, work: LocalWork) -> torch.optim.Optimizer:
        """AdamW or SGD over ``params``; ``work.local_params`` form their own group at ``work.local_lr``
        (unless an optimizer of their own steps them: ``work.local_optimizer``, :class:`LocalRun`)."""
        groups = [{"params": list(params.values()), "lr": self.step_size(work)}]
        if work.local_params and work.local_optimizer == "same":
            groups.append(
                {"params": list(work.local_params.values()), "lr": work.local_lr, "weight_decay": 0.0}
            )
        if self.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.step_size(work), weight_decay=work.weight_decay)
        return torch.optim.AdamW(
            groups, lr=self.step_size(work), weight_decay=work.weight_decay, fused=fused_adamw(groups, work)
        )

    def begin(self, params: Params, state: dict[str, Any], download: dict[str, Tensor]) -> None:
        """Hook before the first local step (e.g. remember the starting point); ``download``: the server
        half's.
        """

    def finish(
        self, params: Params, work: LocalWork, state: dict[str, Any], step_sizes: list[float]
    ) -> dict[str, Tensor]:
        """Hook after the last local step (``step_sizes``: the learning rate of each step); returns extra
        uploads.
        """
        return {}

    def personalize(
        self,
        model,
        params: Params,
        batches: Iterator[dict[str, Tensor]],
        steps: int,
        work: LocalWork,
        accelerator,
    ) -> None:
        """Adapt the global model to a client with ``steps`` plain SGD steps (for personalized evaluation)."""
        opt = torch.optim.SGD(list(params.values()), lr=self.personal_lr(work))
        torch.manual_seed(work.seed + 1)
        model.train()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            accumulate(model, batches, work, accelerator)
            if self.personal_clip(work) > 0:  # the step rule the local training used
                torch.nn.utils.clip_grad_norm_(list(params.values()), self.personal_clip(work))
            opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()

    def correct(self, params: Params) -> None:
        """Add to the (clipped) gradient what is not the local objective's own gradient (SCAFFOLD's
        control-variate correction): the clip bounds the stochastic gradient, never the correction that
        removes the drift. Default: nothing."""

    def settle(
        self, old: dict[str, Tensor], new: dict[str, Tensor], download: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """The state a client keeps once the server took the update that came with ``new`` (``old``: the
        state before it; ``download``: what the server half sends now, e.g. how it scaled that update).
        Default: the new state."""
        return new

    def step_clip(self, work: LocalWork) -> float:
        """The gradient-norm clip of each local step (``client.max_grad_norm``; 0: none)."""
        return work.max_grad_norm

    def personal_clip(self, work: LocalWork) -> float:
        """The gradient-norm clip of each personalization step: the local steps' rule."""
        return self.step_clip(work)

    def personal_lr(self, work: LocalWork) -> float:
        """Personalization takes plain SGD steps at ``client.personalize_lr`` (not ``client.sgd_lr``: a step
        of 0.1 from a LoRA trained by AdamW undoes what it learned; see docs/testbed.md)."""
        return work.personalize_lr

    def local_step(
        self, model, params: Params, batches: Iterator[dict[str, Tensor]], work: LocalWork, accelerator
    ) -> float:
        """Accumulate gradients for one optimizer step into ``params``; return the loss.

        The default (SFT, FedProx, SCAFFOLD) is the loss's own gradient then :meth:`after_backward`: an
        algorithm that keeps it can be trained with other clients in one forward
        (``federation.client_batch``, fedllm/client/batched.py); one that overrides it (Per-FedAvg's
        several forwards per step) is trained alone.
        """
        loss = accumulate(model, batches, work, accelerator)
        self.after_backward(params)
        return loss

    def after_backward(self, params: Params) -> None:
        """Change the fresh gradient of the local objective before the clip (FedProx's proximal term)."""

    @property
    def batchable(self) -> bool:
        """Whether its step is the default one (the loss's gradient, then :meth:`after_backward`)."""
        return type(self).local_step is ClientAlgorithm.local_step

    def train(
        self,
        model,
        params: Params,
        batches: Iterator[dict[str, Tensor]],
        work: LocalWork,
        accelerator,
        state: dict[str, Any] | None = None,
        download: dict[str, Tensor] | None = None,
    ) -> LocalResult:
        """Run ``work.steps`` optimizer steps on ``params`` (the client's trainable tensors, by name).

        ``state`` is what the algorithm keeps on this client between rounds
        (updated in place); ``download`` what its server half sent.
        """
        run = LocalRun(self, params, work, state, download)
        layout = work.layout
        try:
            with wrapped_for_training(
                accelerator, layout, model, run.optimizer, self.step_clip(work), work.batch_size
            ) as (wrapped, optimizer):
                run.optimizer = optimizer
                wrapped.train()
                for _ in range(work.steps):
                    run.zero_grad()
                    run.step(self.local_step(wrapped, params, batches, work, accelerator))
        finally:  # a failed or timed-out client's progress stops with it (its heartbeat thread too)
            run.close()
        model.eval()
        result = run.result()
        if layout is not None and layout.data_parallel:  # each process saw a share of every batch
            result.losses = mean_over_processes(accelerator, result.losses)
        return result


class LocalRun:
    """One client's local training, step by step: its optimizer, schedule, clip, correction, progress bar
    and time budget. :meth:`ClientAlgorithm.train` runs one alone; client-batched training runs several
    side by side, each with its own (fedllm/client/batched.py), so each client's trajectory is the one it
    has alone."""

    def __init__(
        self,
        algo: ClientAlgorithm,
        params: Params,
        work: LocalWork,
        state: dict[str, Any] | None = None,
        download: dict[str, Tensor] | None = None,
    ) -> None:
        from transformers import get_scheduler

        self.algo, self.params, self.work = algo, params, work
        self.state = state if state is not None else {}
        torch.manual_seed(work.seed)  # LoRA dropout and any sampling inside the step
        self.optimizer = algo.make_optimizer(params, work)
        # client-only parameters with a plain SGD of their own (FLoRAL's routers as its reference code steps
        # them): at their own rate, outside the schedule and the clip
        self.local_optimizer = (
            torch.optim.SGD(list(work.local_params.values()), lr=work.local_lr)
            if work.local_params and work.local_optimizer == "sgd"
            else None
        )
        warmup = int(work.warmup_ratio * work.steps)
        sched_name = {"constant": "constant_with_warmup"}.get(work.scheduler, work.scheduler)
        self.scheduler = get_scheduler(
            sched_name, self.optimizer, num_warmup_steps=warmup, num_training_steps=work.steps
        )
        algo.begin(params, self.state, download or {})
        self.losses: list[float] = []
        self.step_sizes: list[float] = []
        self.bar = Progress(
            work.steps,
            client_label(work.client_id),
            "steps",
            enabled=work.progress,
            logger=log,
            every_s=PROGRESS_EVERY_S,
            detail=self._running_loss,
            say_total=False,
        )

    def _running_loss(self) -> str:
        window = self.losses[-20:]  # a running mean: single batches' losses jump
        return f"loss {sum(window) / len(window):.4f} (running mean)" if window else "no step done yet"

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.local_optimizer is not None:
            self.local_optimizer.zero_grad(set_to_none=True)

    def step(self, loss: float) -> None:
        """The optimizer step once this step's gradients are in the parameters: clip, correct, step."""
        algo, work, params = self.algo, self.work, self.params
        if algo.step_clip(work) > 0 and not clips_gradients_itself(work.layout):
            torch.nn.utils.clip_grad_norm_(list(params.values()), algo.step_clip(work))
        algo.correct(params)  # after the clip: a correction is never scaled by the gradient's norm
        self.step_sizes.append(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.local_optimizer is not None:
            self.local_optimizer.step()
        self.scheduler.step()
        self.losses.append(loss)
        self.bar.update()
        if work.deadline is not None and time.monotonic() > work.deadline:
            raise ClientTimeout(
                f"stopped after {len(self.losses)} of {work.steps} steps: past its time budget "
                "(federation.client_timeout_s)"
            )

    def close(self) -> None:
        self.zero_grad()
        self.bar.close()

    def result(self) -> LocalResult:
        return LocalResult(self.losses, self.algo.finish(self.params, self.work, self.state, self.step_sizes))


def fused_adamw(groups: list[dict], work: LocalWork) -> bool | None:
    """Whether a client's AdamW runs as torch's fused kernel: one call per step for all its tensors.

    torch picks its multi-tensor kernels by itself only for CUDA tensors; on a CPU it loops over the
    tensors in Python, which for the 42 adapter tensors of the built-in default costs 0.89 ms a step
    against 0.22 ms fused (``scripts/bench_client_batch.py --step-costs`` prints both). The fused kernel
    computes the same update (to float rounding). Left to torch (None) under DeepSpeed, which steps
    through its own engine, and for tensors the kernel does not take.
    """
    if work.layout is not None and work.layout.deepspeed:
        return None
    params = [p for g in groups for p in g["params"]]
    ok = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return True if ok and params else None


def lm_loss(model, batch: dict[str, Tensor], accelerator) -> Tensor:
    """The model's loss on a batch: response tokens only (prompt labels are -100), the vocabulary head
    computed only where a label is (:mod:`fedllm.model.loss`)."""
    device = accelerator.device if accelerator is not None else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    if accelerator is None:
        return response_loss(model, batch)
    with accelerator.autocast():
        return response_loss(model, batch)


def backward(loss: Tensor, accelerator) -> None:
    """Through the DeepSpeed engine while one wraps the model (it also steps), else plain autograd.

    Plain autograd is what accelerate does too without DeepSpeed (fp16 loss
    scaling aside, which the layout refuses), and it keeps steps outside an
    engine, such as personalization, on the unwrapped model.
    """
    if accelerator is not None and getattr(accelerator, "deepspeed_engine_wrapped", None) is not None:
        accelerator.backward(loss)
    else:
        loss.backward()


def accumulate(model, batches: Iterator[dict[str, Tensor]], work: LocalWork, accelerator) -> float:
    """Backward over ``grad_accum`` micro-batches; returns their mean loss."""
    total = 0.0
    for _ in range(work.grad_accum):
        loss = lm_loss(model, next(batches), accelerator) / work.grad_accum
        backward(loss, accelerator)
        total += loss.item()
    return total
