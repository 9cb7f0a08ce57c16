"""One real site: its data, its base model and its client state, kept on its own disk.

A Flower ClientApp runs :class:`Site` for exactly one client: the client id,
the data file and the base model path come from the SuperNode's
``--node-config`` (on the Simulation Engine: ``partition-id``, and the
partition is rebuilt from the run's config). What stays on the site stays
there: the algorithm's state (SCAFFOLD's c_k), FLoRAL's router and the merges
applied to the site's base (FLoRA, FLoRIST), in ``context.state`` while the
SuperNode lives and in the site's state folder (``state-dir``) so that a
restarted SuperNode resumes. The base is loaded once per process and kept in
the state folder in ``save_pretrained`` form (safetensors), so a SuperNode
that starts a fresh process for every message loads it fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from fedllm.config import Config, ConfigError, config_from_text
from fedllm.factors import adapter_from_tensors, adapter_tensors, prefixed, unprefixed
from fedllm.files import atomic_write_text, save_tensors_atomic
from fedllm.flower.node import node_setting, pinned_secure
from fedllm.model import precision
from fedllm.protocol import ClientStart, ClientUpdate

log = logging.getLogger(__name__)

_SITES: dict[tuple, Site] = {}  # one per process and (state folder, config): a Ray worker hosts many nodes


def trajectory_digest(cfg: Config) -> str:
    """A digest of what the clients train (a resume may change rounds, evaluation and output: same site
    state).
    """
    from fedllm.config import flat_config
    from fedllm.run.folder import RESUMABLE_CHANGES

    keys = {k: v for k, v in flat_config(cfg).items() if not k.startswith(RESUMABLE_CHANGES)}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:12]


def site_for(config_text: str, node_config, run_id: int) -> Site:
    """This process's site for ``node_config`` under the server's config (built once, then reused)."""
    client_id = int(node_setting(node_config, "client-id", node_setting(node_config, "partition-id", -1)))
    if client_id < 0:
        raise ConfigError(
            "the SuperNode's --node-config names no client-id (e.g. --node-config \"client-id=0 "
            'data-path=/data/site0.jsonl state-dir=/var/lib/fedllm")'
        )
    cfg = config_from_text(config_text, "the server's resolved config")
    digest = trajectory_digest(cfg)
    state_dir = (
        Path(
            node_setting(
                node_config, "state-dir", Path(tempfile.gettempdir()) / "fedllm-sites" / f"run-{run_id}"
            )
        )
        / f"client-{client_id}-{digest}"
    )
    key = (str(state_dir), digest)
    if key not in _SITES:
        _SITES[key] = Site(
            cfg,
            client_id,
            state_dir,
            node_setting(node_config, "data-path"),
            node_setting(node_config, "model-path"),
            pinned_secure(node_config),
        )
    return _SITES[key]


class Site:
    """One client's runtime, data and durable state (see module docstring)."""

    def __init__(
        self,
        cfg: Config,
        client_id: int,
        state_dir: Path,
        data_path: str | None = None,
        model_path: str | None = None,
        pinned: bool = False,
    ) -> None:
        from accelerate import Accelerator

        from fedllm.assembly import assemble_site, codecs
        from fedllm.federation_data import load_partitions, own_split

        t0 = time.perf_counter()
        if not 0 <= client_id < cfg.federation.num_clients:
            raise ConfigError(
                f"client-id {client_id}: the run has clients 0..{cfg.federation.num_clients - 1}"
            )
        self.cfg, self.client_id, self.state_dir = cfg, client_id, Path(state_dir)
        self.pinned = pinned  # the SuperNode's own secure-aggregation='required'
        self.codecs = codecs(cfg)  # how the run's features change what travels (Feature.codec)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if data_path:
            examples, n_test = own_split(_site_examples(data_path, cfg), cfg.data)
        else:  # the Simulation Engine: this partition of the run's own data
            parts = load_partitions(cfg)
            examples, n_test = parts.clients[client_id], parts.test_sizes[client_id]
        acc = Accelerator(cpu=not torch.cuda.is_available(), **precision.accelerator_kwargs(cfg))
        precision.warn_where_emulated(acc)
        base = self._fast_base(model_path or cfg.model.name)
        self.runtime, self.client = assemble_site(cfg, client_id, examples, n_test, acc, base)
        train, test, rank = self.client.train, self.client.test, self.client.rank
        self.categories = _histogram(examples)
        # as its data holds them: no server setting (length, split, Natural Instructions' held-out tasks or
        # per-task sample, which a sweep would turn into a per-task histogram) in a pinned site's count
        self.own_examples = _own_count(data_path) if pinned and data_path else len(examples)
        resumed = self._load_state()
        dropped = len(examples) - len(train) - len(test)
        log.info(
            "site %d ready in %.1f s: %d train / %d test examples%s, rank %d%s",
            client_id,
            time.perf_counter() - t0,
            len(train),
            len(test),
            f" ({len(examples)} partitioned, {dropped} dropped when tokenized)" if dropped > 0 else "",
            rank,
            "" if resumed is None else f", state of round {resumed} from {self.state_dir}",
        )

    def _fast_base(self, name: str) -> str:
        """The base as a local ``save_pretrained`` folder in the state folder (first use: loaded and
        saved).
        """
        from fedllm.model.modeling import resolve_model_path

        path = resolve_model_path(name, self.cfg.model.builtin_pretrain_steps)
        if Path(path).is_dir():
            return path
        local = self.state_dir / "base"
        if not (local / "config.json").exists():
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=self.state_dir))
            AutoModelForCausalLM.from_pretrained(path, use_kernels=False).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
            tmp.rename(local)
        return str(local)

    # ------------------------------------------------------------ state
    def _load_state(self) -> int | None:
        """The client state and the merges already applied, from the state folder; returns their round."""
        meta_path = self.state_dir / "site.json"
        if not meta_path.exists():
            return None
        from safetensors.torch import load_file

        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(self.state_dir / "state.safetensors"))
        self.client.state = unprefixed(tensors, "client.")
        residual = adapter_from_tensors(tensors, meta["scales"], "residual.")
        self.runtime.restore_base(residual, meta["applied_round"])
        return int(meta.get("round", meta["applied_round"]))

    def save_state(self, round_idx: int) -> None:
        tensors, scales = adapter_tensors(self.runtime.residual, "residual.")
        tensors.update(prefixed(self.client.state, "client."))
        save_tensors_atomic(self.state_dir / "state.safetensors", tensors)
        atomic_write_text(
            self.state_dir / "site.json",
            json.dumps(
                {
                    "round": round_idx,
                    "applied_round": self.runtime.applied_round,
                    "scales": scales,
                    "client": self.client_id,
                }
            ),
        )

    def use_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """Take the client state Flower kept in this SuperNode's memory (``context.state``).

        It equals the state folder's (the site writes both after every
        message); after a SuperNode restart it is empty and the folder's stays.
        """
        if state:
            self.client.state = dict(state)

    # ----------------------------------------------------------- the work
    def keeps_figures(self) -> bool:
        """Whether this site keeps its own figures (its evaluation, an example count the weighting does not
        need): a feature says so (``assembly.site_figures_hidden``: secure aggregation by default), or the
        site is pinned to secure aggregation (its node config), whatever the server's config says."""
        from fedllm.assembly import site_figures_hidden

        return bool(site_figures_hidden(self.cfg)) or self.pinned

    def declared_examples(self) -> int:
        """The example count this site declares (its handshake, its weight in a secure sum): a pinned site's
        is the count of its own examples as its data holds them, before any split or tokenization the
        server's config decides, so that no config the server sends (a ``data.max_seq_len`` sweep, a
        truncation side) makes the count tell how long its examples are; an unpinned site's, the training
        examples it has under the run's config."""
        return self.own_examples if self.pinned else self.client.num_examples

    def info(self) -> dict:
        """The handshake: the client id, its rank and the example count weighting needs (1 where the
        weighting is uniform and the site keeps its figures: :meth:`declared_examples` otherwise); the
        category histogram and the test size only with ``flower.share_data_stats``, and never from a site
        pinned to secure aggregation (it answers what the protocol needs, whatever the config asks)."""
        from fedllm.assembly import server_policy

        count = self.declared_examples()
        if self.keeps_figures() and server_policy(self.cfg).weighting == "uniform":
            count = 1  # uniform weights need no count: the server learns none
        out = {"client-id": self.client_id, "rank": self.client.rank, "num-examples": count}
        if self.cfg.flower.share_data_stats and not self.pinned:
            out.update({"num-test": len(self.client.test), "categories": json.dumps(self.categories)})
        return out

    def train(self, start: ClientStart) -> ClientUpdate:
        t0 = time.perf_counter()
        update = self.runtime.train(self.client, start)
        if not self.cfg.flower.share_losses:  # the server then logs no train_loss for this site
            update.metrics = {k: v for k, v in update.metrics.items() if not k.startswith("loss_")}
        self.save_state(start.round)
        log.info("site %d trained round %d in %.1f s", self.client_id, start.round, time.perf_counter() - t0)
        return update

    def personalized(self, start: ClientStart) -> dict:
        """The site's personalized evaluation, or nothing where it keeps its figures
        (:meth:`keeps_figures`)."""
        row = (
            self.runtime.personalized(self.client, start, self.cfg.eval.batch_size)
            if self.client.test and not self.keeps_figures()
            else {}
        )
        self.save_state(start.round - 1)  # the merges it applied
        return row


