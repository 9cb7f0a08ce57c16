"""The server: strategy, global state, sampling, downloads, update checks, clipping, ledger, its checkpoint.

It holds no model (no peft, transformers or accelerate): its surface is
messages. ``plan_round`` samples the round's clients and hands out one
:class:`~fedllm.protocol.ClientStart` per client (what it downloads: its
factors, the merges it has not applied yet, the dense modules, strategy and
algorithm state); ``finish_round`` takes back the round's
:class:`~fedllm.protocol.ClientUpdate` s (or why a client failed), checks
them, clips them, aggregates them when at least ``min_clients`` are valid,
and returns the round's metrics. Every number it draws derives from
``(seed, round)``, so any driver (one process, several, Flower) gets the same
rounds. Flower's Message-API strategies read the same way
(``configure_train`` / ``aggregate_train``).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedllm.aggregation import GlobalState, Strategy
from fedllm.comm import Ledger
from fedllm.factors import Adapter, LoraFactors, adapter_from_tensors, adapter_tensors, prefixed, unprefixed
from fedllm.protocol import AlgorithmServer, ClientInfo, ClientStart, ClientUpdate, derive_seed

log = logging.getLogger(__name__)


class ClientFailure(RuntimeError):
    """A client's update is unusable (raised, timed out, non-finite, mis-shaped)."""


@dataclass
class RoundPlan:
    """A round as the server planned it: who was sampled, who dropped out, what each active client
    downloads.
    """

    round: int
    sampled: list[int]
    dropped: list[int]
    starts: dict[int, ClientStart] = field(default_factory=dict)

    @property
    def active(self) -> list[int]:
        return sorted(self.starts)


@dataclass
class RoundReport:
    """What the server reports of a finished round: the metrics row and the update merged into the base."""

    row: dict[str, Any]
    merged: Adapter = field(default_factory=dict)


@dataclass
class Sampling:
    """How clients are drawn each round (``federation.*``)."""

    seed: int = 0
    clients_per_round: int = 0  # 0: use fraction
    fraction: float = 1.0
    dropout: float = 0.0  # share of the sampled clients that never report


def validate_update(update: ClientUpdate, rank: int, timeout_s: float = 0.0) -> None:
    """Reject late, non-finite or mis-shaped updates before they reach the server math."""
    if timeout_s and update.metrics.get("train_s", 0.0) > timeout_s:
        raise ClientFailure(
            f"ran {update.metrics['train_s']:.1f}s, past federation.client_timeout_s={timeout_s}"
        )
    if update.start and set(update.factors) != set(update.start):
        raise ClientFailure("update covers other modules than the adapter")
    for key, f in update.factors.items():
        ref = update.start.get(key)
        want_a = tuple(ref.A.shape) if ref is not None else (rank, f.A.shape[1])
        want_b = tuple(ref.B.shape) if ref is not None else (f.B.shape[0], rank)
        if tuple(f.A.shape) != want_a or tuple(f.B.shape) != want_b or f.A.shape[0] != rank:
            raise ClientFailure(
                f"wrong shape at {key}: A{tuple(f.A.shape)} B{tuple(f.B.shape)}, expected A{want_a} B{want_b}"
            )
        if not (torch.isfinite(f.A).all() and torch.isfinite(f.B).all()):
            raise ClientFailure(f"non-finite values at {key}")
    for key, t in list(update.dense.items()) + list(update.extras.items()):
        if not torch.isfinite(t).all():
            raise ClientFailure(f"non-finite values in {key}")


def clip_updates(updates: list[ClientUpdate], ratio: float, dense_start: dict[str, Tensor]) -> int:
    """Scale each update's change to at most ``ratio`` x the round's median norm; returns how many were
    clipped.

    The change is measured from what the client started with (factors and
    dense modules), so one hostile or broken client cannot dominate the
    aggregate by sending a huge update.
    """

    def delta_norm(u: ClientUpdate) -> float:
        sq = sum(
            float((f.A - u.start[k].A).pow(2).sum() + (f.B - u.start[k].B).pow(2).sum())
            for k, f in u.factors.items()
        )
        sq += sum(float((t - dense_start[k]).pow(2).sum()) for k, t in u.dense.items())
        return sq**0.5

    norms = [delta_norm(u) for u in updates]
    cap = ratio * float(torch.tensor(norms).median())
    clipped = 0
    for u, n in zip(updates, norms, strict=True):
        if n <= cap or n == 0:
            continue
        c = cap / n
        u.factors = {
            k: LoraFactors(
                u.start[k].A + c * (f.A - u.start[k].A), u.start[k].B + c * (f.B - u.start[k].B), f.scale
            )
            for k, f in u.factors.items()
        }
        u.dense = {k: dense_start[k] + c * (t - dense_start[k]) for k, t in u.dense.items()}
        clipped += 1
    return clipped


