"""A client runtime for any torch module with a loss: the papers' own small models (``fedllm reproduce``).

The LLM runtime (``runtime.py``) hosts a peft base with one adapter per rank; this one hosts any
``torch.nn.Module`` whose ``forward(**batch)`` returns an object with a ``loss``, e.g. a linear
stochastic-approximation model whose loss has the gradient ``A(Z) theta - b(Z)``, or an MLP. Its named
parameters in ``dense`` are federated as the server's dense modules; a LoRA adapter injected with peft
(``peft.inject_adapter_in_model``) under ``adapter`` is federated as LoRA factors, with the strategy's
client hook (FLoRAL's router) on it. What a client does is what an LLM client does: its ClientStart
switched in, the client algorithm's own ``train`` (SGD, SCAFFOLD, Per-FedAvg: the same classes), its state
kept pending until the server takes its update, its ClientUpdate read out. Nothing here knows the
algorithm or the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedllm.client.base import ClientAlgorithm, LocalResult, LocalWork
from fedllm.client.runtime import ALGO, HOOK, keep_pending, settle_pending, without_prefix
from fedllm.factors import (
    Adapter,
    fresh_factors,
    lora_modules,
    module_shapes,
    prefixed,
    read_factors,
    unprefixed,
    write_factors,
)
from fedllm.protocol import ClientHook, ClientStart, ClientUpdate, derive_seed, fit_download

Batches = Callable[[int, int], Iterator[dict[str, Tensor]]]  # (round, seed) -> that round's batch stream


@dataclass
class ModuleClient:
    """A client of a :class:`ModuleRuntime`: its id, how many examples it has, its data as a batch stream
    for a round, and the state it keeps between rounds (its algorithm's, its strategy's)."""

    client_id: int
    num_examples: int
    batches: Batches
    state: dict[str, Tensor] = field(default_factory=dict)


class ModuleRuntime:
    """See module docstring. ``work`` holds the :class:`~fedllm.client.base.LocalWork` settings every
    client's local work takes (steps, step sizes, schedule, clip)."""

    def __init__(
        self,
        model: torch.nn.Module,
        algorithm: ClientAlgorithm,
        work: dict[str, Any],
        dense: list[str],
        hook: ClientHook | None = None,
        adapter: str | None = None,
        seed: int = 0,
    ) -> None:
        self.model, self.algorithm, self.work_args = model, algorithm, dict(work)
        self.hook, self.adapter, self.seed = hook or ClientHook(), adapter, seed
        self.dense = list(dense)
        params = dict(model.named_parameters())
        missing = sorted(set(self.dense) - set(params))
        if missing:
            raise ValueError(f"the model has no parameters {missing}")

    # ------------------------------------------------------------------ what the server must know
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        return module_shapes(self.model, self.adapter) if self.adapter else {}

    def initial_dense(self) -> dict[str, Tensor]:
        params = dict(self.model.named_parameters())
        return {k: params[k].detach().clone().float() for k in self.dense}

    # ------------------------------------------------------------------ one client
    def switch_in(
        self, client: ModuleClient, start: ClientStart
    ) -> tuple[dict[str, torch.nn.Parameter], Adapter]:
        """Load ``start`` into the model; returns the client's trainable parameters and its start factors."""
        client.state = settle_pending(
            client.state, start.last_aggregated, lambda old, new: self.algorithm.settle(old, new, start.algo)
        )
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, t in start.dense.items():
                params[k].copy_(t)
        trainable = {k: params[k] for k in self.dense}
        started: Adapter = {}
        if self.adapter:
            fresh = fresh_factors(self.model, self.adapter, self.hook.fresh_seed(self.seed, start.round))
            started = self.hook.start_factors(fit_download(start.factors, fresh), fresh)
            write_factors(self.model, self.adapter, started)
            for key, m in lora_modules(self.model, self.adapter).items():
                trainable[f"{key}.A"] = m.lora_A[self.adapter].weight
                trainable[f"{key}.B"] = m.lora_B[self.adapter].weight
        return trainable, started

    @contextlib.contextmanager
    def view(self, client: ModuleClient, start: ClientStart, view: str):
        """The strategy's hooks for ``view`` ('train', 'global', 'own'), removed after."""
        session = (
            self.hook.for_round(start.round).session(
                self.model, self.adapter, unprefixed(client.state, HOOK), start.extras, view
            )
            if self.adapter
            else None
        )
        try:
            yield session
        finally:
            if session is not None:
                session.close()

    def work_for(self, client: ModuleClient, round_idx: int, **change: Any) -> LocalWork:
        seed = derive_seed(self.seed, round_idx, client.client_id, 11)
        return LocalWork(
            round=round_idx, client_id=client.client_id, seed=seed, **{**self.work_args, **change}
        )

    def train(self, client: ModuleClient, start: ClientStart) -> ClientUpdate:
        """Switch ``client`` in, run its algorithm on its batches, read back its update."""
        params, _ = self.switch_in(client, start)
        work = self.work_for(client, start.round)
        algo_state = unprefixed(client.state, ALGO)
        with self.view(client, start, "train") as session:
            if session is not None:
                work.local_params, work.local_lr = session.local_params(), session.local_lr
                work.local_optimizer = session.local_optimizer
                params.update(session.shared_params())
            params = {k: p for k, p in params.items() if p.requires_grad}
            result: LocalResult = self.algorithm.train(
                self.model, params, client.batches(start.round, work.seed), work, None, algo_state, start.algo
            )
            if session is not None:
                result.extras.update(session.upload())
                client.state = {**prefixed(session.state(), HOOK), **without_prefix(client.state, HOOK)}
        client.state = keep_pending(client.state, algo_state, start.round)
        dense = {
            k: t.detach().clone().float()
            for k, t in dict(self.model.named_parameters()).items()
            if k in self.dense
        }
        hook = self.hook.for_round(start.round)
        factors = hook.outgoing(read_factors(self.model, self.adapter)) if self.adapter else {}
        return ClientUpdate(
            client_id=client.client_id,
            num_examples=client.num_examples,
            factors=factors,
            dense=dense,
            extras=result.extras,
            metrics={"loss_mean": result.mean_loss, "steps": work.steps},
            round=start.round,
            token=start.token,
        )

    def personalize(self, client: ModuleClient, start: ClientStart, steps: int, **work: Any) -> None:
        """Leave the model as ``client``'s personalization of ``start``: its algorithm's ``steps``
        personalization steps on its own data (Per-FedAvg: the inner step the meta-objective trained for)."""
        params, _ = self.switch_in(client, start)
        p = self.work_for(client, start.round, **work)
        self.algorithm.personalize(
            self.model, params, client.batches(start.round, p.seed + 1), steps, p, None
        )
