"""Secure aggregation on Flower: the server's round through Flower's SecAgg+ workflow, and the sites' mod.

Flower 1.42 ships SecAgg+ for the classic ``Strategy`` + ``LegacyContext`` style only; fedllm's ServerApp is
written against the Grid. So each secure round runs Flower's ``SecAggPlusWorkflow`` on the Grid the driver
holds, with a thin classic strategy (:class:`_Round`) whose ``configure_fit`` hands the workflow fedllm's
plan (each site's start as a ``FitIns``, its record serialized in the config) and whose ``aggregate_fit``
receives the unmasked mean. The protocol (key agreement, secret sharing, masking, dropout recovery) is
Flower's; nothing here re-implements it. On the sites, :func:`secure_mod` runs Flower's ``secaggplus_mod`` on
the protocol's messages only; its training step is the site's own, replying with the padded change
(:mod:`fedllm.secagg.summand`) that the mod quantizes and masks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

import fedllm.secagg.agreement as agreement
import fedllm.secagg.binding as binding
import fedllm.secagg.guard as guard
import fedllm.secagg.prg as prg
from fedllm.aggregation.base import GlobalState
from fedllm.checks import one_line
from fedllm.protocol import SummedUpdates, seeded_generator
from fedllm.secagg.bounds import (
    clip_of,
    clipping_range,
    distributed,
    known_noise,
    noise_seed,
    noise_std,
    per_round,
    quantization_bits,
    quantization_error,
    uniform,
)
from fedllm.secagg.options import SecAggOptions
from fedllm.secagg.summand import (
    KEY,
    Layout,
    layout,
    layout_size,
    protocol_weights,
    site_vector,
    summed_update,
    survivors_weights,
)

log = logging.getLogger(__name__)

START, LAYOUT = binding.START, binding.LAYOUT  # what a site's FitIns config carries


def _to_bytes(record) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return recorddict_to_proto(record).SerializeToString()


def _from_bytes(data: bytes):
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


def _round_strategy(fit_ins: list):
    """The thin classic strategy of one secure round (see module docstring)."""
    from flwr.server.strategy import Strategy

    class _Round(Strategy):
        def __init__(self) -> None:
            self.results: tuple[list, list] | None = None

        def initialize_parameters(self, client_manager):
            return None

        def configure_fit(self, server_round, parameters, client_manager):
            return fit_ins

        def aggregate_fit(self, server_round, results, failures):
            self.results = (results, failures)
            return None, {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return _Round()


class SecureExchange:
    """A driver's round through SecAgg+ (``Feature.train_exchange``): returns the round's
    :class:`~fedllm.protocol.SummedUpdates`."""

    option = "flower.secure_aggregation=true"

    def __init__(self, o: SecAggOptions, cfg) -> None:
        self.o, self.cfg = o, cfg
        self.distributed = distributed(cfg)
        self.range = clipping_range(cfg)
        self.quantization = 2 ** quantization_bits(cfg)
        self.last: dict[str, Any] = {}  # the last round's protocol outcome (tests and the row read it)
        self.size = 0  # values in the round's layout
        self.least = max(3, int(cfg.federation.min_clients))  # never unmask a sum of fewer sites
        self.global_bytes = agreement.encode_state(GlobalState())  # the round's full-rank state, as sent
        prg.install()  # masks from the whole shared secret, as the sites draw theirs
        self.workflow(1.0, None, per_round(cfg))  # Flower checks its parameters here, once, not every round

    def tolerances(self, server, clients: list[int], max_weight: float) -> tuple[float, float]:
        """How far an honest round's mean can be from the range and from the clip: (per value: the
        quantization's error for these sites' weights; L2: :func:`norm_limit` of the clip plus that error
        over every value, under the sites' noise)."""
        ratios = protocol_weights(server, clients, max_weight, self.quantization)
        per_value = quantization_error(self.cfg, ratios)
        d = self.size
        tau = noise_std(self.cfg) / math.sqrt(len(clients))  # a value's noise in the mean (uniform weights)
        return per_value, norm_limit(clip_of(self.cfg) + math.sqrt(d) * per_value, tau, d)

    def workflow(self, max_weight: float, timeout: float | None, sites: int):
        """Flower's SecAgg+ workflow for a round of ``sites`` sites, with the quorum checked before the
        unmask stage: when fewer than ``self.least`` sites sent their masked vectors, the round ends there
        and no sum of fewer is unmasked (Flower's own checks ask only for the threshold of each
        neighbourhood)."""
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
        from flwr.server.workflow import SecAggPlusWorkflow

        least, exchange = self.least, self

        class QuorumWorkflow(SecAggPlusWorkflow):
            """Flower's workflow, with what fedllm's sites need of it (:mod:`fedllm.secagg.binding`,
            :mod:`fedllm.secagg.agreement`): each site's signed keys relayed beside its keys, the round's
            statement signed by every site before the collect stage (and the signatures relayed in it), the
            survivors' consistency stage before the unmask, and the quorum checked before it."""

            signed: dict[int, tuple[int, bytes]]

            def setup_stage(self, grid, context, state) -> bool:
                self.signed = {}

                def seen(reply) -> None:  # a site's client and the signature over its keys
                    configs = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
                    if binding.SIGNATURE in configs and binding.CLIENT in configs:
                        pair = (int(configs[binding.CLIENT]), bytes(configs[binding.SIGNATURE]))
                        self.signed[int(reply.metadata.src_node_id)] = pair

                return bool(super().setup_stage(_Relay(grid, seen=seen), context, state))

            def share_keys_stage(self, grid, context, state) -> bool:
                def edit(msg) -> None:  # each neighbour's signature and client beside its keys
                    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
                    for k in [k for k in configs if guard.canonical(k)]:
                        if int(k) in self.signed:
                            client, signature = self.signed[int(k)]
                            configs[binding.NEIGHBOUR_CLIENT + k] = client
                            configs[binding.NEIGHBOUR_SIGNATURE + k] = signature

                return bool(super().share_keys_stage(_Relay(grid, edit=edit), context, state))

            def collect_masked_vectors_stage(self, grid, context, state) -> bool:
                signatures = self.agreement(grid, context, state)

                def edit(msg) -> None:  # every site's statement signature, for each site to check
                    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
                    configs[agreement.SIGNERS] = list(signatures)
                    configs[agreement.SIGNATURES] = list(signatures.values())

                return bool(super().collect_masked_vectors_stage(_Relay(grid, edit=edit), context, state))

            def agreement(self, grid, context, state) -> dict[int, bytes]:
                """Send every site its start, layout and the round's full-rank global state; its signature
                of the round's statement, by node (:mod:`fedllm.secagg.agreement`)."""
                from flwr.app import ConfigRecord, Message, RecordDict
                from flwr.app.message_type import MessageType

                group = str(context.state.config_records["config"]["current_round"])
                messages = []
                for n in sorted(state.active_node_ids):
                    fitins = state.nid_to_fitins[n].config_records["fitins.config"]
                    configs = {
                        "stage": agreement.STAGE,
                        START: fitins[START],
                        LAYOUT: fitins[LAYOUT],
                        agreement.GLOBAL: exchange.global_bytes,
                    }
                    messages.append(
                        Message(
                            RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(configs)}),
                            dst_node_id=n,
                            message_type=MessageType.TRAIN,
                            group_id=group,
                        )
                    )
                return collect_signatures(grid, messages, self.timeout, agreement.SIGNATURE)

            def unmask_stage(self, grid, context, state) -> bool:
                if len(state.active_node_ids) < least:
                    log.warning(
                        "secure aggregation: %d site(s) sent their masked vectors, fewer than the quorum of "
                        "%d: the sum is not unmasked",
                        len(state.active_node_ids),
                        least,
                    )
                    return False
                signatures = self.consistency(grid, context, sorted(state.active_node_ids))

                def edit(msg) -> None:  # every survivor's signature over the list, for the sites to check
                    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
                    configs[binding.SIGNERS] = list(signatures)
                    configs[binding.SIGNATURES] = list(signatures.values())

                return bool(super().unmask_stage(_Relay(grid, edit=edit), context, state))

            def consistency(self, grid, context, survivors: list[int]) -> dict[int, bytes]:
                """Send every survivor the list of survivors; its signature of it, by node."""
                from flwr.app import ConfigRecord, Message, RecordDict
                from flwr.app.message_type import MessageType

                group = str(context.state.config_records["config"]["current_round"])
                messages = [
                    Message(
                        RecordDict(
                            {
                                RECORD_KEY_CONFIGS: ConfigRecord(
                                    {"stage": binding.CONSISTENCY, binding.SURVIVORS: survivors}
                                )
                            }
                        ),
                        dst_node_id=n,
                        message_type=MessageType.TRAIN,
                        group_id=group,
                    )
                    for n in survivors
                ]
                return collect_signatures(grid, messages, self.timeout, binding.SURVIVORS_SIGNATURE)

        return QuorumWorkflow(**self.parameters(max_weight, timeout, sites))

    def parameters(self, max_weight: float, timeout: float | None, sites: int) -> dict[str, Any]:
        """Flower's ``SecAggPlusWorkflow`` arguments for a round of ``sites`` sites: what every site checks
        its setup against (:func:`fedllm.secagg.guard.pinned`); the threshold as a count, raised to what
        ``secagg.colluders`` needs (:func:`fedllm.secagg.guard.threshold_for`)."""
        share = sites  # secagg.num_shares = 1: every site every other's neighbour
        return {
            "num_shares": float(self.o.num_shares),
            "reconstruction_threshold": guard.threshold_for(
                float(self.o.reconstruction_threshold), share, int(self.o.colluders)
            ),
            "max_weight": max_weight,
            "clipping_range": self.range,
            "quantization_range": self.quantization,
            "modulus_range": 2**self.o.modulus_bits,
            "timeout": timeout,
        }

    def train(self, driver, plan) -> SummedUpdates:
        from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
        from flwr.common import FitIns, Parameters, parameters_to_ndarrays
        from flwr.server import LegacyContext, ServerConfig
        from flwr.server.compat.grid_client_proxy import GridClientProxy

        from fedllm.flower.records import start_record

        server = driver.server
        driver.handshake()  # a restarted site has a new node id: find it again
        self.global_bytes = agreement.encode_state(server.state)  # what every site's start is cut from
        lay: Layout = layout(server, plan.round)
        self.size = layout_size(lay)
        failures: dict[int, str] = {}
        fit_ins = []
        run_id = int(getattr(getattr(driver.grid, "run", None), "run_id", 0) or 0)
        for k, start in plan.starts.items():
            if k not in driver.nodes:
                failures[k] = "site not connected"
                continue
            config = {
                START: _to_bytes(start_record(start, driver.site_config, k, driver.codecs)),
                LAYOUT: json.dumps([[name, list(shape)] for name, shape in lay]),
            }
            proxy = GridClientProxy(driver.nodes[k], driver.grid, run_id)
            fit_ins.append((proxy, FitIns(Parameters(tensors=[], tensor_type=""), config)))
        uniform = server.policy.weighting == "uniform"
        max_weight = 1.0 if uniform else float(max(c.num_examples for c in server.clients.values()))
        strategy = _round_strategy(fit_ins)
        context = LegacyContext(
            Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            config=ServerConfig(num_rounds=self.cfg.federation.rounds),
            strategy=strategy,
        )
        context.state.config_records["config"] = ConfigRecord({"current_round": plan.round})
        context.state.array_records["parameters"] = ArrayRecord()
        timeout = self.o.timeout_s or driver.timeout

        def fail(why: str) -> SummedUpdates:
            failures.update({k: why for k in plan.starts if k not in failures})
            log.warning("round %d: %s", plan.round, why)
            return SummedUpdates([], _empty(plan), 0, failures)

        least = max(self.least, server.policy.min_clients)
        if len(fit_ins) < least:  # never unmask a sum of fewer sites than that
            return fail(f"secure aggregation needs {least} connected sites (3, and federation.min_clients)")
        try:
            self.workflow(max_weight, timeout, len(fit_ins))(driver.grid, context)
        except Exception as e:  # the protocol refused a stage's reply (a site's malformed message)
            return fail(one_line(f"secure aggregation failed ({type(e).__name__}: {e})"))
        if strategy.results is None:
            return fail("the secure aggregation halted: too few sites finished one of its stages")
        node_to_client = {n: k for k, n in driver.nodes.items()}
        results = strategy.results[0]
        if not results or any(int(p.node_id) not in node_to_client for p, _ in results):
            return fail("the secure aggregation's sum holds a node that is no longer bound to a client")
        clients = sorted(node_to_client[int(p.node_id)] for p, _ in results)
        self.last = {"round": plan.round, "clients": clients, "layout": lay, "range": self.range}
        try:
            mean = in_range(
                parameters_to_ndarrays(results[0][1].parameters)[0],
                self.range,
                *self.tolerances(server, clients, max_weight),
            )
            self.last["mean"] = mean
            weights = survivors_weights(server, clients, max_weight, self.quantization)
            summed = summed_update(server, plan, clients, mean, lay, weights, self.distributed)
        except (ValueError, RuntimeError, IndexError) as e:
            return fail(one_line(f"the secure sum is unusable: {e}"))
        for k in plan.starts:
            if k not in clients and k not in failures:
                failures[k] = "left the secure aggregation before its end (its masks were removed)"
        summed.failures = failures
        # what each site's masked vector took: its values and the weight, as 64-bit integers of the field
        summed.upload_numel = layout_size(lay) + 1
        summed.upload_bytes = 8 * summed.upload_numel
        return summed