class Server:
    """The server half of a federated run (see module docstring)."""

    def __init__(
        self,
        *,
        strategy: Strategy,
        clients: list[ClientInfo],
        algorithm: AlgorithmServer | None = None,
        sampling: Sampling | None = None,
        dense: dict[str, Tensor] | None = None,
        min_clients: int = 1,
        clip_norm_ratio: float = 0.0,
        client_timeout_s: float = 0.0,
    ) -> None:
        self.strategy = strategy
        self.clients = {c.client_id: c for c in clients}
        self.algorithm = algorithm or AlgorithmServer()
        self.sampling = sampling or Sampling()
        self.min_clients, self.clip_norm_ratio = min_clients, clip_norm_ratio
        self.client_timeout_s = client_timeout_s
        self.state = GlobalState(dense=dict(dense or {}))
        self.ledger = Ledger()
        self.merges: list[tuple[int, Adapter]] = []  # merged updates some client has not downloaded yet
        self.synced = {k: 0 for k in self.clients}  # the last round whose merges each client has
        self.updated_rounds = 0  # rounds whose aggregate changed the global state

    # ------------------------------------------------------------- a round
    def sample(self, round_idx: int) -> tuple[list[int], list[int]]:
        """The round's sampled clients and, among them, those that drop out (never report)."""
        s, n = self.sampling, len(self.clients)
        m = s.clients_per_round or max(1, round(s.fraction * n))
        sampled = sorted(random.Random(derive_seed(s.seed, round_idx, 1)).sample(sorted(self.clients), m))
        n_drop = round(s.dropout * len(sampled))
        dropped = (
            sorted(random.Random(derive_seed(s.seed, round_idx, 2)).sample(sampled, n_drop)) if n_drop else []
        )
        return sampled, dropped

    def client_start(self, round_idx: int, client_id: int) -> ClientStart:
        """What ``client_id`` downloads for ``round_idx`` (pure: changes nothing, counts nothing)."""
        c = self.clients[client_id]
        rank = self.strategy.adapter_rank(c.rank)
        factors = self.strategy.client_factors(self.state, c.rank, c.scale, client_id)
        merges = [(r, m) for r, m in self.merges if r > self.synced[client_id]]
        return ClientStart(
            round=round_idx,
            factors=factors,
            merges=merges,
            dense=dict(self.state.dense),
            extras=self.strategy.client_extras(self.state, client_id),
            algo=self.algorithm.download(rank),
        )

    def plan_round(self, round_idx: int) -> RoundPlan:
        """Sample the round and hand out each active client's start; counts their downloads."""
        sampled, dropped = self.sample(round_idx)
        self.ledger.start_round()
        plan = RoundPlan(round_idx, sampled, dropped)
        for k in sampled:
            if k in dropped:
                continue
            plan.starts[k] = self.client_start(round_idx, k)
            self.ledger.download(k, plan.starts[k].numel())
            self.synced[k] = round_idx - 1
        return plan

    def finish_round(self, plan: RoundPlan, results: dict[int, ClientUpdate | str]) -> RoundReport:
        """Accept, count, clip and aggregate the round's updates; the merged update is the report's.

        ``results`` maps each active client to its update, or to why it
        failed (an exception on the client, a lost message).
        """
        t0 = time.perf_counter()
        updates, failures = self._accept(plan, results)
        for u in updates:
            self.ledger.upload(u.client_id, u.numel())
        info = self._clip(updates)
        skipped = len(updates) < self.min_clients
        merged: Adapter = {}
        if skipped:
            log.warning(
                "round %d skipped: %d valid update(s) < federation.min_clients = %d",
                plan.round,
                len(updates),
                self.min_clients,
            )
        else:
            merged = self._aggregate(updates, info)
        self._keep_merge(plan.round, merged)
        row = {
            "round": plan.round,
            "sampled": plan.sampled,
            "dropped": plan.dropped,
            "failed": failures,
            "n_updates": len(updates),
            "skipped": skipped,
            **self._client_metrics(updates),
            **{f"agg_{k}": v for k, v in info.items()},
            "n_failed": len(failures),
            "n_dropped": len(plan.dropped),
            **self.ledger.round_summary(),
            "time_aggregate_s": time.perf_counter() - t0,
        }
        return RoundReport(row, merged)

    def _accept(
        self, plan: RoundPlan, results: dict[int, ClientUpdate | str]
    ) -> tuple[list[ClientUpdate], dict[str, str]]:
        """The round's usable updates (sorted by client) and, by client, why the others were left out."""
        failures: dict[str, str] = {}
        updates: list[ClientUpdate] = []
        for k in plan.active:
            got = results.get(k, "no reply")
            if isinstance(got, str):
                failures[str(k)] = got
                continue
            try:
                validate_update(got, self.strategy.adapter_rank(self.clients[k].rank), self.client_timeout_s)
            except ClientFailure as e:
                log.warning("round %d: client %d left out: %s", plan.round, k, e)
                failures[str(k)] = f"ClientFailure: {e}"
                continue
            updates.append(got)
        return sorted(updates, key=lambda u: u.client_id), failures

    def _clip(self, updates: list[ClientUpdate]) -> dict[str, Any]:
        if not (self.clip_norm_ratio and updates):
            return {}
        return {"clipped": clip_updates(updates, self.clip_norm_ratio, self.state.dense)}

    def _aggregate(self, updates: list[ClientUpdate], info: dict[str, Any]) -> Adapter:
        """The strategy's new global state and the algorithm's server update; returns what is merged."""
        result = self.strategy.aggregate(updates, self.state)
        self.algorithm.update(updates, sum(c.num_examples for c in self.clients.values()))
        self.state = result.state
        self.updated_rounds += 1
        info.update(result.info)
        return result.merged

    def _keep_merge(self, round_idx: int, merged: Adapter) -> None:
        """Keep merged updates until every client has downloaded them."""
        if merged:
            self.merges.append((round_idx, merged))
        self.merges = [(r, m) for r, m in self.merges if r > min(self.synced.values())]

    @staticmethod
    def _client_metrics(updates: list[ClientUpdate]) -> dict[str, Any]:
        losses = [u.metrics["loss_mean"] for u in updates]
        return {
            "train_loss": sum(losses) / len(losses) if losses else None,
            "client_loss": {
                str(u.client_id): [u.metrics["loss_first"], u.metrics["loss_last"]] for u in updates
            },
        }

    # ------------------------------------------------------ the global model
    def global_adapter(self) -> tuple[Adapter, dict[str, Tensor], dict[str, Tensor]]:
        """The global model on top of the base with every merge applied: adapter, dense modules, LoRA
        biases.
        """
        return (
            self.strategy.global_adapter(self.state),
            dict(self.state.dense),
            self.strategy.global_biases(self.state),
        )

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Tensors and JSON metadata that restore this server exactly (see :meth:`load_state_dict`)."""
        tensors, scales = {}, {}
        for prefix, adapter in [("global.", self.state.factors), ("residual.", self.state.residual)] + [
            (f"merge.{r}.", m) for r, m in self.merges
        ]:
            t, s = adapter_tensors(adapter, prefix)
            tensors.update(t)
            scales.update(s)
        tensors.update(prefixed(self.state.dense, "dense."))
        tensors.update(
            prefixed({k: v for k, v in self.state.extras.items() if isinstance(v, Tensor)}, "extra.")
        )
        tensors.update(prefixed(self.algorithm.state_dict(), "algo."))
        meta = {
            "scales": scales,
            "ledger": self.ledger.state(),
            "strategy": self.strategy.name,
            "merge_rounds": [r for r, _ in self.merges],
            "synced": {str(k): v for k, v in self.synced.items()},
            "updated": self.updated_rounds,
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        state = global_state(tensors, meta)
        self.state = GlobalState(state.factors, state.residual, state.dense or self.state.dense, state.extras)
        self.merges = [
            (r, adapter_from_tensors(tensors, meta["scales"], f"merge.{r}."))
            for r in meta.get("merge_rounds", [])
        ]
        self.algorithm.load_state_dict(unprefixed(tensors, "algo."))
        self.ledger = Ledger.from_state(meta["ledger"])
        self.synced.update({int(k): v for k, v in meta.get("synced", {}).items()})
        self.updated_rounds = meta.get("updated", 0)


def global_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> GlobalState:
    """The global state a server checkpoint holds (see :meth:`Server.state_dict`): the one decoder of that
    layout, used by resume and export alike."""
    scales = meta["scales"]
    return GlobalState(
        adapter_from_tensors(tensors, scales, "global."),
        adapter_from_tensors(tensors, scales, "residual."),
        unprefixed(tensors, "dense."),
        unprefixed(tensors, "extra."),
    )
