"""The strategy protocol and its registry.

A strategy sees plain tensors only (no peft, no transformers, no config). Each
round the server calls :meth:`Strategy.aggregate` with the valid client
updates and the current :class:`GlobalState`, and :meth:`Strategy.client_factors`
(and :meth:`Strategy.client_extras`) to learn what each client of the next
round starts from. It never branches on a name. A strategy whose clients train
differently (FLoRAL's routers) names its client side in :attr:`Strategy.hook`,
declared in its own file; the client runtime runs it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from fedllm.checks import Expected
from fedllm.factors import Adapter, LoraFactors, fit_rank, pad_rank, weighted_mean
from fedllm.options import opt, positive
from fedllm.protocol import ClientHook, ClientUpdate

STRATEGIES: dict[str, type[Strategy]] = {}


@dataclass
class GlobalState:
    """The server's state after a round.

    ``factors``: the global adapter (scale folded; empty when the strategy
    merges into the base). ``residual``: everything merged into the base so
    far, kept as factors so that a run can be resumed and exported exactly.
    ``dense``: averaged fully trained modules. ``extras``: strategy state.
    """

    factors: Adapter = field(default_factory=dict)
    residual: Adapter = field(default_factory=dict)
    dense: dict[str, Tensor] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundResult:
    """``state``: the new global state; ``merged``: the update merged into the base this round."""

    state: GlobalState
    merged: Adapter = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundContext:
    """What the server knows of a round beside the updates, for a strategy (or a wrapper) that needs it.

    ``references``: what each update's client started from (the server's own derivation, in the order of
    the updates); ``sampled``: how many clients the round sampled; ``max_rank``: the largest adapter rank
    of the federation; ``fresh()``: the round's shared fresh initialization at that rank (computed on
    demand); ``max_weight``: the server's cap on one client's share of an average; ``contributors``: how many
    clients the updates stand for (secure aggregation hands one update, the sum of several);
    ``trained_rank``: the largest rank those clients train (components beyond it nobody trained this round).
    """

    round: int
    sampled: int
    references: list[Adapter]
    max_rank: int
    fresh: Callable[[], Adapter]
    max_weight: float = 1.0
    # how many clients' uploads the updates carry (a secure sum is one update of several; None: one each)
    contributors: int | None = None
    # the largest adapter rank among the clients the updates stand for (the server's registry, never an
    # update's shape: FFA-LoRA's and RoLoRA's aggregates are padded to the global rank); None: max_rank
    trained_rank: int | None = None


@dataclass
class MergingOptions:
    """The option of every strategy that merges each round into the base (FedEx-LoRA, FLoRA, FLoRIST): how
    many merges the server keeps so that a client that missed some downloads one exact catch-up
    (``fedllm/server/catchup.py``)."""

    catchup_window: int = opt(
        8,
        "merged updates the server keeps for clients that missed some: a client further behind downloads the "
        "whole merged residual instead of one catch-up of what it missed",
        positive,
        "an integer >= 1",
    )


def example_weights(updates: list[ClientUpdate]) -> list[float]:
    """p_k = n_k / sum of n over the round's clients."""
    total = sum(u.num_examples for u in updates)
    if total <= 0:
        raise ValueError("client updates carry no examples; cannot weight them")
    return [u.num_examples / total for u in updates]


