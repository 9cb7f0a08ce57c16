"""The server: strategy, global state, sampling, downloads, update checks, clipping, ledger, its checkpoint.

It holds no model (no peft, transformers or accelerate): its surface is
messages. ``plan_round`` samples the round's clients and hands out one
:class:`~fedllm.protocol.ClientStart` per client (what it downloads: its
factors, one exact catch-up for the merges its base missed, the dense modules, strategy and
algorithm state); ``finish_round`` takes back the round's
:class:`~fedllm.protocol.ClientUpdate` s (or why a client failed), accepts
them against what it knows (``fedllm/server/trust.py``: it believes no count, scale,
shape, round or starting point a client claims), clips them, aggregates them when at
least ``min_clients`` are valid, and returns the round's metrics. Nothing a
client sends can raise out of it. Every number it draws derives from
``(seed, round)``, so any driver (one process, several, Flower) gets the same
rounds. Flower's Message-API strategies read the same way
(``configure_train`` / ``aggregate_train``). A cross-cutting feature changes the
server only from outside: it wraps the strategy, sets the policy, replaces the sampling.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedllm.aggregation import GlobalState, RoundContext, Strategy
from fedllm.checks import ClientFailure, Expected, cap_weights, change_norm, finite_tensors, one_line
from fedllm.factors import (
    Adapter,
    adapter_from_tensors,
    adapter_tensors,
    init_factors,
    prefixed,
    unprefixed,
)
from fedllm.logs import client_label, redact
from fedllm.protocol import (
    AlgorithmServer,
    ClientInfo,
    ClientStart,
    ClientUpdate,
    SummedUpdates,
    derive_seed,
    fit_download,
    sample_size,
)
from fedllm.server.catchup import MergeLog
from fedllm.server.ledger import Ledger
from fedllm.server.trust import accept_dense, accept_factors, check_finite, clean_metrics, upload_numel

log = logging.getLogger(__name__)


@dataclass
class RoundPlan:
    """A round as the server planned it: who was sampled, who dropped out, what each active client
    downloads. ``token``: names this plan in every ClientStart (derived from the run's seed and the round,
    so every process of a launch names it alike): an update answers one plan, and the server takes no
    update made for another round or another run.
    """

    round: int
    sampled: list[int]
    dropped: list[int]
    starts: dict[int, ClientStart] = field(default_factory=dict)
    token: str = ""

    @property
    def active(self) -> list[int]:
        return sorted(self.starts)


@dataclass
class RoundReport:
    """What the server reports of a finished round: the metrics row and the update merged into the base."""

    row: dict[str, Any]
    merged: Adapter = field(default_factory=dict)
    reported: dict[str, Any] = field(default_factory=dict)  # what the strategy (or a wrapper) adds: said too


@dataclass
class Sampling:
    """How clients are drawn each round (``federation.*``): from ``(seed, round)``, so every driver and a
    resumed run draw the same rounds. ``public``: the sample may be written to the run folder (a
    feature that needs the sample kept secret replaces this sampling and sets it False)."""

    seed: int = 0
    clients_per_round: int = 0  # 0: use fraction
    fraction: float = 1.0
    dropout: float = 0.0  # share of the sampled clients that never report
    public: bool = True

    def size(self, num_clients: int) -> int:
        return sample_size(self.clients_per_round, self.fraction, num_clients)

    def rng(self, round_idx: int, stream: int) -> random.Random:
        """The generator of one draw (``stream`` 1: the sample, 2: who drops out)."""
        return random.Random(derive_seed(self.seed, round_idx, stream))

    def draw(self, round_idx: int, clients: list[int]) -> tuple[list[int], list[int]]:
        """The round's sampled clients and, among them, those that drop out (never report)."""
        sampled = sorted(self.rng(round_idx, 1).sample(sorted(clients), self.size(len(clients))))
        n_drop = round(self.dropout * len(sampled))
        dropped = sorted(self.rng(round_idx, 2).sample(sampled, n_drop)) if n_drop else []
        return sampled, dropped


