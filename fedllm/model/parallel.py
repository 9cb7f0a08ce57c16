"""How the processes of an ``accelerate launch`` share a federated run.

Two layouts, both on accelerate (and DeepSpeed through accelerate):

- **clients** (default with plain multi-process launches): each process holds
  a whole base model and trains its share of the round's clients; updates are
  gathered and every process aggregates the same sorted list.
- **data** (default under DeepSpeed): all processes train *one* client at a
  time. Each optimizer step's batch is split by rows over the processes and
  the model is wrapped for the client's local training by
  ``accelerator.prepare`` (DDP, or a DeepSpeed ZeRO-2/3 engine that shards
  optimizer state, gradients and with ZeRO-3 the frozen base itself). Every
  process then holds the same update, so aggregation needs no gather.

The loss is normalized by the *global* number of response tokens of the
batch, so a data-parallel step takes the same gradient as one process
running the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


def distributed_type(accelerator) -> str:
    return str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()


def uses_deepspeed(accelerator) -> bool:
    return distributed_type(accelerator) == "DEEPSPEED"


def zero_stage(accelerator) -> int:
    """The ZeRO stage of the launch's DeepSpeed config (0 without DeepSpeed)."""
    if not uses_deepspeed(accelerator):
        return 0
    return int(accelerator.state.deepspeed_plugin.zero_stage)


@dataclass
class Layout:
    """The resolved layout of a run: which clients this process trains, and how."""

    mode: str
    process_index: int
    num_processes: int
    deepspeed: bool = False
    zero_stage: int = 0

    @property
    def data_parallel(self) -> bool:
        return (self.mode == "data" and self.num_processes > 1) or self.deepspeed

    @property
    def gathers(self) -> bool:
        """Whether per-process results must be gathered (clients split over several processes)."""
        return self.mode == "clients" and self.num_processes > 1

    def my_clients(self, clients: list[int]) -> list[int]:
        """Clients this process trains: a strided share, or all of them in data mode."""
        if self.mode == "data":
            return list(clients)
        return clients[self.process_index :: self.num_processes]

    def split_batches(self, batches: Iterator[dict[str, Tensor]]) -> Iterator[dict[str, Tensor]]:
        """This process's rows of every batch, with the loss normalized by the batch's global token count.

        Gradients are averaged over processes (DDP / DeepSpeed), so each share's
        token-summed loss is divided by (global tokens / processes): the average
        of the shares' gradients is then the whole batch's mean-token gradient.
        """
        n = self.num_processes
        for batch in batches:
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            share = {k: v[self.process_index :: n] for k, v in batch.items()}
            share["num_items_in_batch"] = torch.tensor(max(tokens, 1) / n)
            yield share


def _deepspeed_batch(accelerator, micro_batch: int) -> dict:
    """Write this phase's batch sizes into the DeepSpeed config (each engine checks them)."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch
    ds_config["gradient_accumulation_steps"] = 1
    ds_config["train_batch_size"] = micro_batch * accelerator.num_processes
    return ds_config


@contextlib.contextmanager
def wrapped_for_training(
    accelerator, layout: Layout | None, model, optimizer, max_grad_norm: float, batch_size: int
):
    """``(model, optimizer)`` prepared by accelerate for one client's local training.

    The learning-rate scheduler stays the caller's, bound to the optimizer's
    parameter groups: accelerate would step a prepared one once per process
    per step. Clients mode leaves both as they are. Data mode wraps the model in DDP or
    a DeepSpeed engine (micro-batch, clipping and accumulation written into
    its config first); on exit the wrappers and the engine are freed, leaving
    the peft model holding the trained values.
    """
    if layout is None or not layout.data_parallel:
        yield model, optimizer
        return
    if layout.deepspeed:
        ds_config = _deepspeed_batch(accelerator, batch_size // layout.num_processes)
        ds_config["gradient_clipping"] = max_grad_norm if max_grad_norm > 0 else 0.0
    wrapped, prepared_optimizer = accelerator.prepare(model, optimizer)
    try:
        yield wrapped, prepared_optimizer
    finally:
        accelerator.free_memory()


@contextlib.contextmanager
def evaluation_engine(accelerator, layout: Layout | None, model, micro_batch: int):
    """ZeRO-3 only: a DeepSpeed engine around ``model`` so that its sharded weights are gathered in
    forward.
    """
    if layout is None or layout.zero_stage != 3:
        yield
        return
    _deepspeed_batch(accelerator, micro_batch)
    accelerator.prepare(model)
    try:
        yield
    finally:
        accelerator.free_memory()


def clips_gradients_itself(layout: Layout | None) -> bool:
    """DeepSpeed clips inside its engine step (``gradient_clipping`` in its config)."""
    return layout is not None and layout.deepspeed


@contextlib.contextmanager
def full_tensors(layout: Layout | None, params: list[torch.nn.Parameter], modify: bool = False):
    """Whole values of ``params`` on every process (ZeRO-3 keeps only a shard of each).

    With ``modify`` the values written by process 0 are re-sharded to all.
    A no-op for every other layout.
    """
    if layout is None or layout.zero_stage != 3 or not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        yield


def mean_over_processes(accelerator, values: list[float]) -> list[float]:
    """Average a per-process list (data mode: each process saw its share of every batch)."""
    if accelerator.num_processes == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(t, reduction="mean").tolist()
