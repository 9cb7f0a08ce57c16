"""Adaptive federated optimization: a server optimizer around any strategy whose global state is parameters.

Reddi et al., "Adaptive Federated Optimization" (ICLR 2021, arXiv 2003.00295), and FedAvgM (Hsu, Qi and Brown,
arXiv 1909.06335). The server treats the round's change of the global parameters as a pseudo-gradient,
``delta_t = aggregate_t - x_t``, where ``aggregate_t`` is what the inner strategy would have made the new
global state (FedIT's averaged A and B, FFA-LoRA's averaged B, ...) and ``x_t`` what the round's clients
started from, and steps with it:

* **FedAvgM**: ``v = mu v + (-delta_t)`` (``v = -delta_t`` in the first step), ``x_{t+1} = x_t - eta v``;
* **FedAdagrad**: ``m = delta_t``, ``v = v + delta_t^2``;
* **FedYogi**: ``m = b1 m + (1 - b1) delta_t``, ``v = v - (1 - b2) delta_t^2 sign(v - delta_t^2)``;
* **FedAdam**: ``m = b1 m + (1 - b1) delta_t``, ``v = b2 v + (1 - b2) delta_t^2``;

and, for the last three, ``x_{t+1} = x_t + eta m / (sqrt(v) + tau)``, coordinate-wise. These are Flower
1.42's ``flwr.serverapp.strategy`` ``FedAvgM``, ``FedAdagrad``, ``FedYogi`` and ``FedAdam`` on the same
arrays (``tests/test_server_opt.py`` runs both for several rounds), including Flower's bias correction of
FedAdam, ``eta sqrt(1 - b2^(t+1)) / (1 - b1^(t+1))`` with ``t`` the round number, which the paper's
Algorithm 2 does not have: ``aggregation.fedadam.bias_correction=false`` gives the paper's rule.

What is stepped: the factors the strategy's clients upload (``hook.uploads``: A and B for FedIT and HetLoRA,
B for FFA-LoRA, A for FedSA-LoRA) in the server's aggregation space (scale folded into B, zero-padded to the
federation's largest rank), and the fully trained dense modules. Everything else of the inner state
(FFA-LoRA's frozen A, FedSA-LoRA's shared B mean, the strategy's own extras) is the inner strategy's, but
for the strategy's shared parameters that persist in its state between rounds (the hook's ``shared_extras``
present in the state before and after the round at one shape: Fed-SB's R), which step like the factors. The
optimizer's moments live in the state's extras (``server_opt.*``), so they are checkpointed with it and a
resumed run continues exactly; they never travel (a client's download is the strategy's ``client_factors`` /
``client_extras``, which do not read them).

Which strategies: those whose ``global_state`` is ``"parameters"`` (a persisting point the clients start
from). The others are refused by the config's rules with the reason: FLoRA, FLoRIST and FedEx-LoRA merge each
round into the base (their clients restart from fresh adapters: no global adapter to step); FlexLoRA's
global factors are a new SVD of the averaged product every round (their difference is no step in a fixed
parameter); FLoRAL and local-only keep every client's own adapter or router.

Components of the global factors that no client of a round trained (beyond the largest rank of the round's
clients, which the server knows from its registry: ``RoundContext.trained_rank``) are neither stepped nor
are their moments changed, as torch's ``SparseAdam`` leaves the rows a batch did not touch: the inner
strategy's padding there (zeros for FedIT and FFA-LoRA, the old global for RoLoRA) is no one's change, and
a zero pseudo-gradient would let a momentum keep moving them (after a full-rank round, a round of rank-2/1
clients moved rows 2-3 of A by 0.1 under FedAvgM before this rule). Flower's strategies step the whole
vector: they see one array per parameter, not which parts were trained. A round without updates takes no
step, and the bias correction still counts it (Flower's ``server_round``). RoLoRA trains each factor every
other round, so its factors' moments age by two rounds per step and FedAdam's bias correction counts rounds,
not steps: the optimizer is defined for it, not tuned to it. A download budget (clients start from part of
the global factors) is refused with a server optimizer.

Composition: the optimizer wraps the strategy *outside* the features (``fedllm.assembly.build_server``), so
under central DP it steps with the noised aggregate: the step is post-processing of a DP release and the
guarantee is unchanged (what Reddi et al.'s DP variants and Flower's wrappers order alike).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedllm.aggregation.base import (
    GlobalState,
    RoundContext,
    RoundResult,
    Strategy,
    StrategyWrapper,
    base_point,
)
from fedllm.factors import LoraFactors, pad_rank
from fedllm.options import opt
from fedllm.protocol import ClientUpdate

PREFIX = "server_opt."  # the optimizer's moments in the state's extras


def _positive(x: float) -> bool:
    return x > 0


def _beta(x: float) -> bool:
    return 0 <= x < 1


@dataclass
class FedAvgMOptions:
    eta: float = opt(1.0, "server learning rate (Flower's server_learning_rate)", _positive, "> 0")
    momentum: float = opt(
        0.9,
        "server momentum mu (Hsu et al.'s 0.9; 0 with eta 1 is FedAvg, Flower's default)",
        _beta,
        "in [0, 1)",
    )


@dataclass
class FedAdagradOptions:
    eta: float = opt(1e-2, "server learning rate", _positive, "> 0")
    tau: float = opt(1e-3, "adaptivity: added to sqrt(v) in the denominator", _positive, "> 0")


@dataclass
class FedYogiOptions:
    eta: float = opt(1e-2, "server learning rate (Flower's default)", _positive, "> 0")
    beta_1: float = opt(0.9, "first-moment decay", _beta, "in [0, 1)")
    beta_2: float = opt(0.99, "second-moment decay", _beta, "in [0, 1)")
    tau: float = opt(1e-3, "adaptivity: added to sqrt(v) in the denominator", _positive, "> 0")


@dataclass
class FedAdamOptions:
    eta: float = opt(1e-2, "server learning rate", _positive, "> 0")
    beta_1: float = opt(0.9, "first-moment decay", _beta, "in [0, 1)")
    beta_2: float = opt(0.99, "second-moment decay", _beta, "in [0, 1)")
    tau: float = opt(1e-3, "adaptivity: added to sqrt(v) in the denominator", _positive, "> 0")
    bias_correction: bool = opt(
        True,
        "scale eta by sqrt(1 - beta_2^(t+1)) / (1 - beta_1^(t+1)) at round t, as Flower's FedAdam does "
        "(false: the paper's Algorithm 2, no correction)",
    )


SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {}


class ServerOptimizer(StrategyWrapper, register=False):
    """The inner strategy with a server optimizer on its global parameters (module docstring)."""

    method: ClassVar[str] = ""  # its aggregation.server_opt value
    options: ClassVar[type]
    moments: ClassVar[tuple[str, ...]] = ()  # the per-tensor state it keeps: "m", "v"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.method:
            SERVER_OPTIMIZERS[cls.method] = cls

    def __init__(self, inner: Strategy, options: Any = None) -> None:
        super().__init__(inner)
        self.opts = options if options is not None else type(self).options()

    def aggregate(
        self,
        updates: list[ClientUpdate],
        state: GlobalState,
        weights: list[float] | None = None,
        context: RoundContext | None = None,
    ) -> RoundResult:
        if context is None:
            raise ValueError(f"aggregation.server_opt={self.method} needs the round's context")
        start = base_point(state, context)
        result = self.inner.aggregate(updates, state, weights, context)
        new = result.state
        uploads = self.inner.client_hook().for_round(context.round).uploads
        moments = {k: v for k, v in state.extras.items() if k.startswith(PREFIX)}
        trained = context.trained_rank if context.trained_rank is not None else context.max_rank
        factors = {}
        for key, f in new.factors.items():
            rank = max(f.rank, start[key].rank) if key in start else f.rank
            g = pad_rank(f.folded(), rank)
            x = pad_rank(start[key], rank) if key in start else None
            lead = min(f.rank, trained)  # the components a client of this round trained
            if x is not None and lead < rank:  # the others: neither stepped nor their moments moved
                g.A[lead:], g.B[:, lead:] = x.A[lead:], x.B[:, lead:]
            A, B = g.A, g.B
            if x is not None and "A" in uploads:
                A = self._step(f"{key}.A", x.A, g.A, moments, context.round, (slice(lead, None),))
            if x is not None and "B" in uploads:
                B = self._step(f"{key}.B", x.B, g.B, moments, context.round, (slice(None), slice(lead, None)))
            factors[key] = LoraFactors(A, B, 1.0)
        dense = {
            k: self._step(f"dense.{k}", state.dense[k], t, moments, context.round) if k in state.dense else t
            for k, t in new.dense.items()
        }
        extras = {k: v for k, v in new.extras.items() if not k.startswith(PREFIX)}
        shared = self.inner.client_hook().shared_extras
        for k, t in extras.items():  # persisting shared parameters (Fed-SB's R) step like the factors
            x_k = state.extras.get(k)
            if shared and k.startswith(shared) and isinstance(x_k, Tensor) and x_k.shape == t.shape:
                extras[k] = self._step(f"extras.{k}", x_k, t, moments, context.round)
        extras.update(moments)
        result.state = GlobalState(factors, new.residual, dense, extras)
        return result

    def _step(
        self,
        name: str,
        x: Tensor,
        target: Tensor,
        moments: dict[str, Any],
        t: int,
        untrained: tuple[slice, ...] | None = None,
    ) -> Tensor:
        """``x`` stepped with the pseudo-gradient ``target - x``; the moments of ``name`` updated in place.
        ``untrained``: the part no client of the round trained, left as it was, its moments too (lazily, as
        torch's ``SparseAdam`` treats the rows a batch did not touch): a momentum there would otherwise keep
        moving what nobody trained, and a zero pseudo-gradient would decay its moments as if observed."""
        delta = target - x
        state = {}
        for m in self.moments:
            prev = moments.get(f"{PREFIX}{m}.{name}")
            state[m] = None if prev is None or prev.shape != delta.shape else prev
        new_x, new_state = self.update(x, delta, state, t)
        if untrained is not None:
            new_x = new_x.clone()
            new_x[untrained] = x[untrained]
            for m, v in new_state.items():
                prev = state.get(m)
                v = v.clone()
                v[untrained] = 0.0 if prev is None else prev[untrained]
                new_state[m] = v
        for m, v in new_state.items():
            moments[f"{PREFIX}{m}.{name}"] = v
        return new_x

    @abc.abstractmethod
    def update(
        self, x: Tensor, delta: Tensor, state: dict[str, Tensor | None], t: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The new parameter and moments from ``delta`` at round ``t`` (a moment is None before its first
        step)."""

    def round_report(self, round_idx: int) -> dict[str, Any]:
        return self.inner.round_report(round_idx)

    def run_summary(self, rounds: int) -> dict[str, Any]:
        out = dict(self.inner.run_summary(rounds))
        out["server_opt"] = {"name": self.method, **dataclasses.asdict(self.opts)}
        return out


class FedAvgM(ServerOptimizer):
    """Server momentum on the pseudo-gradient ``-delta`` (Flower's ``FedAvgM``)."""

    method = "fedavgm"
    options = FedAvgMOptions
    moments = ("m",)

    def update(
        self, x: Tensor, delta: Tensor, state: dict[str, Tensor | None], t: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        g = -delta
        mom = g if state["m"] is None else self.opts.momentum * state["m"] + g
        if self.opts.momentum == 0:  # Flower keeps no momentum vector then
            return x - self.opts.eta * g, {}
        return x - self.opts.eta * mom, {"m": mom}


class _Adaptive(ServerOptimizer):
    """FedAdagrad, FedYogi, FedAdam: ``x + eta m / (sqrt(v) + tau)`` with their own second moment."""

    moments = ("m", "v")

    @abc.abstractmethod
    def second(self, v: Tensor, d2: Tensor) -> Tensor:
        """The second moment after one step, from the last one and the squared change."""

    def lr(self, t: int) -> float:
        return float(self.opts.eta)

    def update(
        self, x: Tensor, delta: Tensor, state: dict[str, Tensor | None], t: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        b1 = getattr(self.opts, "beta_1", 0.0)
        m = torch.zeros_like(delta) if state["m"] is None else state["m"]
        m = b1 * m + (1 - b1) * delta
        v = torch.zeros_like(delta) if state["v"] is None else state["v"]
        v = self.second(v, delta * delta)
        return x + self.lr(t) * m / (v.sqrt() + self.opts.tau), {"m": m, "v": v}


class FedAdagrad(_Adaptive):
    method = "fedadagrad"
    options = FedAdagradOptions

    def second(self, v: Tensor, d2: Tensor) -> Tensor:
        return v + d2


class FedYogi(_Adaptive):
    method = "fedyogi"
    options = FedYogiOptions

    def second(self, v: Tensor, d2: Tensor) -> Tensor:
        beta_2 = float(self.opts.beta_2)
        return v - (1 - beta_2) * d2 * torch.sign(v - d2)


class FedAdam(_Adaptive):
    method = "fedadam"
    options = FedAdamOptions

    def second(self, v: Tensor, d2: Tensor) -> Tensor:
        beta_2 = float(self.opts.beta_2)
        return beta_2 * v + (1 - beta_2) * d2

    def lr(self, t: int) -> float:
        if not self.opts.bias_correction:
            return float(self.opts.eta)
        eta, beta_1, beta_2 = float(self.opts.eta), float(self.opts.beta_1), float(self.opts.beta_2)
        return float(eta * math.sqrt(1 - beta_2 ** (t + 1.0)) / (1 - beta_1 ** (t + 1.0)))


def with_server_opt(strategy: Strategy, agg: Any) -> Strategy:
    """``strategy`` inside the server optimizer ``aggregation.server_opt`` names (as it is for none)."""
    if agg.server_opt == "none":
        return strategy
    cls = SERVER_OPTIMIZERS[agg.server_opt]
    return cls(strategy, getattr(agg, agg.server_opt))
