"""The Flower ServerApp: fedllm's round loop (:class:`~fedllm.round_loop.RoundLoop`) with clients on sites.

The server side is the same :class:`~fedllm.server.Server` as in the
simulation; only :meth:`FlowerDriver.train_clients` differs: each active
client's ClientStart goes to its site's SuperNode as one Message (every site
its own payload: ranks and FlexLoRA truncations differ), and the replies come
back as ClientUpdates. A site that does not answer within
``federation.client_timeout_s``, fails, or sends a bad update is left out of
the round as in the simulation (``federation.min_clients`` applies); a site
that comes back (a new node id after a restart) is found again by the
handshake (a ``query`` message) and rejoins, under the identity rules of
:mod:`fedllm.flower.identity` (a node answers for a client id only with that
id's registered key, or, without a registry, while no other live node holds
it). The global model is evaluated on
the server's own copy of the base (the benchmark and, when the server can
read the data, the held-out split); personalized evaluation runs on the sites.

``flwr run .`` reads ``config`` (a YAML path), ``overrides`` (``key=value``
separated by spaces) and ``run-dir`` from the app's run config.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, MessageType
from flwr.serverapp import Grid, ServerApp

from data_prep.schema import DataError
from fedllm import assembly
from fedllm.aggregation import strategy_from_config
from fedllm.checks import one_line
from fedllm.config import Config, config_to_text, load_config, settle_clip
from fedllm.federation_data import load_partitions
from fedllm.flower.identity import Bindings, load_registry, refuse_token_modules
from fedllm.flower.records import info_record, record_bytes, start_record
from fedllm.flower.replies import BadReply, check_signature, parse_evaluation, parse_info, parse_update
from fedllm.logs import client_label, names_clients, redact, setup_logging
from fedllm.model import precision
from fedllm.protocol import SummedUpdates
from fedllm.round_loop import RoundLoop, personal_summary

log = logging.getLogger(__name__)


class FlowerDriver(RoundLoop):
    """The round loop over a Flower Grid (see module docstring)."""

    runs_exchanges = True  # a feature's way to gather a round (secure aggregation) runs here
    clients_are_organizations = True  # aggregation.clip_norm_ratio=auto clips here

    def __init__(
        self, cfg: Config, run_dir: Path, grid: Grid, accelerator=None, startup_timeout_s: float = 600.0
    ):
        super().__init__(cfg, run_dir, accelerator)
        self.grid, self.startup_timeout_s = grid, startup_timeout_s
        self.site_config = config_to_text(site_view(cfg))  # what the sites get: no operator path
        registry = (
            load_registry(cfg.flower.registry, cfg.federation.num_clients) if cfg.flower.registry else None
        )
        self.bindings = Bindings(registry)
        if registry is None:
            log.warning(
                "flower.registry is not set: a site is whoever claims its client id first (refused while "
                "another live node holds it); identities are unauthenticated"
            )
        # a site that never replies is left out after this long (the handshake is short: a site that is up
        # answers it in seconds)
        self.timeout = cfg.federation.client_timeout_s or cfg.flower.round_timeout_s
        self.handshake_timeout = cfg.flower.handshake_timeout_s
        self.message_bytes = {"flower_down_bytes": 0, "flower_up_bytes": 0}  # this round's, serialized
        self.codecs = assembly.codecs(cfg)  # how the run's features change what travels (Feature.codec)

    @property
    def nodes(self) -> dict[int, int]:
        """client id -> node id, as bound (see :mod:`fedllm.flower.identity`)."""
        return self.bindings.nodes

    def adapter_rank(self, client: int) -> int:
        """The adapter rank the run's config gives ``client`` (what its handshake must claim)."""
        strategy = strategy_from_config(self.cfg.aggregation)
        return strategy.adapter_rank(assembly.assign_ranks(self.cfg)[client])

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        strategy = strategy_from_config(cfg.aggregation)
        layout = assembly.layout_for(cfg, self.acc, strategy)
        self.benchmark = assembly.benchmark_for(cfg)
        model, tokenizer = assembly.load_model(cfg, self.acc)
        lora_ranks = assembly.assign_ranks(cfg)
        ranks = sorted({strategy.adapter_rank(r) for r in lora_ranks})
        # the evaluation base: no client trains here
        self.runtime = assembly.build_runtime(cfg, strategy, layout, self.acc, model, tokenizer, ranks)
        self.general = assembly.general_for(cfg, model)
        self._evaluator = None  # built from what this setup sets (RoundLoop.evaluator)
        try:  # the server's held-out split, when it can read the data (the built-in data, a public file)
            parts = load_partitions(cfg)
            _, self.eval_data = assembly.tokenize_partitions(
                cfg, parts, model, tokenizer, self.acc, clients=False
            )
            self.generation = assembly.generation_for(cfg, parts, model)
        except DataError as e:
            log.warning("the server cannot read data.dataset (%s): no held-out loss, the benchmark only", e)
            self.eval_data = []
        infos = self.wait_for_sites()
        self.partition_stats = [
            {
                "client": k,
                "size": i["num-examples"] + i.get("num-test", 0),
                "rank": lora_ranks[k],
                "train": i["num-examples"],
                **({"test": i["num-test"]} if "num-test" in i else {}),
                **({"categories": json.loads(i["categories"])} if "categories" in i else {}),
            }
            for k, i in sorted(infos.items())
        ]
        sizes = {k: i["num-examples"] for k, i in infos.items()}
        self.server = assembly.build_server(
            cfg, strategy, assembly.client_infos(cfg, strategy, sizes), self.runtime
        )

    def key_of(self, client_id: int) -> bytes | None:
        """The public key the operator registered for ``client_id`` (None in plain mode)."""
        return self.bindings.key_of(client_id)

    def handshake(self) -> dict[int, dict]:
        """Ask every node not yet bound which client it is and bind it if it may be that client; forget
        nodes that are gone. Every reply goes through the guarded parser (a malformed one refuses that node
        for now; it is asked again at the next handshake)."""
        keys = {n.node_id: bytes(getattr(n, "public_key", b"")) or None for n in self.grid.get_nodes()}
        self.bindings.forget_gone(set(keys))
        unknown = sorted(set(keys) - set(self.nodes.values()))
        messages = {
            n: Message(info_record({}, self.site_config), dst_node_id=n, message_type=MessageType.QUERY)
            for n in unknown
        }
        got = (
            self.grid.send_and_receive(list(messages.values()), timeout=self.handshake_timeout)
            if messages
            else []
        )
        sent = {m.metadata.message_id: n for n, m in messages.items()}  # ids given by the grid
        infos = {}
        for reply in got:
            node = sent.get(getattr(reply.metadata, "reply_to_message_id", None))
            if node is None:  # a reply to no handshake of ours (or from a node we did not ask)
                log.warning(
                    "a handshake reply to no message of ours (from node %s)", reply.metadata.src_node_id
                )
                continue
            if reply.has_error():
                log.warning("node %s failed the handshake: %s", node, one_line(reply.error.reason))
                continue
            try:
                info = parse_info(reply.content)
            except Exception as e:  # BadReply, or anything its content made the parser raise
                log.warning("node %s sent an unusable handshake: %s", node, one_line(str(e)))
                continue
            k, n = info["client-id"], info["num-examples"]
            if not 0 <= k < self.cfg.federation.num_clients:
                log.warning("node %s claims client %s with %s examples: refused", node, k, n)
                continue
            rank = self.adapter_rank(k)
            if "rank" in info and info["rank"] != rank:
                log.warning("node %s claims client %d at rank %s, the config's is %d: refused", node, k,
                            info["rank"], rank)  # fmt: skip
                continue
            if self.bindings.claim(node, k, keys.get(node)) is not None:
                continue
            try:  # the claim comes from the client's key: the reply must be signed by it too
                check_signature(reply.content, self.key_of(k), reply.metadata.reply_to_message_id)
            except BadReply as e:
                self.bindings.nodes.pop(k, None)
                log.warning("node %s claims client %d: refused (%s)", node, k, e)
                continue
            infos[k] = info
        return infos

    def wait_for_sites(self) -> dict[int, dict]:
        """Every client's site, found by handshakes until all ``federation.num_clients`` answered (or a
        timeout).
        """
        wanted, infos = set(range(self.cfg.federation.num_clients)), {}
        deadline = time.monotonic() + self.startup_timeout_s
        while not wanted <= set(infos):
            infos.update(self.handshake())
            if wanted <= set(infos):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only clients {sorted(infos)} of {sorted(wanted)} connected within "
                    f"{self.startup_timeout_s:.0f} s: start a SuperNode per site"
                )
            time.sleep(1.0)
        log.info("sites connected: %s", {k: self.nodes[k] for k in sorted(self.nodes)})
        return infos

    # ------------------------------------------------------------- a round
    def _send(self, starts: dict[int, Any], message_type: str, round_idx: int) -> tuple[dict, dict, dict]:
        """Send each client's start to its site: (messages by client, replies by client, failures)."""
        failures: dict[int, str] = {}
        messages: dict[int, Message] = {}
        for k, start in starts.items():
            if k not in self.nodes:
                failures[k] = "site not connected"
                continue
            messages[k] = Message(
                start_record(start, self.site_config, k, self.codecs),
                dst_node_id=self.nodes[k],
                message_type=message_type,
                group_id=str(round_idx),
            )
        got = self.grid.send_and_receive(list(messages.values()), timeout=self.timeout) if messages else []
        if message_type == MessageType.TRAIN:  # what the ledger's down_bytes / up_bytes are the tensors of
            self.message_bytes["flower_down_bytes"] += sum(record_bytes(m.content) for m in messages.values())
            # an error reply has no content (Flower raises on reading it): it carried none
            self.message_bytes["flower_up_bytes"] += sum(
                record_bytes(r.content) for r in got if not r.has_error()
            )
        # the grid gave each message its id; an error reply for a node that is gone comes from the SuperLink
        sent = {m.metadata.message_id: k for k, m in messages.items()}
        replies = {}
        for reply in got:
            k = sent.get(reply.metadata.reply_to_message_id)
            if k is None or k in replies:
                log.warning(
                    "round %d: a reply to no message of this round (from node %s)",
                    round_idx,
                    reply.metadata.src_node_id,
                )
                continue
            if reply.has_error():
                failures[k] = one_line(f"site error: {reply.error.reason}")
            else:
                replies[k] = reply
        for k in set(messages) - set(replies) - set(failures):
            failures[k] = (
                f"no reply within {self.timeout:.0f} s (federation.client_timeout_s / flower.round_timeout_s)"
            )
        return messages, replies, failures

    def _exchange(
        self, starts: dict[int, Any], message_type: str, round_idx: int, parse
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Send each client's start to its site and parse each reply with ``parse(k, content, reply_to)``;
        returns (parsed replies by client, failures by client). A reply whose signature fails (another
        site answering for this one) is refused and the site is asked once more, with a new message."""
        self.handshake()  # a restarted site has a new node id: find it again
        parsed, failures, retry = {}, {}, {}
        for attempt in (1, 2):
            messages, replies, failed = self._send(retry if attempt == 2 else starts, message_type, round_idx)
            failures.update(failed)
            retry = {}
            for k, reply in replies.items():
                try:
                    parsed[k] = parse(k, reply.content, messages[k].metadata.message_id)
                    failures.pop(k, None)
                except BadReply as e:
                    failures[k] = f"unusable reply: {e}"
                    if "signature" in str(e) and attempt == 1:
                        retry[k] = starts[k]
                except Exception as e:  # a reply the parser let through and its use did not: still the site's
                    failures[k] = one_line(f"unusable reply ({type(e).__name__}: {e})")
                    log.debug(
                        "round %d: %s's reply raised", round_idx, client_label(k), exc_info=names_clients()
                    )
            if not retry:
                break
            log.warning(
                "round %d: asking %s again after a reply that failed its signature",
                round_idx,
                f"clients {sorted(retry)}" if names_clients() else f"{len(retry)} client(s)",
            )
        for k, why in sorted(failures.items()):
            log.warning("round %d: %s left out: %s", round_idx, client_label(k), redact(why))
        return parsed, failures

    def max_reply_bytes(self, client_id: int) -> int:
        """The most a train reply of ``client_id`` may carry: three times its expected update in float32
        (factors, dense modules, an algorithm's or strategy's extras of the same size) and what the strategy
        says its extras may hold beyond that (Fed-SB's dense initialization steps), plus 1 MiB."""
        exp = self.server.expected(client_id)
        numel = sum(int(torch.Size(s).numel()) for s in exp.param_shapes().values())
        return 3 * 4 * numel + 4 * self.server.strategy.extras_numel(exp) + (1 << 20)

    def received(self, plan, k: int, update):
        """A parsed update as the server uses it: each of the run's codecs (``Feature.codec``, in reverse
        order) given what client ``k`` started from and the server's own derivation of its factors; what a
        codec refuses is that site's failure."""
        start = plan.starts[k]
        if not self.codecs:
            return update
        started = self.server.reference(plan.round, k, start)
        for codec in reversed(self.codecs):
            try:
                update = codec.received(update, start, started)
            except (KeyError, ValueError) as e:
                raise BadReply(one_line(str(e))) from None
        return update

    def run_round(self, round_idx: int):
        """The round loop's round, its row with the bytes the train messages took serialized on Flower
        (``flower_down_bytes``, ``flower_up_bytes``): the ledger's tensors plus each array's header, the
        metadata and the config a message carries."""
        self.message_bytes = {"flower_down_bytes": 0, "flower_up_bytes": 0}
        done = super().run_round(round_idx)
        if self.exchange is None:  # a feature's exchange (SecAgg+) sends its own messages: not measured
            done.row.update(self.message_bytes)
        return done

    def train_clients(self, plan) -> dict[int, Any] | SummedUpdates:
        """Each active client's update (or why it failed), or a feature's exchange's result (secure
        aggregation: the round's sum, ``fedllm/secagg``)."""
        if self.exchange is not None:
            return self.exchange.train(self, plan)

        def parse(k, content, reply_to):
            update = parse_update(content, self.max_reply_bytes(k), self.key_of(k), reply_to, self.codecs)
            return self.received(plan, k, update)

        replies, failures = self._exchange(plan.starts, MessageType.TRAIN, plan.round, parse)
        return {**failures, **replies}

    def personalized(self, round_idx: int, clients: list[int]) -> dict[str, Any]:
        """Each visited site's evaluation of its personalized model; none asked where the sites keep their
        figures (``assembly.site_figures_hidden``: a secure run by default)."""
        if assembly.site_figures_hidden(self.cfg):
            return {}
        starts = {k: self.server.client_start(round_idx + 1, k) for k in clients}
        replies, _ = self._exchange(
            starts,
            MessageType.EVALUATE,
            round_idx,
            lambda k, content, reply_to: parse_evaluation(content, self.key_of(k), reply_to),
        )
        return personal_summary({str(k): m for k, m in sorted(replies.items()) if m})


def site_view(cfg: Config) -> Config:
    """The config as the sites get it: the run's settings without the operator's paths (its run folder, its
    key registry), which a site has no use for and should not learn."""
    import copy

    view = copy.deepcopy(cfg)
    view.output.dir, view.flower.registry = "", ""
    return view


def run_server(grid: Grid, cfg: Config, run_dir: Path, startup_timeout_s: float = 600.0) -> dict:
    """The ServerApp's work: the run folder's policy (the CLI's: lock, refuse, continue), then the round
    loop."""
    from fedllm.run import folder as rundir

    setup_logging(os.environ.get("FEDLLM_LOG_LEVEL", "INFO"))
    refuse_token_modules(cfg)
    cfg.output.dir = str(run_dir)
    # 'auto' settled as this driver will (the clip across organizations, the precision): runs compare equal
    settle_clip(cfg, FlowerDriver.clients_are_organizations)
    precision.resolve(cfg)
    action, lock = rundir.open_run(run_dir, cfg)
    if action == "done":
        log.info("nothing to do: %s has finished all %d rounds", run_dir, cfg.federation.rounds)
        return {}
    try:
        driver = FlowerDriver(cfg, run_dir, grid, startup_timeout_s=startup_timeout_s)
        driver.setup()
        return driver.run(resume=action == "continue")
    finally:
        lock.release()


def server_app(cfg: Config, run_dir: Path, startup_timeout_s: float = 600.0) -> ServerApp:
    """A ServerApp bound to a config (``flwr.simulation.run_simulation`` passes no run config)."""
    app_ = ServerApp()

    @app_.main()
    def main(grid: Grid, context: Context) -> None:
        run_server(grid, cfg, run_dir, startup_timeout_s)

    return app_


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run .``: the config file, overrides and run folder from the app's run config."""
    rc = context.run_config
    cfg = load_config(rc.get("config") or None, str(rc.get("overrides", "")).split())
    run_dir = Path(str(rc.get("run-dir") or f"runs/flower-{time.strftime('%Y%m%d-%H%M%S')}"))
    run_server(grid, cfg, run_dir, float(rc.get("startup-timeout-s", 600)))