class _Relay:
    """The Grid as one stage of Flower's workflow sees it, with fedllm's additions: ``edit(message)`` on each
    message before it leaves, ``seen(reply)`` on each reply that is not an error; the rest is the Grid's."""

    def __init__(self, grid, edit=None, seen=None) -> None:
        self.grid, self.edit, self.seen = grid, edit, seen

    def send_and_receive(self, messages, timeout=None):
        messages = list(messages)
        if self.edit is not None:
            for m in messages:
                self.edit(m)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        if self.seen is not None:
            for r in replies:
                if not r.has_error():
                    self.seen(r)
        return replies

    def __getattr__(self, name: str):
        return getattr(self.grid, name)


def norm_limit(clip: float, tau: float, d: int, p: float = 1e-9) -> float:
    """The largest L2 norm an honest mean has but with probability ``2 p``: the mean is ``s + z`` with
    ``||s|| <= clip`` (a weighted mean of clipped changes) and ``z ~ N(0, tau^2 I_d)`` (the sites' noise),
    so ``||s + z||^2 = ||s||^2 + 2 <s, z> + ||z||^2 <= clip^2 + 2 clip tau k + tau^2 q`` with ``k`` the
    normal's and ``q`` the chi-square's (d degrees of freedom) upper ``p`` quantiles.

    The noise is measured by its distribution, not by its whole norm added to the clip (``clip + tau (sqrt(d)
    + 7)``, which let a hostile site move the mean by 10 clips at d = 20k, n = 5, sigma = 1): ``z`` is
    nearly orthogonal to any shift, so a shift of norm S shows as ``S^2`` beside ``||z||^2``, whose spread is
    only ``tau^2 sqrt(2 d)``. The smallest shift refused is about ``sqrt(clip^2 + 2 clip tau k + tau^2 (q -
    d))``: 1.4 clips for 100 sites at sigma 2.2 and d = 20k, but still about 7 clips for 5 sites at sigma 1
    (no test on the mean alone can do better there: the noise's own spread hides it; docs/trust.md)."""
    if tau <= 0:
        return clip
    from scipy.stats import chi2, norm

    k, q = float(norm.isf(p)), float(chi2.isf(p, d))
    return math.sqrt(clip**2 + 2 * clip * tau * k + tau**2 * q)