class Strategy(abc.ABC):
    """Base class: registry, weights, dense averaging, default client start.

    Subclasses implement :meth:`aggregate_factors`; strategies that merge into
    the base return the merged update in :class:`RoundResult` and let clients
    start from fresh adapters.
    """

    name: ClassVar[str] = ""
    merges_into_base: ClassVar[bool] = False
    averages_parameters: ClassVar[bool] = True
    same_weights: ClassVar[bool] = True  # every parameter of an update is averaged with the same p_k
    # its new global factors are a weighted sum of the uploaded ones (what central DP's noisy sum needs)
    linear: ClassVar[bool] = False
    # what its global state is, for a server optimizer (aggregation.server_opt), which steps the global
    # factors with the round's change: "parameters" (persisting factors the clients start from: steppable),
    # "merged" (each round merged into the base, clients restart fresh), "refactored" (new factors of the
    # global product every round) or "per_client" (every client's own adapter)
    global_state: ClassVar[str] = "parameters"
    # whether what its clients upload and download is communication; False: each client's own adapter, which
    # fedllm's server keeps for it between rounds, where a deployment of the method sends nothing (local-only)
    communicates: ClassVar[bool] = True
    # merges kept for clients that missed some (a merging strategy's option, ``catchup_window``)
    catchup_window: int = 0
    hook: ClassVar[type[ClientHook]] = ClientHook  # the client side (plain LoRA unless a strategy says else)
    # its own options (a dataclass of fedllm.options.opt fields), collected as aggregation.<name>.*
    options: ClassVar[type | None] = None

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not register:  # a wrapper (StrategyWrapper): not a strategy a config can name
            return
        if not cls.name or not cls.name.isidentifier():
            raise TypeError(
                f"strategy {cls.__name__} needs a lower-case identifier as name, got {cls.name!r}"
            )
        if cls.name in STRATEGIES:
            raise TypeError(f"strategy name {cls.name!r} is registered twice")
        if cls.options is not None and not dataclasses.is_dataclass(cls.options):
            raise TypeError(f"strategy {cls.name}: options must be a dataclass, got {cls.options!r}")
        if cls.merges_into_base and not (cls.options is not None and issubclass(cls.options, MergingOptions)):
            raise TypeError(
                f"strategy {cls.name} merges into the base: its options must subclass MergingOptions (the "
                "catch-up window the server keeps its merges for)"
            )
        STRATEGIES[cls.name] = cls

    @classmethod
    def from_options(cls, options: Any) -> Strategy:
        """The strategy with its own options (an instance of :attr:`options`, or None when it has none)."""
        return cls()

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse configs this strategy cannot run, before any work starts."""

    @property
    def scored_per_client(self) -> bool:
        """Whether the run's evaluation after a round scores each visited client's own model (the one
        :meth:`client_factors` gives it) and reports their mean, instead of :meth:`global_adapter`'s: a
        strategy without a global model (local-only training)."""
        return False

    @classmethod
    def sums_uploads(cls, cfg: Any) -> bool:
        """Whether, under ``cfg``, the server needs only the weighted sum of the factors and dense modules the
        clients upload (what secure aggregation gives it): the ``linear`` strategies, unless their sum is of
        something else (Fed-SB's R, an extra)."""
        return cls.linear

    def initial_factors(self, modules: dict[str, tuple[int, int]], rank: int, seed: int) -> Adapter:
        """The global factors before round 1 (FFA-LoRA: its shared frozen A); default none, so that clients
        start from their own fresh initialization."""
        return {}

    def client_hook(self) -> ClientHook:
        """The client side every client of this strategy runs (see :class:`~fedllm.protocol.ClientHook`)."""
        return self.hook()

    def aggregate(
        self,
        updates: list[ClientUpdate],
        state: GlobalState,
        weights: list[float] | None = None,
        context: RoundContext | None = None,
    ) -> RoundResult:
        """The new global state from the round's updates; ``weights``: each update's share (the server's,
        from the counts it knows; default here: the updates' own counts, for plain use of the math);
        ``context``: what the server knows of the round besides (see :class:`RoundContext`).

        It is :meth:`combine` then :meth:`release`, so that a wrapper can act between the two (central DP
        noises the combined uploads, then the strategy post-processes the noised result)."""
        result = self.combine(updates, state, weights, context)
        result.state = self.release(result.state)
        return result

    def combine(
        self,
        updates: list[ClientUpdate],
        state: GlobalState,
        weights: list[float] | None = None,
        context: RoundContext | None = None,
    ) -> RoundResult:
        """The round's combination of the uploads (adapter and dense modules), before :meth:`release`; for a
        ``linear`` strategy a weighted sum of them."""
        if not updates:
            raise ValueError("aggregate() needs at least one client update")
        weights = example_weights(updates) if weights is None else list(weights)
        result = self.aggregate_factors(updates, weights, state, context)
        names = updates[0].dense.keys()
        result.state.dense = {k: self.average([u.dense[k] for u in updates], weights) for k in names}
        if not result.state.dense:
            result.state.dense = dict(state.dense)
        return result

    def release(self, state: GlobalState) -> GlobalState:
        """What the server makes of the combined state before anyone sees it (FedSVD: re-factors the
        averaged product by SVD); a function of the combination alone, so under central DP it is
        post-processing of the noised sum. Default: as it is."""
        return state

    def average(self, tensors: list[Tensor], weights: list[float]) -> Tensor:
        """The weighted mean (FedIT's options can make it a robust one)."""
        return weighted_mean(tensors, weights)

    def at_rank(self, upload: LoraFactors, current: LoraFactors) -> LoraFactors:
        """How an upload of a smaller rank (folded) enters the average at the global rank (``current``: the
        global factors the round started from, folded): zero-padded by default (FedIT's and HetLoRA's
        heterogeneous-rank rule, which averages each client's own product). A strategy whose clients train
        the leading part of one shared global adapter (FedSVD, RoLoRA) pads with the global's own components
        instead, so that its round is the old global plus the weighted mean of the clients' changes: a
        client that changed nothing leaves the product as it was."""
        return pad_rank(upload, current.rank)

    def accept_extras(self, extras: dict[str, Tensor], exp: Expected) -> dict[str, Tensor]:
        """The extras this strategy expects in an update, checked against ``exp``
        (``fedllm.checks.Expected``) and cast; raises ``ClientFailure``.
        Extras nobody claims are refused by the server."""
        return {}

    def extras_numel(self, exp: Expected) -> int:
        """The most numbers this strategy's extras in one update may hold (``exp``: the
        ``fedllm.checks.Expected`` of the update), beyond the adapter's size (a driver's cap on a reply's
        bytes counts them). Default: none beyond it."""
        return 0

    def shared_extras(self, update: ClientUpdate) -> dict[str, Tensor]:
        """Extras that are parameters averaged like the adapter (the client hook's ``shared_extras``:
        FLoRAL's bias adaptors, FedSA-LoRA's shared B): clipped with it, their change measured from what the
        client downloaded under the same name (else from zero)."""
        prefixes = self.hook.shared_extras
        return {k: v for k, v in update.extras.items() if prefixes and k.startswith(prefixes)}

    @abc.abstractmethod
    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        """Combine the round's adapters (``weights`` are the p_k) into a new state."""

    def round_report(self, round_idx: int) -> dict[str, Any]:
        """Numbers this strategy (or a wrapper of it) adds to round ``round_idx``'s metrics row."""
        return {}

    def run_summary(self, rounds: int) -> dict[str, Any]:
        """What it adds to the run's summary: sections, ``metrics`` (numbers ``fedllm compare`` reports)
        and ``guarantees`` (one-line statements the printed summary and the model card show)."""
        return {}

    def adapter_rank(self, rank: int) -> int:
        """Rank of the peft adapter a client of LoRA rank ``rank`` trains (FLoRAL: C * rank)."""
        return rank

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        """The adapter a client of rank ``rank`` (layer scale ``scale``) starts from; None: a fresh LoRA."""
        return None

    def client_extras(self, state: GlobalState, client_id: int) -> dict[str, Tensor]:
        """Strategy state a client trains from besides its factors (FLoRAL's bias adaptors); usually none."""
        return {}

    def global_adapter(self, state: GlobalState) -> Adapter:
        """The adapter evaluated and exported as 'the global model' (on top of the residual)."""
        return state.factors

    def global_biases(self, state: GlobalState) -> dict[str, Tensor]:
        """Per-module output biases of the global model's LoRA branch (FLoRAL's bias adaptors);
        usually none.
        """
        return {}


class MergingStrategy(Strategy, register=False):
    """A strategy that merges each round's update into the base (FedEx-LoRA, FLoRA, FLoRIST): its global state
    is the merged residual, and the server keeps its newest ``catchup_window`` merges (its options subclass
    :class:`MergingOptions`) so that a client that missed some downloads one exact catch-up."""

    merges_into_base = True
    global_state = "merged"
    options: ClassVar[type | None] = MergingOptions

    def __init__(self, catchup_window: int = 8) -> None:
        self.catchup_window = catchup_window

    @classmethod
    def from_options(cls, options: Any) -> Strategy:
        """The strategy with its window (``options``: a :class:`MergingOptions`; a strategy with more options
        builds itself from them)."""
        return cls(options.catchup_window)


class StrategyWrapper(Strategy, register=False):
    """A strategy around another (as Flower's DP wrappers subclass ``Strategy`` and delegate each call): every
    call and capability is the inner strategy's, delegated explicitly, unless the wrapper overrides it. It is
    a :class:`Strategy` (``isinstance`` holds); a method added to the base without a delegate here is the
    base's default, which ``tests/test_server_opt.py`` catches by comparing the two classes' methods."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        kwargs.pop("register", None)
        super().__init_subclass__(register=False, **kwargs)  # a wrapper is never a name a config can give

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    # capabilities (class-level on a strategy, the inner one's here)
    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def merges_into_base(self) -> bool:  # type: ignore[override]
        return self.inner.merges_into_base

    @property
    def averages_parameters(self) -> bool:  # type: ignore[override]
        return self.inner.averages_parameters

    @property
    def same_weights(self) -> bool:  # type: ignore[override]
        return self.inner.same_weights

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.inner.linear

    @property
    def global_state(self) -> str:  # type: ignore[override]
        return self.inner.global_state

    @property
    def communicates(self) -> bool:  # type: ignore[override]
        return self.inner.communicates

    @property
    def hook(self) -> type[ClientHook]:  # type: ignore[override]
        return self.inner.hook

    @property
    def options(self) -> type | None:  # type: ignore[override]
        return self.inner.options

    @property
    def catchup_window(self) -> int:  # type: ignore[override]
        return self.inner.catchup_window

    # calls
    def check_config(self, cfg: Any) -> None:  # type: ignore[override]
        self.inner.check_config(cfg)

    def sums_uploads(self, cfg: Any) -> bool:  # type: ignore[override]
        return self.inner.sums_uploads(cfg)

    def initial_factors(self, modules: dict[str, tuple[int, int]], rank: int, seed: int) -> Adapter:
        return self.inner.initial_factors(modules, rank, seed)

    def client_hook(self) -> ClientHook:
        return self.inner.client_hook()

    def aggregate(
        self,
        updates: list[ClientUpdate],
        state: GlobalState,
        weights: list[float] | None = None,
        context: RoundContext | None = None,
    ) -> RoundResult:
        return self.inner.aggregate(updates, state, weights, context)

    def combine(
        self,
        updates: list[ClientUpdate],
        state: GlobalState,
        weights: list[float] | None = None,
        context: RoundContext | None = None,
    ) -> RoundResult:
        return self.inner.combine(updates, state, weights, context)

    def release(self, state: GlobalState) -> GlobalState:
        return self.inner.release(state)

    def average(self, tensors: list[Tensor], weights: list[float]) -> Tensor:
        return self.inner.average(tensors, weights)

    def at_rank(self, upload: LoraFactors, current: LoraFactors) -> LoraFactors:
        return self.inner.at_rank(upload, current)

    def accept_extras(self, extras: dict[str, Tensor], exp: Expected) -> dict[str, Tensor]:
        return self.inner.accept_extras(extras, exp)

    def shared_extras(self, update: ClientUpdate) -> dict[str, Tensor]:
        return self.inner.shared_extras(update)

    def extras_numel(self, exp: Expected) -> int:
        return self.inner.extras_numel(exp)

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        return self.inner.aggregate_factors(updates, weights, state, context)

    def round_report(self, round_idx: int) -> dict[str, Any]:
        return self.inner.round_report(round_idx)

    def run_summary(self, rounds: int) -> dict[str, Any]:
        return self.inner.run_summary(rounds)

    def adapter_rank(self, rank: int) -> int:
        return self.inner.adapter_rank(rank)

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        return self.inner.client_factors(state, rank, scale, client_id)

    @property
    def scored_per_client(self) -> bool:
        return self.inner.scored_per_client

    def client_extras(self, state: GlobalState, client_id: int) -> dict[str, Tensor]:
        return self.inner.client_extras(state, client_id)

    def global_adapter(self, state: GlobalState) -> Adapter:
        return self.inner.global_adapter(state)

    def global_biases(self, state: GlobalState) -> dict[str, Tensor]:
        return self.inner.global_biases(state)


def module_io(f: LoraFactors) -> int:
    """``out + in`` of a module's factors: a float32 rank component of it costs 4 (out + in) bytes."""
    return f.B.shape[0] + f.A.shape[1]


def leading_factors(state: GlobalState, rank: int, scale: float) -> Adapter | None:
    """Each client takes the leading ``rank`` components of the global adapter, at its own scale.

    Zero-padded where the global adapter has fewer; the client runtime gives
    such empty directions a fresh init so they can learn.
    """
    if not state.factors:
        return None
    return {k: fit_rank(f, rank).with_scale(scale) for k, f in state.factors.items()}


def base_point(state: GlobalState, context: RoundContext) -> Adapter:
    """What the round's clients started from, at the largest rank, scale folded: the global factors, or the
    round's shared fresh initialization when there are none yet. The point a round's changes are measured
    from and added to (central DP's noisy sum, a server optimizer's step, secure aggregation's sum)."""
    if state.factors:
        return {k: pad_rank(f.folded(), context.max_rank) for k, f in state.factors.items()}
    return {k: f.folded() for k, f in context.fresh().items()}


def strategy_from_config(agg: Any) -> Strategy:
    """The strategy ``aggregation.name`` names, built from its own options (``aggregation.<name>.*``)."""
    return STRATEGIES[agg.name].from_options(getattr(agg, agg.name, None))