def _site_examples(data_path: str, cfg):
    """A site's own examples: any file ``data.dataset`` takes, in its order; a Natural Instructions folder
    without the run's held-out tasks (evaluated, never trained on), sampled as the run samples its tasks."""
    from data_prep import natural_instructions as ni
    from data_prep.loaders import load_examples

    folder = ni.resolve(str(data_path))
    held = ni.select_tasks(folder, cfg.data.heldout_tasks) if folder and cfg.data.heldout_tasks else []
    per_task = cfg.data.examples_per_task if folder else 0
    return load_examples(str(data_path), seed=cfg.federation.seed, per_task=per_task, exclude_tasks=held)


def _own_count(data_path: str) -> int:
    """How many examples a site's data file (or Natural Instructions folder: every task, every example)
    holds, read with no setting of the server's config."""
    from data_prep.loaders import load_examples

    return len(load_examples(str(data_path)))


def _histogram(examples) -> dict[str, int]:
    from collections import Counter

    return dict(sorted(Counter(e.category or "other" for e in examples).items()))


def expected_start(cfg: Config, state, client_id: int, round_idx: int) -> ClientStart:
    """The start ``client_id`` gets for ``round_idx`` from the round's full-rank global ``state`` by the
    server's own rule (``Server.client_start``): the strategy's cut of the global factors to the client's
    rank and scale, the dense modules, the strategy's extras for it, then the run's download encoding
    (``comm.download``). What a site of a secure round checks its start against before it signs the round's
    statement (``fedllm.secagg.agreement``)."""
    from fedllm.aggregation.base import strategy_from_config
    from fedllm.assembly import assign_ranks, server_policy
    from fedllm.factors import lora_scale

    strategy = strategy_from_config(cfg.aggregation)
    rank = assign_ranks(cfg)[client_id]
    r = strategy.adapter_rank(rank)
    scale = lora_scale(cfg.lora.alpha_ratio * r, r, cfg.lora.use_rslora)
    start = ClientStart(
        round=round_idx,
        factors=strategy.client_factors(state, rank, scale, client_id),
        dense=dict(state.dense),
        extras=strategy.client_extras(state, client_id),
    )
    transform = server_policy(cfg).download_transform
    return transform(start) if transform is not None else start


def round_terms(config_text: str, content, state) -> tuple[int, ClientStart, ClientStart, bytes]:
    """What a secure round's statement needs of a start message and the round's full-rank ``state``, read
    under the config it carries: the client it is for, the start as sent, the start the rule gives
    (:func:`expected_start`) and the config's digest (every key: the server sends all sites one config)."""
    from fedllm.assembly import codecs
    from fedllm.config import flat_config
    from fedllm.flower.records import read_start, start_config

    _, client_id = start_config(content)
    cfg = config_from_text(config_text, "the server's resolved config")
    start = read_start(content, codecs(cfg))
    digest = hashlib.sha256(json.dumps(flat_config(cfg), sort_keys=True, default=str).encode()).digest()
    return client_id, start, expected_start(cfg, state, client_id, start.round), digest