def in_range(mean, bound: float, tolerance: float, norm_bound: float = math.inf) -> np.ndarray:
    """The protocol's mean as a flat float64 vector, refused (ValueError) when a value is not finite, lies
    beyond ``[-bound, bound]`` by more than ``tolerance`` (the quantization's error), or the mean's L2 norm
    passes ``norm_bound``: a weighted mean of vectors each in the range and within the clip is in the range
    and within the clip, so a mean beyond either comes from a site that masked values or a weight outside the
    protocol's (docs/trust.md: what a hostile site can still do)."""
    mean = np.asarray(mean, dtype=np.float64).ravel()
    if not np.isfinite(mean).all() or (mean.size and np.abs(mean).max() > bound + tolerance):
        raise ValueError(f"the unmasked mean leaves the protocol's range [-{bound:g}, {bound:g}]")
    if float(np.linalg.norm(mean)) > norm_bound:
        raise ValueError(f"the unmasked mean's norm passes the sites' clip ({norm_bound:.4g})")
    return mean


def _empty(plan):
    from fedllm.protocol import ClientUpdate

    return ClientUpdate(-1, 0, {}, round=plan.round, token=plan.token)


# ------------------------------------------------------------------ the sites' side
def secure_mod(sites):
    """A ClientApp mod: the protocol's messages go through Flower's ``secaggplus_mod`` with the site's secure
    training step; every other message passes to the app unchanged. ``sites``: the ClientApp's access to a
    message's site and its state (``site(context, config_text)``, ``keep(context, site)``)."""

    prg.install()  # masks from the whole shared secret (Flower's own draw folds it to 32 bits)

    def mod(msg, context, call_next):
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

        try:
            return guarded(msg, context, call_next)
        except guard.Refused as e:  # the site's own log says what it refused and why (its reply says why)
            stage = msg.content.config_records.get(RECORD_KEY_CONFIGS, {}).get("stage", "?")
            log.warning("secure aggregation: refused a %s message of round %s: %s", stage,
                        msg.metadata.group_id, e)  # fmt: skip
            raise

    def guarded(msg, context, call_next):
        from flwr.app.message_type import MessageType
        from flwr.client.mod import secaggplus_mod
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

        if RECORD_KEY_CONFIGS not in msg.content.config_records:
            return call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN:  # Flower's mod would train it, unmasked
            raise guard.Refused(
                f"a secure aggregation message of type {msg.metadata.message_type!r}: the protocol's are "
                f"{MessageType.TRAIN!r}"
            )
        stage = msg.content.config_records[RECORD_KEY_CONFIGS].get("stage")
        if stage == binding.CONSISTENCY:  # fedllm's own stages: Flower's mod never sees them
            return _consistency(msg, context)
        if stage == agreement.STAGE:
            return _agreement(msg, context, sites)
        _guard(msg, context)
        configs = msg.content.config_records[RECORD_KEY_CONFIGS]
        for key in [k for k in configs if k.startswith(binding.PREFIX)]:
            del configs[key]  # fedllm's entries, checked: Flower's mod reads a share-keys entry as a node id
        reply = secaggplus_mod(msg, context, lambda m, c: _secure_train(m, c, sites))
        if stage == "setup" and not reply.has_error():
            _sign_keys(reply, msg, context)
        counts = None if reply.has_error() else reply.content.metric_records.get("fitres.num_examples")
        if counts is not None:
            # the weight is masked into the vector (Flower's factor); the plain copy beside it would tell the
            # server the site's example count, which the weighting takes from the handshake where it needs it
            counts["num_examples"] = 0
        return reply

    return mod