@dataclass
class ServerPolicy:
    """What the server enforces on updates (``federation.*`` and ``aggregation.*``; see
    ``fedllm/server/trust.py``).
    """

    min_clients: int = 1
    clip_norm_ratio: float = 0.0  # 0: no clipping
    client_timeout_s: float = 0.0
    weighting: str = "examples"  # or "uniform"
    max_client_weight: float = 1.0  # the largest share of one client in a round's average
    # the bytes an upload takes on the wire (None: float32, 4 bytes a value); set by a transport feature
    upload_bytes: Callable[[ClientUpdate], int] | None = None
    # what each download becomes on its way (a transport's encoding: the client gets the decoded values) and
    # the bytes it takes (None: as it is, float32)
    download_transform: Callable[[ClientStart], ClientStart] | None = None
    download_bytes: Callable[[ClientStart], int] | None = None
    # each round's row counts the clipped updates (0 when no clip runs) and the largest update change over the
    # round's median change (what a clip at a ratio would have cut); off where a privacy mode forbids
    # statistics of single updates (differential privacy)
    norm_stats: bool = True


class Server:
    """The server half of a federated run (see module docstring).

    ``modules``: ``{module: (out, in)}`` of the LoRA target modules in model
    order, from the assembly (the server holds no model); with the clients'
    ranks, scales and the seed it is what lets the server know the shape of
    every update and the fresh initialization every client starts from.
    """

    def __init__(
        self,
        *,
        strategy: Strategy,
        clients: list[ClientInfo],
        modules: dict[str, tuple[int, int]],
        algorithm: AlgorithmServer | None = None,
        sampling: Sampling | None = None,
        dense: dict[str, Tensor] | None = None,
        policy: ServerPolicy | None = None,
    ) -> None:
        self.strategy = strategy
        self.hook = strategy.client_hook()  # to derive what each client starts from, as it does
        self.clients = {c.client_id: c for c in clients}
        self.modules = dict(modules)
        self.algorithm = algorithm or AlgorithmServer()
        self.sampling = sampling or Sampling()
        self.policy = policy or ServerPolicy()
        self.max_rank = max(strategy.adapter_rank(c.rank) for c in clients)
        self.state = GlobalState(
            strategy.initial_factors(
                self.modules, self.max_rank, self.hook.fresh_seed(self.sampling.seed, 1)
            ),
            dense=dict(dense or {}),
        )
        self.ledger = Ledger(by_client=self.sampling.public, counts=strategy.communicates)
        # this round's references, by client, with the start each was derived from
        self._references: tuple[int | None, dict[int, tuple[ClientStart, Adapter]]] = (None, {})
        # a merging strategy's own option: the merges kept for catch-ups (beyond them: the whole residual)
        self.merges = MergeLog(list(self.clients), strategy.catchup_window)
        self.last_aggregated = {
            k: 0 for k in self.clients
        }  # the last round that aggregated each client's update
        self.updated_rounds = 0  # rounds whose aggregate changed the global state
        self.algorithm.bind(self.expected(next(iter(self.clients)), rank=self.max_rank).param_shapes())

    # ------------------------------------------------------------- a round
    def sample(self, round_idx: int) -> tuple[list[int], list[int]]:
        """The round's sampled clients and, among them, those that drop out (never report)."""
        return self.sampling.draw(round_idx, list(self.clients))

    def client_start(self, round_idx: int, client_id: int, token: str = "") -> ClientStart:
        """What ``client_id`` downloads for ``round_idx`` (pure: changes nothing, counts nothing)."""
        c = self.clients[client_id]
        rank = self.strategy.adapter_rank(c.rank)
        factors = self.strategy.client_factors(self.state, c.rank, c.scale, client_id)
        return ClientStart(
            round=round_idx,
            factors=factors,
            catchup=self.merges.catchup(client_id, self.state.residual),
            dense=dict(self.state.dense),
            extras=self.strategy.client_extras(self.state, client_id),
            algo=self.algorithm.download(rank, client_id),
            last_aggregated=self.last_aggregated[client_id],
            token=token,
        )

    def plan_round(self, round_idx: int) -> RoundPlan:
        """Sample the round and hand out each active client's start; counts their downloads."""
        sampled, dropped = self.sample(round_idx)
        self.ledger.start_round()
        plan = RoundPlan(
            round_idx, sampled, dropped, token=f"{derive_seed(self.sampling.seed, round_idx, 31):016x}"
        )
        for k in sampled:
            if k in dropped:
                continue
            start = self.client_start(round_idx, k, plan.token)
            if self.policy.download_transform is not None:
                start = self.policy.download_transform(start)
            plan.starts[k] = start
            nbytes = self.policy.download_bytes(start) if self.policy.download_bytes is not None else None
            behind = self.merges.behind_newest(start.catchup) * self.ledger.bytes_per_param  # float32 only
            self.ledger.download(k, start.numel(), nbytes, behind)
        return plan

    def finish_round(
        self, plan: RoundPlan, results: dict[int, ClientUpdate | str] | SummedUpdates
    ) -> RoundReport:
        """Accept, count, clip and aggregate the round's updates; the merged update is the report's.

        ``results`` maps each active client to its update, or to why it
        failed (an exception on the client, a lost message).
        """
        t0 = time.perf_counter()
        summed: SummedUpdates | None = None
        if isinstance(
            results, SummedUpdates
        ):  # secure aggregation: the sum of the uploads, never one of them
            summed = results
            updates, failures, replied = self._accept_sum(plan, results)
            answered = set(results.clients)
            info: dict[str, Any] = {}
            valid = results.contributors if updates else 0
        else:
            updates, failures = self._accept(plan, results)
            replied = [u.client_id for u in updates]
            answered = {k for k in plan.active if not isinstance(results.get(k, "no reply"), str)}
            info = self._clip(plan, updates)
            valid = len(updates)
        skipped = valid < self.policy.min_clients
        merged: Adapter = {}
        if skipped:
            log.warning(
                "round %d skipped: %d valid update(s) < federation.min_clients = %d",
                plan.round,
                valid,
                self.policy.min_clients,
            )
        else:
            merged, skipped = self._aggregate(plan, updates, info, replied, contributors=valid, summed=summed)
        self.merges.add(plan.round, merged)
        for k in plan.active:  # a client that replied applied its catch-up first
            if k in answered:
                self.merges.replied(k, plan.starts[k].catchup)
            else:
                self.merges.failed(k)
        row = {
            "round": plan.round,
            **self._who(plan, failures, updates),
            "n_updates": valid,
            "skipped": skipped,
            **{f"agg_{k}": v for k, v in info.items()},
            "n_sampled": len(plan.sampled),
            "n_failed": len(failures),
            "n_dropped": len(plan.dropped),
            **self.ledger.round_summary(),
            "time_aggregate_s": time.perf_counter() - t0,
        }
        reported = self.strategy.round_report(plan.round)
        return RoundReport({**row, **reported}, merged, reported)

    def _who(self, plan: RoundPlan, failures: dict[str, str], updates: list[ClientUpdate]) -> dict[str, Any]:
        """The round's clients by id, when the sampling is public; else only how many, and the failures'
        reasons without ids (a secret sample must not be written where its adversary reads it)."""
        losses = [u.metrics["loss_mean"] for u in updates if "loss_mean" in u.metrics]
        out: dict[str, Any] = {"train_loss": sum(losses) / len(losses) if losses else None}
        if not self.sampling.public:
            return {**out, "failed": sorted(redact(why) for why in failures.values())}
        return {
            **out,
            "sampled": plan.sampled,
            "dropped": plan.dropped,
            "failed": failures,
            "client_loss": {
                str(u.client_id): [u.metrics.get("loss_first"), u.metrics.get("loss_last")] for u in updates
            },
        }

    # ------------------------------------------------- what the server believes
    def expected(self, client_id: int, rank: int | None = None, plan: RoundPlan | None = None) -> Expected:
        """What an update of ``client_id`` must be, from what the server knows (``rank``: another adapter
        rank, for shapes at the largest one; ``plan``: the round it must answer, and what it was asked)."""
        c = self.clients[client_id]
        start = plan.starts.get(client_id) if plan is not None else None
        return Expected(
            client_id=client_id,
            num_examples=c.num_examples,
            rank=rank or self.strategy.adapter_rank(c.rank),
            scale=c.scale,
            modules=self.modules,
            dense={k: v.shape for k, v in self.state.dense.items()},
            timeout_s=self.policy.client_timeout_s,
            round=plan.round if plan is not None else None,
            token=plan.token if plan is not None else None,
            asked=dict(start.extras) if start is not None else {},
        )

    def _upload_bytes(self, update: ClientUpdate) -> int | None:
        if self.policy.upload_bytes is None:
            return None
        try:
            return self.policy.upload_bytes(update)
        except Exception:  # a malformed upload: counted by what can be read, in float32
            return None

    def _accept(
        self, plan: RoundPlan, results: dict[int, ClientUpdate | str]
    ) -> tuple[list[ClientUpdate], dict[str, str]]:
        """The round's usable updates (checked copies, sorted by client) and, by client, why the others were
        left out. Uploads count in the ledger whether or not they are used: they travelled."""
        failures: dict[str, str] = {}
        updates: list[ClientUpdate] = []
        for k in plan.active:
            got = results.get(k, "no reply")
            if isinstance(got, str):
                failures[str(k)] = one_line(got)
                continue
            self.ledger.upload(k, upload_numel(got), self._upload_bytes(got))
            try:
                u = self.accept(got, self.expected(k, plan=plan))
                u.factors = self.hook.for_round(plan.round).incoming(
                    u.factors, self.reference(plan.round, k, plan.starts[k])
                )
                updates.append(u)
            except Exception as e:  # whatever a client sends, it is that client's failure only
                why = one_line(
                    str(e) if isinstance(e, ClientFailure) else f"unreadable update ({type(e).__name__}: {e})"
                )
                log.warning("round %d: %s left out: %s", plan.round, client_label(k), redact(why))
                failures[str(k)] = f"ClientFailure: {why}"
        return sorted(updates, key=lambda u: u.client_id), failures

    def _accept_sum(
        self, plan: RoundPlan, summed: SummedUpdates
    ) -> tuple[list[ClientUpdate], dict[str, str], list[int]]:
        """A secure round's one update (the sum) if it is finite, the failures, and the clients it holds.
        Each contributor's masked vector counts as its upload; nothing else of one site can be checked here
        (docs/trust.md: what the server trusts under secure aggregation)."""
        failures = {str(k): one_line(why) for k, why in summed.failures.items()}
        clients = [k for k in plan.active if k in summed.clients]
        for k in clients:
            self.ledger.upload(k, summed.upload_numel, summed.upload_bytes)
        u = summed.update
        tensors = [t for f in u.factors.values() for t in (f.A, f.B)] + list(u.dense.values())
        if clients and not finite_tensors(tensors):
            log.warning("round %d: the secure sum is not finite: the round is skipped", plan.round)
            return [], {**failures, "sum": "the secure sum is not finite"}, []
        return ([u] if clients else []), failures, clients

    def accept(self, update: ClientUpdate, exp: Expected) -> ClientUpdate:
        """A checked copy of ``update`` with the server's own count and scale, or ClientFailure saying why."""
        if not isinstance(update, ClientUpdate):
            raise ClientFailure(f"the reply is a {type(update).__name__}, not a client update")
        if update.client_id != exp.client_id:
            raise ClientFailure(f"it claims to be client {update.client_id!r}")
        if exp.round is not None and (update.round != exp.round or update.token != exp.token):
            raise ClientFailure(
                f"it answers round {update.round!r} (token {str(update.token)[:16]!r}), not this round's "
                f"plan ({exp.round}): a replayed or stale update"
            )
        if update.num_examples != exp.num_examples:
            raise ClientFailure(
                f"it claims {update.num_examples!r} examples; {exp.num_examples} are registered for it"
            )
        metrics = clean_metrics(update.metrics)
        if exp.timeout_s and metrics.get("train_s", 0.0) > exp.timeout_s:
            raise ClientFailure(
                f"ran {metrics['train_s']:.1f}s, past federation.client_timeout_s={exp.timeout_s}"
            )
        extras = update.extras if isinstance(update.extras, dict) else {}
        accepted = {**self.strategy.accept_extras(extras, exp), **self.algorithm.accept_extras(extras, exp)}
        unknown = sorted(set(extras) - set(accepted))
        if unknown:
            raise ClientFailure(f"it sends {len(unknown)} unexpected extra tensor(s), e.g. {unknown[0]!r}")
        return ClientUpdate(
            client_id=exp.client_id,
            num_examples=exp.num_examples,
            factors=accept_factors(update.factors, exp, self.hook.for_round(exp.round).uploads),
            dense=accept_dense(update.dense, exp),
            extras=accepted,
            metrics=metrics,
            round=update.round,
            token=update.token,
        )

    def reference(self, round_idx: int, client_id: int, start: ClientStart) -> Adapter:
        """The factors ``client_id`` started ``round_idx`` from, derived as the client derives them: its
        download, or the round's fresh initialization (never what a client says it started from).

        Derived once per update and kept for the round: the acceptance, the clip, the strategy's context and
        a driver's decoding all read the same tensors (read-only)."""
        if self._references[0] != round_idx:
            self._references = (round_idx, {})
        kept = self._references[1]
        if client_id not in kept or kept[client_id][0] is not start:  # (another plan of the same round)
            kept[client_id] = (start, self.derive_reference(round_idx, client_id, start))
        return kept[client_id][1]

    def derive_reference(self, round_idx: int, client_id: int, start: ClientStart) -> Adapter:
        """:meth:`reference`'s derivation (a fresh init of the client's rank and the hook's start)."""
        c = self.clients[client_id]
        rank = self.strategy.adapter_rank(c.rank)
        fresh = init_factors(self.modules, rank, c.scale, self.hook.fresh_seed(self.sampling.seed, round_idx))
        return self.hook.start_factors(fit_download(start.factors, fresh), fresh)

    def _clip(self, plan: RoundPlan, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Scale each update's change (from the server's reference) to at most ``clip_norm_ratio`` x the
        round's median change: one client cannot move the model more than a few honest ones do. With no clip,
        the same figures are measured and nothing is scaled (0 clipped: a count that could have been more,
        and the largest change over the median, which says what a clip would have cut)."""
        ratio = self.policy.clip_norm_ratio
        if not updates or not (ratio or self.policy.norm_stats):
            return {}
        changes = [self.change(plan, u) for u in updates]
        norms = [change_norm(pairs) for pairs in changes]
        median = float(torch.tensor(norms).median())
        stats = {"update_norm_ratio_max": max(norms) / median if median > 0 else None}
        if not ratio:
            return {"clipped": 0, "update_norm_median": median, **stats}
        cap = ratio * median
        clipped = 0
        for pairs, n in zip(changes, norms, strict=True):
            if n > cap > 0:
                c = cap / n
                for value, ref in pairs:
                    value.sub_(ref).mul_(c).add_(ref)  # in place: the update's own checked copies
                clipped += 1
        return {
            "clipped": clipped,
            "update_norm_median": median,
            **stats,
            "algo_clipped": self.algorithm.clip(updates, ratio),
        }

    def change(self, plan: RoundPlan, u: ClientUpdate) -> list[tuple[Tensor, Tensor]]:
        """``(value, reference)`` pairs of everything ``u`` changes: its factors, dense modules and the
        strategy's shared extras (FLoRAL's bias adaptors, FedSA-LoRA's shared B)."""
        start = plan.starts[u.client_id]
        ref = self.reference(plan.round, u.client_id, start)
        pairs = []
        for key, f in u.factors.items():
            r = ref[key].with_scale(f.scale)
            pairs += [(t, r_t) for t, r_t in ((f.A, r.A), (f.B, r.B)) if t is not None and t.numel()]
        pairs += [(t, self.state.dense[k]) for k, t in u.dense.items()]
        pairs += [
            (t, start.extras.get(k, torch.zeros_like(t))) for k, t in self.strategy.shared_extras(u).items()
        ]
        return pairs

    def weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Each update's share of the round's average, from the server's own counts (or uniform), capped."""
        if self.policy.weighting == "uniform":
            raw = [1.0] * len(updates)
        else:
            raw = [float(self.clients[u.client_id].num_examples) for u in updates]
        total = sum(raw)
        base = [w / total for w in raw] if total > 0 else [1 / len(updates)] * len(updates)
        return cap_weights(base, self.policy.max_client_weight)

    def population_weights(self) -> dict[int, float]:
        """Every client's share of the objective ``sum_k p_k f_k`` (SCAFFOLD's control variate keeps
        ``c = sum_k p_k c_k`` with these)."""
        if self.policy.weighting == "uniform":
            return {k: 1 / len(self.clients) for k in self.clients}
        total = sum(c.num_examples for c in self.clients.values())
        return {k: c.num_examples / total for k, c in self.clients.items()}

    def context(self, plan: RoundPlan, updates: list[ClientUpdate]) -> RoundContext:
        """What the strategy (or a wrapper of it) may know of the round besides the updates."""
        return RoundContext(
            round=plan.round,
            sampled=len(plan.sampled),
            references=[self.reference(plan.round, u.client_id, plan.starts[u.client_id]) for u in updates],
            max_rank=self.max_rank,
            fresh=lambda: init_factors(
                self.modules, self.max_rank, 1.0, self.hook.fresh_seed(self.sampling.seed, plan.round)
            ),
            max_weight=self.policy.max_client_weight,
        )

    def _aggregate(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        info: dict[str, Any],
        replied: list[int],
        contributors: int,
        summed: SummedUpdates | None = None,
    ) -> tuple[Adapter, bool]:
        """The strategy's new global state and the algorithm's server update; returns what is merged, and
        whether the round had to be skipped (an aggregate or a server state that fails or is not finite
        changes nothing). ``replied``: the clients the updates hold (a secure sum is one update of
        ``contributors`` clients, aggregated with weight 1: ``summed``)."""
        round_idx = plan.round
        before = self.algorithm.state_dict()
        context = self.context(plan, [] if summed else updates)
        context.contributors = contributors
        if replied and self.sampling.public:  # under a secret sample the ranks that took part are secret too
            context.trained_rank = max(self.strategy.adapter_rank(self.clients[k].rank) for k in replied)
        if summed is not None:
            context.references = [summed.reference]
        try:
            result = self.strategy.aggregate(
                updates, self.state, [1.0] if summed else self.weights(updates), context
            )
            check_finite(result.state, result.merged)
            self.algorithm.update(updates, self.population_weights())
            if not finite_tensors(self.algorithm.state_dict().values()):
                raise ValueError("the client algorithm's server state would hold non-finite values")
        except (ValueError, RuntimeError) as e:  # e.g. an SVD that does not converge
            self.algorithm.load_state_dict(before)
            log.error(
                "round %d skipped: the aggregate failed (%s); the global state is unchanged", round_idx, e
            )
            info["error"] = one_line(f"{type(e).__name__}: {e}")
            return {}, True
        self.state = result.state
        self.updated_rounds += 1
        info.update(result.info)
        for k in replied:
            self.last_aggregated[k] = round_idx
        return result.merged, False

    # ------------------------------------------------------ the global model
    def global_adapter(self) -> tuple[Adapter, dict[str, Tensor], dict[str, Tensor]]:
        """The global model on the base with every merge applied: adapter, dense modules, LoRA biases."""
        return (
            self.strategy.global_adapter(self.state),
            dict(self.state.dense),
            self.strategy.global_biases(self.state),
        )

    def client_model(self, client_id: int) -> tuple[Adapter, dict[str, Tensor], dict[str, Tensor]] | None:
        """``client_id``'s own adapter where the strategy keeps one (:attr:`Strategy.scored_per_client`), as
        :meth:`global_adapter` gives the global one; None for a client that has none yet (never trained).
        Dense modules (``lora.trainable_modules``) are the global ones: no strategy keeps them per client."""
        c = self.clients[client_id]
        factors = self.strategy.client_factors(self.state, c.rank, c.scale, client_id)
        if not factors:
            return None
        return factors, dict(self.state.dense), {}

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Tensors and JSON metadata that restore this server exactly (see :meth:`load_state_dict`)."""
        tensors, scales, merges = self.merges.state_dict()
        state, state_meta = state_tensors(self.state)
        tensors.update(state)
        scales.update(state_meta["scales"])
        tensors.update(prefixed(self.algorithm.state_dict(), "algo."))
        meta = {
            "extras": state_meta["extras"],
            "last_aggregated": {str(k): v for k, v in self.last_aggregated.items()},
            "scales": scales,
            "ledger": self.ledger.state(),
            "strategy": self.strategy.name,
            "updated": self.updated_rounds,
            **merges,
        }
        if not self.sampling.public:  # each client's last round would name who took part in which round
            del meta["last_aggregated"], meta["synced"]
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        state = global_state(tensors, meta)
        self.state = GlobalState(state.factors, state.residual, state.dense or self.state.dense, state.extras)
        self.merges.load_state_dict(tensors, meta)
        self.algorithm.load_state_dict(unprefixed(tensors, "algo."))
        self.ledger = Ledger.from_state(meta["ledger"])
        # "accepted": its name in checkpoints written before 2026-12-03
        rounds = meta.get("last_aggregated", meta.get("accepted", {}))
        self.last_aggregated.update({int(k): v for k, v in rounds.items()})
        self.updated_rounds = meta.get("updated", 0)


def state_tensors(state: GlobalState) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A global state as flat tensors and JSON metadata (scales, a strategy's plain numbers): the layout
    :func:`global_state` reads, in a checkpoint and in secure aggregation's round statement alike."""
    tensors: dict[str, Tensor] = {}
    scales: dict[str, float] = {}
    for prefix, adapter in (("global.", state.factors), ("residual.", state.residual)):
        t, s = adapter_tensors(adapter, prefix)
        tensors.update(t)
        scales.update(s)
    tensors.update(prefixed(state.dense, "dense."))
    tensors.update(prefixed({k: v for k, v in state.extras.items() if isinstance(v, Tensor)}, "extra."))
    counters = {}  # a strategy's plain numbers (FedSA-LoRA's sharing schedule, FedSVD's re-factorings)
    for k, v in state.extras.items():
        if isinstance(v, Tensor):
            continue
        if not isinstance(v, bool | int | float):
            raise TypeError(
                f"strategy state extras[{k!r}] is a {type(v).__name__}: a checkpoint keeps "
                "tensors and plain numbers only"
            )
        counters[k] = v
    return tensors, {"scales": scales, "extras": counters}


def global_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> GlobalState:
    """The global state a server checkpoint holds (see :meth:`Server.state_dict`): the one decoder of that
    layout, used by resume and export alike."""
    scales = meta["scales"]
    return GlobalState(
        adapter_from_tensors(tensors, scales, "global."),
        adapter_from_tensors(tensors, scales, "residual."),
        unprefixed(tensors, "dense."),
        {**unprefixed(tensors, "extra."), **meta.get("extras", {})},
    )
