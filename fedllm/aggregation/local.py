"""Local-only training: no aggregation, every client keeps its own adapter.

The baseline a personalization method must beat (and the floor that shows
what federation buys): each client trains its adapter on its own data only,
round after round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedllm.aggregation.base import GlobalState, RoundContext, RoundResult, Strategy
from fedllm.aggregation.fedit import FedIT
from fedllm.factors import Adapter, LoraFactors
from fedllm.options import one_of, opt
from fedllm.protocol import ClientUpdate


@dataclass
class LocalOptions:
    score: str = opt(
        "own",
        "what the run's evaluation scores after a round: 'own' (each visited client's own adapter on the "
        "held-out data and benchmark, and their mean: what a client gets without federating; the clients "
        "are eval.personalized_clients' choice, by default the round's sampled ones) or 'mean_adapter' (the "
        "plain mean of the clients' adapters, as FedIT would form it, one model)",
        *one_of("own", "mean_adapter"),
    )


class LocalOnly(Strategy):
    """Keep each client's adapter on the 'server' side only as the client's own storage.

    Client: continues from its own adapter of the previous round; nothing is
    shared. The run's evaluation scores each visited client's own adapter and
    reports the mean over them (``aggregation.local.score = own``), or the plain
    mean of the clients' adapters as one model (``mean_adapter``).
    """

    name = "local"
    global_state = "per_client"
    communicates = False  # the round trip of a client's own adapter is its storage, not traffic
    averages_parameters = False
    options = LocalOptions

    def __init__(self, score: str = "own") -> None:
        if score not in ("own", "mean_adapter"):
            raise ValueError(f"score = {score!r} is invalid: expected own or mean_adapter")
        self.score = score

    @classmethod
    def from_options(cls, options: LocalOptions) -> LocalOnly:
        return cls(options.score)

    @property
    def scored_per_client(self) -> bool:
        return self.score == "own"

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        extras = dict(state.extras)
        for u in updates:
            for key, f in u.factors.items():
                extras[f"local.{u.client_id}.{key}.A"] = f.A
                extras[f"local.{u.client_id}.{key}.B"] = f.B
                extras[f"local.{u.client_id}.{key}.scale"] = torch.tensor(f.scale)
        mean = FedIT().aggregate_factors(updates, weights, state).state.factors
        return RoundResult(GlobalState(mean, dict(state.residual), extras=extras))

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        prefix = f"local.{client_id}."
        mine = {}
        for name, t in state.extras.items():
            if name.startswith(prefix) and name.endswith(".A"):
                key = name[len(prefix) : -2]
                mine[key] = LoraFactors(
                    t, state.extras[f"{prefix}{key}.B"], float(state.extras[f"{prefix}{key}.scale"])
                )
        return mine or None