def _protocol_state(context):
    """The site's SecAgg+ state as Flower's mod keeps it between the stages (its parameters, keys, shares)."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

    record = context.state.config_records.get(RECORD_KEY_STATE)
    return SecAggPlusState(**dict(record)) if record is not None else SecAggPlusState()


def _registry_path(context) -> str | None:
    """The site's copy of the federation's registry of node keys (``--node-config registry=PATH``), which
    binds its neighbours' SecAgg+ keys to their identities (:mod:`fedllm.secagg.binding`)."""
    from fedllm.flower.node import node_setting

    path = node_setting(context.node_config, "registry")
    return str(path) if path else None


def _own_client(context) -> int:
    from fedllm.flower.node import node_setting

    return int(
        node_setting(context.node_config, "client-id", node_setting(context.node_config, "partition-id", -1))
    )


def _record(context) -> dict:
    """What the guard keeps of the round between the protocol's stages (the quorum, the neighbours' clients,
    the round's keys, the survivors list signed)."""
    record = context.state.config_records.get(guard.STATE)
    return dict(record) if record is not None else {}


def _keep(context, record: dict) -> None:
    from flwr.app import ConfigRecord

    context.state.config_records[guard.STATE] = ConfigRecord(record)


def _guard(msg, context) -> None:
    """The site's checks of a protocol message before Flower's mod answers it (:mod:`fedllm.secagg.guard`),
    fedllm's own entries (signatures) included."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    from fedllm.flower.node import node_setting, pinned_secure

    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    stage = configs.get(Key.STAGE)
    floor = guard.Floor.of(context.node_config)
    registry_path = _registry_path(context)
    if stage == Stage.SETUP:
        guard.check_setup(configs, floor)
        _keep(context, {"least": floor.sites, "round": _round_of(msg), "group": str(msg.metadata.group_id)})
        if pinned_secure(context.node_config) and registry_path is None:
            raise guard.Refused(
                "this site is pinned to secure aggregation but holds no registry of its federation's node "
                "keys (--node-config registry=PATH): it cannot tell its neighbours' keys from a server's"
            )
        if pinned_secure(context.node_config) and node_setting(context.node_config, "state-dir") is None:
            raise guard.Refused(
                "this site is pinned to secure aggregation but has no state-dir (--node-config "
                "state-dir=PATH): the rounds it trained would be forgotten with the run"
            )
        return
    state = _protocol_state(context)
    after = {
        Stage.SHARE_KEYS: Stage.SETUP,
        Stage.COLLECT_MASKED_VECTORS: Stage.SHARE_KEYS,
        Stage.UNMASK: Stage.COLLECT_MASKED_VECTORS,
    }
    if stage in after and state.current_stage != after[stage]:  # Flower's order, before anything is kept
        raise guard.Refused(
            f"a {stage!r} message at the {state.current_stage!r} stage: expected after {after[stage]!r}"
        )
    record = _record(context)
    if stage == Stage.SHARE_KEYS:
        guard.check_share_keys(configs, int(state.share_num), int(state.nid), (binding.PREFIX,))
        if registry_path is not None:
            if str(msg.metadata.group_id) != record.get("group"):
                raise guard.Refused("a share-keys message of another round than the setup's")
            clients = guard.check_bound_keys(
                configs,
                binding.registry(registry_path),
                int(context.run_id),
                bytes(record.get("round", b"")),
                int(state.nid),
                _own_client(context),
            )
            keys = {int(k): [bytes(x) for x in v] for k, v in configs.items() if guard.canonical(k)}
            record.update(
                nodes=list(clients), clients=list(clients.values()), keyset=binding.keyset_digest(keys)
            )
            _keep(context, record)
    elif stage == Stage.COLLECT_MASKED_VECTORS:
        guard.check_collect(configs, {int(n) for n in state.public_keys_dict}, int(state.nid))
        if registry_path is not None:  # one statement, signed by every neighbour, before anything is masked
            fitins = msg.content.config_records.get("fitins.config")
            if "statement" not in record or fitins is None:
                raise guard.Refused("a collect message before this site signed the round's statement")
            if agreement.fitins_digest(fitins) != bytes(record["fitins"]):
                raise guard.Refused(
                    "the collect message's start is not the one this site checked and signed for the round"
                )
            guard.check_statement_signatures(
                configs,
                dict(zip(record.get("nodes", []), record.get("clients", []), strict=True)),
                binding.registry(registry_path),
                bytes(record["statement"]),
            )
    elif stage == Stage.UNMASK:
        least = int(record.get("least", floor.sites))
        neighbours = {int(n) for n in state.public_keys_dict}
        guard.check_unmask(configs, int(state.nid), neighbours, int(state.share_num), least)
        if registry_path is not None:
            survivors = [int(n) for n in configs[Key.ACTIVE_NODE_ID_LIST]]
            keyset = bytes(record.get("keyset", b""))
            guard.check_survivor_signatures(
                configs,
                survivors,
                [int(n) for n in record.get("signed", [])],
                dict(zip(record.get("nodes", []), record.get("clients", []), strict=True)),
                binding.registry(registry_path),
                binding.survivors_digest(int(context.run_id), keyset, survivors),
                int(state.threshold),
            )


def _round_of(msg) -> bytes:
    """This round's setup as a setup message shows it (:func:`fedllm.secagg.binding.setup_digest`)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    setup = {k: v for k, v in configs.items() if k != Key.STAGE and not k.startswith(binding.PREFIX)}
    return binding.setup_digest(str(msg.metadata.group_id), setup)


