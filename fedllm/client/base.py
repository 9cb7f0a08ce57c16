"""The local-training protocol shared by every client algorithm.

A client is only its data, its adapter factors and its optimizer state: the
base model is shared by all clients of a process and never copied. The round
loop loads the client's starting factors into the adapter of the client's
rank, then calls :meth:`ClientAlgorithm.train`. Algorithms differ in how one
local step is taken (:meth:`ClientAlgorithm.local_step`) and in what they
upload besides the adapter; the loop around the steps is written once here.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from data_prep.prompts import TokenizedExample, collate
from fedllm.parallel import clips_gradients_itself, mean_over_processes, wrapped_for_training

ALGORITHMS: dict[str, type[ClientAlgorithm]] = {}


class ClientTimeout(RuntimeError):
    """A client ran past its time budget; it is stopped between two steps and its update is not used."""
Params = dict[str, torch.nn.Parameter]


@dataclass
class LocalPlan:
    """Everything one client needs to know about its local work this round."""

    round: int
    client_id: int
    steps: int
    seed: int
    lr: float
    batch_size: int
    grad_accum: int = 1
    scheduler: str = "cosine"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    param_lrs: dict[str, float] = field(default_factory=dict)  # per-parameter learning rates (routers)
    layout: Any = None  # fedllm.parallel.Layout: data-parallel wrapping of the model (None: as is)
    deadline: float | None = None  # time.monotonic() after which the client stops (federation.client_timeout_s)


@dataclass
class LocalResult:
    """Loss curve of the local steps and algorithm-specific uploads."""

    losses: list[float]
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / max(1, len(self.losses))


def batch_stream(data: list[TokenizedExample], batch_size: int, pad_id: int, seed: int) -> Iterator[dict[str, Tensor]]:
    """Endless seeded shuffled batches (reshuffled every epoch)."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(data)))
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            chunk = order[i:i + batch_size]
            if len(chunk) < batch_size and len(order) >= batch_size:
                chunk = chunk + order[: batch_size - len(chunk)]
            yield collate([data[j] for j in chunk], pad_id)


class ClientAlgorithm(abc.ABC):
    """One local-training algorithm; subclasses register by ``name``."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name or not cls.name.isidentifier():
            raise TypeError(f"client algorithm {cls.__name__} needs an identifier as name, got {cls.name!r}")
        if cls.name in ALGORITHMS:
            raise TypeError(f"client algorithm {cls.name!r} is registered twice")
        ALGORITHMS[cls.name] = cls

    def __init__(self, optimizer: str = "adamw", **options: Any) -> None:
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"client.optimizer = {optimizer!r}: expected adamw or sgd")
        self.optimizer = optimizer
        self.options = options

    @classmethod
    def from_config(cls, client_cfg) -> ClientAlgorithm:
        return cls(optimizer=client_cfg.optimizer)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse combinations this algorithm cannot run, before any work starts."""

    def make_optimizer(self, params: Params, plan: LocalPlan) -> torch.optim.Optimizer:
        """AdamW or SGD; parameters named in ``plan.param_lrs`` get their own learning rate."""
        groups = [{"params": [p for k, p in params.items() if k not in plan.param_lrs], "lr": plan.lr}]
        groups += [{"params": [params[k]], "lr": lr, "weight_decay": 0.0} for k, lr in plan.param_lrs.items()
                   if k in params]
        if self.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=plan.lr, weight_decay=plan.weight_decay)
        return torch.optim.AdamW(groups, lr=plan.lr, weight_decay=plan.weight_decay)

    def begin(self, params: Params, state: dict[str, Any]) -> None:
        """Hook before the first local step (e.g. remember the starting point)."""

    def finish(self, params: Params, plan: LocalPlan, state: dict[str, Any]) -> dict[str, Tensor]:
        """Hook after the last local step; returns extra tensors to upload."""
        return {}

    def server_update(self, updates: list, num_clients: int) -> None:
        """Server-side state of the algorithm after a round (SCAFFOLD's control variate)."""

    def download_numel(self, params: Params) -> int:
        """Extra parameters a client downloads for this algorithm (e.g. the server control)."""
        return 0

    def server_state(self) -> dict[str, Tensor]:
        return {}

    def load_server_state(self, tensors: dict[str, Tensor]) -> None:
        """Restore what :meth:`server_state` returned (resume)."""

    def personalize(self, model, params: Params, batches: Iterator[dict[str, Tensor]], steps: int, plan: LocalPlan,
                    accelerator) -> None:
        """Adapt the global model to a client with ``steps`` plain SGD steps (for personalized evaluation)."""
        opt = torch.optim.SGD(list(params.values()), lr=self.personal_lr(plan))
        model.train()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            accumulate(model, batches, plan, accelerator)
            opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()

    def personal_lr(self, plan: LocalPlan) -> float:
        return plan.lr

    @abc.abstractmethod
    def local_step(self, model, params: Params, batches: Iterator[dict[str, Tensor]], plan: LocalPlan,
                   accelerator) -> float:
        """Accumulate gradients for one optimizer step into ``params``; return the loss."""

    def train(self, model, params: Params, batches: Iterator[dict[str, Tensor]], plan: LocalPlan,
              accelerator, state: dict[str, Any] | None = None) -> LocalResult:
        """Run ``plan.steps`` optimizer steps on ``params`` (the client's trainable tensors, by name)."""
        from transformers import get_scheduler

        state = state if state is not None else {}
        torch.manual_seed(plan.seed)  # LoRA dropout and any sampling inside the step
        optimizer = self.make_optimizer(params, plan)
        warmup = int(plan.warmup_ratio * plan.steps)
        sched_name = {"constant": "constant_with_warmup"}.get(plan.scheduler, plan.scheduler)
        scheduler = get_scheduler(sched_name, optimizer, num_warmup_steps=warmup, num_training_steps=plan.steps)
        layout = plan.layout
        self.begin(params, state)
        losses = []
        with wrapped_for_training(accelerator, layout, model, optimizer, plan.max_grad_norm,
                                  plan.batch_size) as (wrapped, optimizer):
            wrapped.train()
            for _ in range(plan.steps):
                optimizer.zero_grad(set_to_none=True)
                loss = self.local_step(wrapped, params, batches, plan, accelerator)
                if plan.max_grad_norm > 0 and not clips_gradients_itself(layout):
                    torch.nn.utils.clip_grad_norm_(list(params.values()), plan.max_grad_norm)
                optimizer.step()
                scheduler.step()
                losses.append(loss)
                if plan.deadline is not None and time.monotonic() > plan.deadline:
                    raise ClientTimeout(f"stopped after {len(losses)} of {plan.steps} steps: past its time budget "
                                        "(federation.client_timeout_s)")
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        if layout is not None and layout.data_parallel:  # each process saw a share of every batch
            losses = mean_over_processes(accelerator, losses)
        return LocalResult(losses, self.finish(params, plan, state))


def lm_loss(model, batch: dict[str, Tensor], accelerator) -> Tensor:
    """The model's loss on a batch (for causal LMs: response tokens only, prompt labels are -100)."""
    device = accelerator.device if accelerator is not None else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    if accelerator is None:
        return model(**batch).loss
    with accelerator.autocast():
        return model(**batch).loss


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


def accumulate(model, batches: Iterator[dict[str, Tensor]], plan: LocalPlan, accelerator) -> float:
    """Backward over ``grad_accum`` micro-batches; returns their mean loss."""
    total = 0.0
    for _ in range(plan.grad_accum):
        loss = lm_loss(model, next(batches), accelerator) / plan.grad_accum
        backward(loss, accelerator)
        total += loss.item()
    return total
