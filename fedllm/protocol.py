"""What crosses the federated boundary, and what both halves derive alike.

The server (``fedllm/server/server.py``) and the client runtime
(``fedllm/client/runtime.py``) share nothing but this module and the
``LoraFactors`` type: a round is ``server.plan_round`` -> one
:class:`ClientStart` per client -> (a driver moves it: a function call, a
gather under accelerate, a Flower message) -> ``runtime.train`` -> one
:class:`ClientUpdate` -> ``server.finish_round``. Seeds are derived from
integers (:func:`derive_seed`), so both halves, on any process or site, draw
the same numbers without sharing a generator.

Two small bases live here too, since each is declared by one side and run by
the other: :class:`AlgorithmServer` (a client algorithm's server half, run by
the server) and :class:`ClientHook` (a strategy's client side, run by the
client runtime).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from fedllm.factors import (
    Adapter,
    LoraFactors,
    adapter_from_tensors,
    adapter_numel,
    adapter_tensors,
    prefixed,
    unprefixed,
)


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (independent of process layout)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def sample_size(clients_per_round: int, fraction: float, num_clients: int) -> int:
    """Clients sampled each round: ``clients_per_round``, else ``fraction`` of them (at least one). The
    server samples this many; the privacy accountant assumes it."""
    return clients_per_round or max(1, round(fraction * num_clients))


def _numel(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


@dataclass
class Catchup:
    """One exact update that brings a client's base from ``from_round`` (0: the original base) to
    ``to_round``: the merges it missed (FLoRA, FLoRIST), re-factorized into their smallest exact form, or the
    whole residual when the server no longer keeps the merges it missed."""

    from_round: int
    to_round: int
    update: Adapter


@dataclass
class ClientStart:
    """What a client downloads for a round.

    ``factors``: the adapter to load (None: a fresh LoRA); ``catchup``: what
    its base misses of the updates merged into it (FLoRA, FLoRIST);
    ``dense``: the fully trained modules; ``extras``: strategy state a client
    trains from (FLoRAL's bias adaptors); ``algo``: the client
    algorithm's server state (SCAFFOLD's control variate); ``last_aggregated``: the
    last round whose aggregate used this client's update (0: none yet), so
    that state a client keeps in step with the server (SCAFFOLD's c_k) takes
    effect only once the server has taken the update it came with.
    """

    round: int
    factors: Adapter | None = None
    catchup: Catchup | None = None
    dense: dict[str, Tensor] = field(default_factory=dict)
    extras: dict[str, Tensor] = field(default_factory=dict)
    algo: dict[str, Tensor] = field(default_factory=dict)
    last_aggregated: int = 0
    token: str = ""  # names the round's plan this start belongs to: the update answering it names it too
    # what a feature attaches for its own codec (``Feature.codec``), by the codec's key: e.g. a transport's
    # encodings of these tensors. Never part of the protocol's encoding, compared or stored.
    attachments: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def numel(self) -> int:
        """Parameters this download carries (the communication ledger counts these)."""
        merged = adapter_numel(self.catchup.update) if self.catchup else 0
        return (
            (adapter_numel(self.factors) if self.factors else 0)
            + merged
            + _numel(self.dense)
            + _numel(self.extras)
            + _numel(self.algo)
        )


@dataclass
class ClientUpdate:
    """What one client uploads: its adapter, example count and extras.

    ``extras`` holds algorithm- or strategy-specific tensors that travel with
    the update (SCAFFOLD's control-variate delta, FLoRAL's router
    probabilities and bias adaptors); they are counted in the ledger. Every
    field is a claim: the server checks each against what it knows
    (``fedllm/server/trust.py``) and derives what the client started from itself.
    """

    client_id: int
    num_examples: int
    factors: Adapter
    dense: dict[str, Tensor] = field(default_factory=dict)
    extras: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    round: int | None = None  # the round it answers and its plan's token (the server refuses another round's)
    token: str = ""
    # what a feature attaches for its own codec or exchange, by its key (a transport's encoded changes,
    # secure aggregation's summand); not part of what the server compares or stores
    attachments: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def numel(self) -> int:
        return adapter_numel(self.factors) + _numel(self.dense) + _numel(self.extras)


@dataclass
class SummedUpdates:
    """A round's uploads as their sum only (secure aggregation: the server never sees one site's update).

    ``update``: the round as one update at the largest rank (scale 1), which a linear strategy aggregates
    with weight 1 to the plain round's result; ``clients``: the sites whose uploads it holds (the protocol
    tells who finished); ``contributors``: how many they are; ``failures``: why each other active client
    is missing; ``upload_numel`` / ``upload_bytes``: what each contributor's masked vector took;
    ``reference``: the base point at the largest rank (the round context's reference for the one update)."""

    clients: list[int]
    update: ClientUpdate
    contributors: int
    failures: dict[int, str] = field(default_factory=dict)
    upload_numel: int = 0
    upload_bytes: int | None = None
    reference: Adapter = field(default_factory=dict)  # the point the sum's changes are measured from


class TrainExchange(Protocol):
    """A feature's way of gathering a round (``Feature.train_exchange``): ``option`` names the setting that
    asks for it (for a driver's refusal); ``train`` runs the round on a driver that can (the Flower
    driver)."""

    option: str

    def train(self, driver: Any, plan: Any) -> SummedUpdates: ...


@dataclass
class ClientInfo:
    """What the server knows of a client: its id, LoRA rank and scale, and how many examples it trains on."""

    client_id: int
    rank: int
    scale: float
    num_examples: int


class AlgorithmServer:
    """The server half of a client algorithm: what clients download besides the adapter, and its update.

    The default (plain SFT, FedProx, Per-FedAvg) has no server state.
    SCAFFOLD's half keeps the control variate (``fedllm/client/scaffold.py``).
    """

    @classmethod
    def from_config(cls, client_cfg: Any) -> AlgorithmServer:
        return cls()

    def bind(self, param_shapes: dict[str, torch.Size]) -> None:
        """The clients' trainable tensors by name at the largest adapter rank (``<module>.A/.B``, dense)."""

    def download(self, rank: int, client_id: int | None = None) -> dict[str, Tensor]:
        """What client ``client_id``, whose adapter has rank ``rank``, downloads for this algorithm."""
        return {}

    def accept_extras(self, extras: dict[str, Tensor], exp: Any) -> dict[str, Tensor]:
        """The extras this algorithm expects in an update, checked against ``exp``
        (``fedllm.checks.Expected``) and cast; raises ``ClientFailure``.
        Extras nobody claims are refused by the server."""
        return {}

    def clip(self, updates: list[ClientUpdate], ratio: float) -> int:
        """Bound the algorithm's extras like the model update (``ratio`` x the round's median); how many."""
        return 0

    def update(self, updates: list[ClientUpdate], population_weights: dict[int, float]) -> None:
        """After a round's aggregation; ``population_weights``: every client's p_k (they sum to 1)."""

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned (resume)."""


# ---- a strategy's client side ------------------------------------------------------------------------------


def seeded_generator(seed: int, *parts: int) -> torch.Generator:
    """OS randomness (``seed`` -1) or, for experiments, a generator seeded by ``seed`` and ``parts``."""
    if seed < 0:
        return torch.Generator().manual_seed(secrets.randbits(62))
    mixed = seed
    for p in parts:
        mixed = (mixed * 1_000_003 + p + 1) % (1 << 62)
    return torch.Generator().manual_seed(mixed)


def leading_block(ref: Tensor, like: Tensor) -> Tensor:
    """``ref`` cut from its leading corner to ``like``'s shape when both have the same number of dimensions
    (a client that trains the leading block of a downloaded tensor: Fed-SB's R at a client's rank), else
    ``ref`` as it is. What an uploaded extra's change is measured from, on the site and on the wire."""
    if ref.shape != like.shape and ref.dim() == like.dim():
        return ref[tuple(slice(0, n) for n in like.shape)]
    return ref


def fit_download(download: Adapter | None, fresh: Adapter) -> Adapter | None:
    """A download of lower rank than the client's adapter (a download budget), zero-padded to its rank: the
    padded directions are then revived like any empty one. As it is otherwise."""
    if not download:
        return download
    out = {}
    for k, f in download.items():
        r = fresh[k].rank if k in fresh else f.rank
        plain = f.A.shape[0] == f.B.shape[1]  # both factors of one lower rank (FFA-LoRA downloads B alone)
        out[k] = (
            f
            if not plain or f.rank >= r
            else LoraFactors(
                torch.cat([f.A, f.A.new_zeros(r - f.rank, f.A.shape[1])]),
                torch.cat([f.B, f.B.new_zeros(f.B.shape[0], r - f.rank)], dim=1),
                f.scale,
            )
        )
    return out


def revive_empty_directions(start: Adapter, fresh: Adapter) -> Adapter:
    """Give zero rank directions (zero A row and B column) a fresh A row.

    Zero-padding leaves directions whose gradients are zero forever; a fresh
    A row with the zero B column keeps the product unchanged and lets them learn.
    """
    out = {}
    for key, f in start.items():
        dead = (f.A.abs().sum(1) == 0) & (f.B.abs().sum(0) == 0)
        if dead.any():
            A = f.A.clone()
            A[dead] = fresh[key].A[dead]
            f = LoraFactors(A, f.B, f.scale)
        out[key] = f
    return out


class HookSession:
    """A strategy's hooks on the model while one client trains or is evaluated (see :class:`ClientHook`)."""

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        """Parameters only this client trains (at :attr:`local_lr`), never uploaded, corrected or pulled."""
        return {}

    local_lr: float = 0.0
    # how they are stepped: "same" (a group of the algorithm's own optimizer, scheduled with it) or "sgd"
    # (plain SGD steps of their own at local_lr, unscheduled: FLoRAL's reference code steps its routers so)
    local_optimizer: str = "same"

    def shared_params(self) -> dict[str, torch.nn.Parameter]:
        """Parameters trained like the adapter and uploaded with it (in :meth:`upload`)."""
        return {}

    def upload(self) -> dict[str, Tensor]:
        """What travels to the server besides the factors (``ClientUpdate.extras``)."""
        return {}

    def state(self) -> dict[str, Tensor]:
        """What the client keeps for its next round (only what :meth:`ClientHook.session` reads back)."""
        return {}

    def local_work(self, work: Any) -> Any:
        """The client's local work for this session (``fedllm.client.base.LocalWork``): as it is, unless
        the strategy's round trains differently (Fed-SB's initialization round: one Adam step)."""
        return work

    def bake(self, factors: Adapter) -> tuple[Adapter, dict[str, Tensor]]:
        """The client's model as a plain LoRA adapter (and per-module LoRA output biases)."""
        return factors, {}

    def close(self) -> None:
        """Remove every hook from the model."""


class ClientHook:
    """A strategy's client side: what a client trains from, and the hooks it trains and is evaluated with.

    The default is plain LoRA: the downloaded factors (or a fresh init), no
    hooks. A strategy that changes how its clients train or what they upload
    (FLoRAL's routers and bias adaptors) subclasses this in its own file and
    names it in ``Strategy.hook``; the client runtime calls it and never asks
    which strategy it serves (peft's LoRA variants hook a layer the same way).

    ``personalizes``: the hook's own view of a client *is* its personalized
    model (FLoRAL: its router), instead of the algorithm's personalization
    steps. ``uploads``: which factors leave the client (a factor left out
    travels as an empty ``out x 0`` B, counted as nothing). ``local_params``:
    its sessions train parameters outside the model (checked against the
    client algorithm and the process layout).
    """

    personalizes: ClassVar[bool] = False
    local_params: ClassVar[bool] = False
    frozen: ClassVar[tuple[str, ...]] = ()  # factors its clients never train (FFA-LoRA: A)
    uploads_statistics: ClassVar[bool] = False  # extras that are statistics of the data (FLoRAL's routers)
    keeps_state: ClassVar[bool] = False  # its clients keep state between rounds (a router, a B, a rank)
    # extras that are parameters trained like the adapter (FLoRAL's bias adaptors, FedSA-LoRA's shared B):
    # clipped and noised with the update; their change is measured from the download of the same name
    shared_extras: ClassVar[tuple[str, ...]] = ()
    uploads: ClassVar[tuple[str, ...]] = ("A", "B")  # the factors that travel (FedSA-LoRA: A alone)
    init_round: ClassVar[int | None] = None  # fresh factors from this round's seed, not the current one's

    alternates: ClassVar[bool] = False  # which factor it trains and sends changes with the round (RoLoRA)
    # its sessions set the local work of some rounds (HookSession.local_work: Fed-SB's one Adam step)
    sets_local_work: ClassVar[bool] = False
    # its sessions train parameters outside the model, shared with the server (Fed-SB's R): a layout that
    # splits each batch over processes would not synchronize them
    params_outside_model: ClassVar[bool] = False

    def for_round(self, round_idx: int | None) -> ClientHook:
        """The hook as it acts in round ``round_idx`` (what its clients train, freeze and send); itself
        unless it ``alternates`` (RoLoRA: B in odd rounds, A in even ones). Client and server both ask it,
        so they agree on what travels."""
        return self

    def fresh_seed(self, seed: int, round_idx: int) -> int:
        """The seed of the fresh initialization a client of ``round_idx`` gets (client and server alike):
        the round's, or ``init_round``'s for a hook that trains against one fixed init (FFA-LoRA's A)."""
        return derive_seed(seed, self.init_round or round_idx, 7)

    def start_factors(self, download: Adapter | None, fresh: Adapter) -> Adapter:
        """The factors a client trains from: its download with dead directions revived, or ``fresh``."""
        return revive_empty_directions(download, fresh) if download else fresh

    def outgoing(self, trained: Adapter) -> Adapter:
        """What of a client's trained factors leaves it: the factors in :attr:`uploads`; one left out travels
        empty (an ``out x 0`` B, a ``0 x in`` A), counted as nothing."""
        return {
            k: LoraFactors(
                f.A if "A" in self.uploads else f.A[:0], f.B if "B" in self.uploads else f.B[:, :0], f.scale
            )
            for k, f in trained.items()
        }

    def incoming(self, received: Adapter, reference: Adapter) -> Adapter:
        """The server's view of an accepted upload: what did not travel because it is frozen and shared is
        the reference's (FFA-LoRA's A); what stays on the client stays empty (FedSA-LoRA's B)."""
        if not self.frozen:
            return received
        return {
            k: LoraFactors(
                reference[k].A.clone() if "A" in self.frozen else f.A,
                reference[k].with_scale(f.scale).B.clone() if "B" in self.frozen else f.B,
                f.scale,
            )
            for k, f in received.items()
        }

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> HookSession | None:
        """Hooks on ``model``'s adapter for ``view``: 'train', 'global' (the global model as this client gets
        it) or 'own' (its personalized model); ``state``: what a previous session kept; ``extras``: the
        strategy state it downloaded. None: nothing to hook."""
        return None


# ---- messages as flat tensors + JSON metadata (Flower's ArrayRecord / ConfigRecord, or any transport)
# --------


def encode_start(start: ClientStart) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors, scales = adapter_tensors(start.factors or {}, "factors.")
    if start.catchup is not None:
        t, s = adapter_tensors(start.catchup.update, "catchup.")
        tensors.update(t)
        scales.update(s)
    for prefix, part in (("dense.", start.dense), ("extras.", start.extras), ("algo.", start.algo)):
        tensors.update(prefixed(part, prefix))
    meta = {
        "round": start.round,
        "scales": scales,
        "has_factors": start.factors is not None,
        "catchup": [start.catchup.from_round, start.catchup.to_round] if start.catchup else None,
        "last_aggregated": start.last_aggregated,
        "token": start.token,
    }
    return {k: v.detach().contiguous() for k, v in tensors.items()}, meta


def _catchup(rounds: Any, tensors: dict[str, Tensor], scales: dict[str, float]) -> Catchup | None:
    if not rounds:
        return None
    return Catchup(int(rounds[0]), int(rounds[1]), adapter_from_tensors(tensors, scales, "catchup."))


def decode_start(tensors: dict[str, Tensor], meta: dict[str, Any]) -> ClientStart:
    scales = meta["scales"]
    return ClientStart(
        round=meta["round"],
        factors=adapter_from_tensors(tensors, scales, "factors.") if meta["has_factors"] else None,
        catchup=Catchup(
            int(meta["catchup"][0]),
            int(meta["catchup"][1]),
            adapter_from_tensors(tensors, scales, "catchup."),
        )
        if meta.get("catchup")
        else None,
        dense=unprefixed(tensors, "dense."),
        extras=unprefixed(tensors, "extras."),
        algo=unprefixed(tensors, "algo."),
        last_aggregated=int(meta.get("last_aggregated", 0)),
        token=str(meta.get("token", "")),
    )


def encode_update(update: ClientUpdate) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors, scales = adapter_tensors(update.factors, "factors.")
    tensors.update(prefixed(update.dense, "dense."))
    tensors.update(prefixed(update.extras, "extras."))
    meta = {
        "client_id": update.client_id,
        "num_examples": update.num_examples,
        "scales": scales,
        "metrics": update.metrics,
        "round": update.round,
        "token": update.token,
    }
    return {k: v.detach().contiguous() for k, v in tensors.items()}, meta


def decode_update(tensors: dict[str, Tensor], meta: dict[str, Any]) -> ClientUpdate:
    scales = meta["scales"]
    return ClientUpdate(
        client_id=meta["client_id"],
        num_examples=meta["num_examples"],
        factors=adapter_from_tensors(tensors, scales, "factors."),
        dense=unprefixed(tensors, "dense."),
        extras=unprefixed(tensors, "extras."),
        metrics=dict(meta["metrics"]),
        round=meta.get("round"),
        token=str(meta.get("token", "")),
    )


# ---- what a client uploads, transformed on its way out (a clip, noise, a quantizer) ----------------------


@dataclass
class UploadContext:
    """What an upload transform may read: the client's download (``start``), the factors it started from
    (``started``: its download completed, or its fresh init), its own state (a transform keeps what it needs
    there under its own prefix, e.g. an error-feedback residual) and which extras are parameters."""

    start: ClientStart
    started: Adapter
    state: dict[str, Tensor]
    shared_extras: tuple[str, ...] = ()


def extra_reference(extras: dict[str, Tensor], name: str, sent: Tensor) -> Tensor:
    """What an uploaded extra's change is measured from: the download of the same name (zero if none), or its
    leading block when the client trains only that (Fed-SB: a rank-r_k client's r_k x r_k block of R)."""
    got = extras.get(name)
    return torch.zeros_like(sent) if got is None else leading_block(got, sent).to(sent.dtype)


def upload_changes(update: ClientUpdate, ctx: UploadContext) -> dict[str, Tensor]:
    """The change of everything an upload carries, in the aggregation space, by name: ``A.<module>``,
    ``B.<module>`` (its scale folded in), ``dense.<name>`` (from the download), ``extras.<name>``
    (:func:`extra_reference`), in that order (every A, every B, the dense modules, the extras: the fixed order
    noise is drawn in). What DP's clip bounds and what secure aggregation's vector carries."""
    start, started = ctx.start, ctx.started
    out: dict[str, Tensor] = {}
    for k, f in update.factors.items():
        if f.A.numel():
            out[f"A.{k}"] = f.A - started[k].A
    for k, f in update.factors.items():
        if f.B.numel():
            out[f"B.{k}"] = (f.B - started[k].with_scale(f.scale).B) * f.scale
    out.update({f"dense.{k}": t - start.dense[k] for k, t in update.dense.items()})
    out.update({f"extras.{k}": t - extra_reference(start.extras, k, t) for k, t in update.extras.items()})
    return out


class UploadTransform:
    """One change of what a client uploads, declared by a feature and applied in order by the client runtime
    after training; the client algorithm never knows of it."""

    def apply(self, update: ClientUpdate, ctx: UploadContext) -> ClientUpdate:
        return update


# ---- a cross-cutting feature (fedllm/features.py lists them) ----------------------------------------------


class Codec:
    """How a feature changes what a start and an update carry on a real wire (the Flower apps).

    A feature owns its wire format (``Feature.codec``): the drivers that serialize call the run's codecs in
    order, encoding after the protocol's own ``encode_start`` / ``encode_update`` and decoding in reverse,
    without asking which features are on; in process nothing is serialized and no codec runs. A codec
    writes the metadata field ``key`` and adds tensors named ``key + "."``, which keep their dtype (one of
    ``dtypes``; every other tensor travels as float32). The server side is in two steps: ``decode_update``
    while parsing a reply (it knows nothing of the round), ``received`` once the driver has the site's
    start and the server's reference for it.
    """

    key: ClassVar[str] = ""
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    def owns(self, name: str) -> bool:
        """Whether message tensor ``name`` is one this codec added."""
        return bool(self.key) and name.startswith(self.key + ".")

    def encode_start(
        self, start: ClientStart, tensors: dict[str, Tensor], meta: dict[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The start's message (server side) as this feature sends it (default: as it is)."""
        return tensors, meta

    def decode_start(
        self, tensors: dict[str, Tensor], meta: dict[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The protocol's message again from what arrived (site side); ValueError with the reason."""
        return tensors, meta

    def encode_update(
        self, update: ClientUpdate, tensors: dict[str, Tensor], meta: dict[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The update's message (site side) as this feature sends it (default: as it is)."""
        return tensors, meta

    def decode_update(
        self, tensors: dict[str, Tensor], meta: dict[str, Any], max_numel: int
    ) -> tuple[dict[str, Tensor], dict[str, Any], Any]:
        """The protocol's message again from a reply (server side), and what :meth:`received` needs of it
        (kept in the update's ``attachments[key]``); ValueError with the reason, the site's failure."""
        return tensors, meta, None

    def received(self, update: ClientUpdate, start: ClientStart, started: Adapter) -> ClientUpdate:
        """The update as the server uses it, given what the site started from (``start``) and the server's own
        derivation of its factors (``started``); ValueError: the site's failure."""
        return update


class Feature:
    """A feature that touches every round (differential privacy, compressed transport), in a room of its own.

    It owns a config section (``section``, its ``options`` dataclass), adds rules to the config layer's
    table, and hooks the core only from the outside: the assembly lets it wrap the server's strategy
    (as Flower's DP wrappers wrap a strategy), adjust the server's policy and sampling, and add transforms
    of what a client uploads; the run's summary and round rows take what it reports. The server, the client
    runtime and the round loop never ask which features are on.
    """

    section: ClassVar[str] = ""
    options: ClassVar[type | None] = None

    def rules(self) -> list[Any]:
        """Refused combinations (``fedllm.options.Rule``), checked with the config layer's own."""
        return []

    def check_config(self, options: Any, cfg: Any) -> None:
        """What this feature alone requires of a config (ValueError naming the key)."""

    def wrap_strategy(self, strategy: Any, options: Any, cfg: Any) -> Any:
        """The server's strategy with this feature around it (default: as it is)."""
        return strategy

    def server_policy(self, policy: Any, options: Any, cfg: Any) -> Any:
        """The server's policy (``fedllm.server.ServerPolicy``) this feature needs (default: as it is)."""
        return policy

    def sampling(self, sampling: Any, options: Any, cfg: Any) -> Any:
        """How the server draws each round's clients under this feature (default: as it does)."""
        return sampling

    def upload_transforms(self, options: Any, cfg: Any) -> list[UploadTransform]:
        """What this feature does to every upload, on the client (default: nothing)."""
        return []

    def add_commands(self, subparsers: Any) -> None:
        """Subcommands of ``fedllm`` this feature brings."""

    def client_state(self, options: Any, cfg: Any) -> str:
        """The settings of this feature that make each client keep state between rounds (an error-feedback
        residual), as a user would write them; empty when none do."""
        return ""

    def train_exchange(self, options: Any, cfg: Any) -> TrainExchange | None:
        """Another way a driver gathers a round's uploads (secure aggregation: their sum only, as
        :class:`SummedUpdates`), an object with ``train(driver, plan)``; None: each update as it is. A driver
        that cannot run it refuses the config (``RoundLoop``)."""
        return None

    def codec(self, options: Any, cfg: Any) -> Codec | None:
        """How this feature changes what travels on a real wire (the Flower apps); None: it does not."""
        return None

    def client_mods(self, sites: Any) -> list[Any]:
        """Flower ClientApp mods this feature adds to every site's ``train`` (each passes messages that are
        not its own through); ``sites``: how the ClientApp gives a message's site (``site(context,
        config_text)``) and keeps its state (``keep(context, site)``), so that a mod needs no import of it."""
        return []

    def hides_site_figures(self, options: Any, cfg: Any) -> str:
        """Why this feature keeps each site's own figures (its evaluation's loss and accuracy, its example
        count where the weighting does not need it) on the site, as one clause naming how a user lifts it;
        empty when it does not (then a site sends them, as a plain run does)."""
        return ""

    def hidden_sample(self, options: Any, cfg: Any) -> str:
        """Why this feature needs each round's sample kept secret and how a user lifts that, as one clause
        (e.g. an accountant's amplification by sampling); empty when it needs no such thing."""
        return ""