def _sign_keys(reply, msg, context) -> None:
    """A setup reply's keys signed by the site's node key, with the client it is and the round's setup
    (:mod:`.binding`)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    from fedllm.flower.node import signing_key

    key = signing_key(context.node_config)
    if key is None:
        return
    configs = reply.content.config_records[RECORD_KEY_CONFIGS]
    client = _own_client(context)
    digest = binding.keys_digest(
        int(context.run_id),
        int(context.node_id),
        client,
        _round_of(msg),
        bytes(configs[Key.PUBLIC_KEY_1]),
        bytes(configs[Key.PUBLIC_KEY_2]),
    )
    configs[binding.SIGNATURE] = binding.sign(key, digest)
    configs[binding.CLIENT] = client


def _agreement(msg, context, sites):
    """fedllm's statement stage (:mod:`.agreement`): check that the start is this site's part of the round's
    full-rank global state by the server's own rule (``sites.round_terms``: the ClientApp reads the config,
    which this package never imports), sign the round's statement (one a round), reply with the signature
    (empty where the site holds no registry: an unbound site checks nothing here)."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage

    from fedllm.flower.node import signing_key
    from fedllm.flower.records import start_config

    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    state = _protocol_state(context)
    if state.current_stage != Stage.SHARE_KEYS:
        stage = state.current_stage
        raise guard.Refused(f"a round statement at the {stage!r} stage: expected after share-keys")
    record = _record(context)
    registry_path = _registry_path(context)
    signature = b""
    if registry_path is not None:
        if str(msg.metadata.group_id) != record.get("group"):
            raise guard.Refused("a round statement of another round than the setup's")
        content = _from_bytes(bytes(configs[START]))
        config_text, client_id = start_config(content)
        if client_id != _own_client(context):
            own = _own_client(context)
            raise guard.Refused(f"a start for client {client_id} at the site of client {own}")
        full, full_digest = agreement.decode_state(bytes(configs[agreement.GLOBAL]))
        _, start, want, cfg_digest = sites.round_terms(config_text, content, full)
        if str(start.round) != record.get("group"):
            raise guard.Refused(
                f"a start of round {start.round} in the protocol's round {record.get('group')}"
            )
        agreement.check_start(start, want, full)
        digest = agreement.statement(
            int(context.run_id),
            agreement.federation_of(context.node_config, registry_path),
            int(start.round),
            str(start.token),
            cfg_digest,
            str(configs[LAYOUT]),
            full_digest,
        )
        if "statement" in record and bytes(record["statement"]) != digest:
            raise guard.Refused("a second round statement this round: a site signs one")
        federation = agreement.federation_of(context.node_config, registry_path)
        pledges = site_folder(context) / f"client-{_own_client(context)}-{STATEMENTS}"
        pledge_statement(pledges, federation, int(start.round), digest)
        record.update(statement=digest, fitins=agreement.fitins_digest(configs))
        _keep(context, record)
        key = signing_key(context.node_config)
        signature = binding.sign(key, digest) if key is not None else b""
    reply = ConfigRecord({agreement.SIGNATURE: signature})
    return Message(RecordDict({RECORD_KEY_CONFIGS: reply}), reply_to=msg)


def _consistency(msg, context):
    """fedllm's survivors stage (:mod:`.binding`): check the list, sign it (one list a round, for this round's
    keys), reply with the signature (empty where the site has no node key)."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage

    from fedllm.flower.node import signing_key

    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    state = _protocol_state(context)
    if state.current_stage != Stage.COLLECT_MASKED_VECTORS:
        raise guard.Refused(
            f"a survivors list at the {state.current_stage!r} stage: expected after the collect"
        )
    record = _record(context)
    survivors = sorted(int(n) for n in configs[binding.SURVIVORS])
    neighbours = {int(n) for n in state.public_keys_dict}
    guard.check_survivors(survivors, int(state.nid), neighbours, int(record.get("least", 3)))
    if "signed" in record and sorted(int(n) for n in record["signed"]) != survivors:
        raise guard.Refused("a second survivors list this round: a site signs one")
    record["signed"] = survivors
    _keep(context, record)
    key = signing_key(context.node_config)
    digest = binding.survivors_digest(int(context.run_id), bytes(record.get("keyset", b"")), survivors)
    signature = binding.sign(key, digest) if key is not None else b""
    reply = ConfigRecord({binding.SURVIVORS_SIGNATURE: signature})
    return Message(RecordDict({RECORD_KEY_CONFIGS: reply}), reply_to=msg)


CLAIMS = "secagg-claims.json"  # beside a site's state folders: the rounds it trained under the protocol
STATEMENTS = "secagg-statements.json"  # beside them too: the one statement it signed for each round
# what in a config does not decide a site's update (a server may change it at will): whole sections, and
# federation keys by a word of their name
NOT_TRAINING = ("flower", "eval", "output", "secagg")
NOT_TRAINING_KEYS = ("timeout", "min_clients")


def training_digest(cfg) -> str:
    """A digest of what decides a site's update in ``cfg``: every section but :data:`NOT_TRAINING`, and the
    federation's keys but its timeouts and quorum. A server that changes any of it makes another trajectory,
    whose updates differ from this one's."""
    values = {k: v for k, v in cfg.to_dict().items() if k not in NOT_TRAINING}
    fed = values.get("federation", {})
    values["federation"] = {k: v for k, v in fed.items() if not any(w in k for w in NOT_TRAINING_KEYS)}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


def collect_signatures(grid, messages, timeout: float, key: str) -> dict[int, bytes]:
    """Each node's signature under ``key`` in its reply to ``messages`` (a reply with an error, or without
    a signature, gives none: the protocol's checks count the missing)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    out: dict[int, bytes] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        if not reply.has_error():
            configs = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
            signature = configs.get(key, b"")
            if isinstance(signature, bytes) and signature:
                out[int(reply.metadata.src_node_id)] = signature
    return out


def site_folder(context) -> Path:
    """The folder beside a site's state folders (its SuperNode's ``state-dir``, else the Flower run's
    temporary one, as :func:`fedllm.flower.site.site_for` places them): its once-a-round records."""
    import tempfile

    from fedllm.flower.node import node_setting

    default = Path(tempfile.gettempdir()) / "fedllm-sites" / f"run-{int(context.run_id)}"
    return Path(node_setting(context.node_config, "state-dir", default))


@contextlib.contextmanager
def _locked_record(path: Path):
    """A site's JSON record file, read and then written atomically under an exclusive lock (two runs on one
    SuperNode cannot both pass a check of it); written only if the body returns without raising. A record
    that does not read (damaged outside fedllm: its writes are atomic) refuses every secure round until the
    site's operator restores it: read as empty, it would forget the rounds the site trained and the
    statements it signed, which is what the record protects."""
    import fcntl

    from fedllm.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:  # JSONDecodeError and UnicodeDecodeError are ValueErrors; nesting past Python's stack limit
            record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        except (ValueError, RecursionError) as e:
            record = e
        if not isinstance(record, dict):
            log.error(
                "secure aggregation: %s does not read as a JSON object (%s): restore it from a backup "
                "(deleting it would let this site sign or train a round twice)",
                path,
                record,
            )
            raise unreadable(path)
        yield record
        atomic_write_text(path, json.dumps(record, sort_keys=True))


def unreadable(path: Path) -> guard.Refused:
    """The refusal of a site whose record ``path`` does not read (the file's name only: it names the site,
    which the server knows)."""
    return guard.Refused(
        f"this site's record {path.name} does not read: it refuses secure rounds until its operator restores "
        "the file"
    )


def pledge_statement(pledges: Path, federation: str, round_idx: int, digest: bytes) -> None:
    """Record, before the site signs, that the statement it signs for ``round_idx`` of its ``federation`` is
    ``digest``; refused if it signed another for that round already: in this protocol instance, in one the
    server restarted from its setup (Flower's mod allows that), or in an earlier Flower run. Without it a
    server could collect every site's signature on one statement in one instance and on another in a second
    (aborting both before the collect stage, so nothing is trained or claimed), then in a third send the
    target one round and the others another, and relay to each side the signatures it collected on its
    statement: every check would pass on a sum of the target's update and updates that change nothing.
    Signing one statement per round of its federation, ever, leaves a server one signature per site per
    round, all on that site's one statement; the same statement again (a restart of the same round) is
    signed again. The record is a file beside the site's state folders (:func:`site_folder`); the refusal
    names no statement of the site's. Its price: a round whose run died after the sites signed is not
    resumed in another Flower run (its run id is in the statement): the resumed run goes on with the next
    round, as it does for a round the sites trained (:func:`claim_round`)."""
    with _locked_record(pledges) as signed:
        key = f"{federation}/{round_idx}"
        if not isinstance(signed.get(key, ""), str):  # damaged outside fedllm
            raise unreadable(pledges)
        if signed.get(key, digest.hex()) != digest.hex():
            raise guard.Refused(
                f"a round statement for round {round_idx} other than the one this site signed for that "
                "round of its federation: a site signs one statement a round, across runs and restarts"
            )
        signed[key] = digest.hex()


def claim_round(claims: Path, trajectory: str, round_idx: int) -> None:
    """Record, before the site trains, that it trains ``round_idx`` of ``trajectory`` under the protocol;
    refused if it trained that round, or a later one, already, in this Flower run or an earlier one. Two sums
    over sets that differ by one site, of the same round from the same start, give that site's update (a
    site's training from the same start, round and config is the same run after run). ``trajectory``: the
    site's federation (:func:`fedllm.secagg.agreement.federation_of`) where it has one, so that no config the
    server sends opens another (one ulp of a learning rate, a key the update does not read); else, for an
    unbound site, what decides its update (:func:`training_digest`). The record is a file beside the site's
    state folders (the SuperNode's ``state-dir``), read and written under a lock, so that two runs on one
    SuperNode cannot both pass. A resumed secure run therefore continues from the round after the last one
    its sites trained; a new federation (a new ``federation`` node config, or a new registry) starts at
    round 1. The refusal names no round of the site's (the server learns nothing of its past from it)."""
    with _locked_record(claims) as done:
        last = done.get(trajectory, 0)
        if not isinstance(last, int):  # damaged outside fedllm
            raise unreadable(claims)
        if last >= round_idx:
            raise guard.Refused(
                f"a secure training for round {round_idx} that this site's federation has had already: a "
                "site trains each round once (two sums that differ by one site give that site's update)"
            )
        done[trajectory] = round_idx


def admitted(msg, context, sites):
    """The site, its start and the round's layout for a collect message, once the site agrees to train:
    the config is a secure one with a clip, the message is for this site's client, every setup parameter is
    what the config gives (:func:`fedllm.secagg.guard.check_round_config`), a pinned site's noise is its
    own, and the site has not trained this round of its trajectory (:func:`claim_round`)."""
    from fedllm.flower.records import read_start, start_config

    config = msg.content.config_records.get("fitins.config")
    if config is None or START not in config:
        raise guard.Refused(
            "a collect message without the run's start and config: nothing to check it against"
        )
    content = _from_bytes(bytes(config[START]))
    config_text, client_id = start_config(content)
    lay = [(name, tuple(shape)) for name, shape in json.loads(str(config[LAYOUT]))]
    site = sites.site(context, config_text)
    if not site.cfg.flower.secure_aggregation or clip_of(site.cfg) <= 0:
        raise RuntimeError("a secure aggregation message under a config without it (or without a clip)")
    if site.client_id != client_id:
        raise RuntimeError(f"message for client {client_id} reached the site of client {site.client_id}")
    # the round's setup against the run's config, before anything is trained or masked: the quorum is what
    # the unmask check requires of the survivors
    record = _record(context)
    record["least"] = guard.check_round_config(
        _protocol_state(context), site.cfg, guard.Floor.of(context.node_config)
    )
    _keep(context, record)
    start = read_start(content, site.codecs)
    why = known_noise(site.cfg) if site.pinned else ""
    if why:
        raise guard.Refused(why)
    claims = Path(site.state_dir).parent / f"client-{site.client_id}-{CLAIMS}"
    federation = agreement.federation_of(context.node_config, _registry_path(context))
    claim_round(claims, federation or training_digest(site.cfg), int(start.round))
    return site, start, lay


def _secure_train(msg, context, sites):
    """The site's round under secure aggregation: train from the start in the FitIns, reply with the padded
    change for the mod to quantize and mask (its weight: its own example count, or 1 under uniform
    weighting; no metrics leave the site)."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    site, start, lay = admitted(msg, context, sites)
    client_id = site.client_id
    update = site.train(start)
    sites.keep(context, site)
    changes = update.attachments.get(KEY)
    if changes is None:
        raise RuntimeError("secure aggregation: the site's runtime made no secure summand")
    gen = seeded_generator(noise_seed(site.cfg), start.round, client_id, 3)
    vector = site_vector(changes, lay, noise_std(site.cfg) if distributed(site.cfg) else 0.0, gen)
    weight = 1 if uniform(site.cfg) else int(site.declared_examples())
    return Message(
        RecordDict(
            {
                "fitres.parameters": ArrayRecord([vector]),
                "fitres.num_examples": MetricRecord({"num_examples": weight}),
                "fitres.metrics": ConfigRecord({}),
                "fitres.status": ConfigRecord({"code": 0, "message": ""}),
            }
        ),
        reply_to=msg,
    )
