"""Building a federation from a config: the pieces every driver needs, each by one small function.

torchtune's recipes call small ``_setup_*`` helpers in order from one
``setup``; this module is those helpers for fedllm, and nothing else builds
these pieces. The in-process simulation (:func:`assemble`), a Flower site
(:func:`assemble_site`), the Flower ServerApp and export call them; this
module imports no driver. Bad input fails in the helpers that run before the
model loads (layout, data, benchmark).

Order: :func:`layout_for` -> :func:`load_partitions` -> :func:`benchmark_for`
-> :func:`load_model` -> :func:`tokenize_partitions` -> :func:`build_runtime` ->
:func:`build_server` (:func:`federation_on` runs the last steps on a given base and data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.prompts import TokenizedExample
from data_prep.schema import DataError, Example
from data_prep.tokenized import TokenRows, unknown_share
from eval.general import GeneralCheck
from eval.mmlu import Benchmark, load_benchmark
from eval.mmlu_data import MMLUDataError
from fedllm.aggregation import Strategy, strategy_from_config, with_server_opt
from fedllm.client import ALGORITHMS
from fedllm.client.runtime import ClientData, ClientRuntime
from fedllm.config import Config, ConfigError, settle_clip
from fedllm.factors import lora_scale
from fedllm.features import FEATURES
from fedllm.federation_data import Partitions, load_partitions, max_seq_len, prompt_template, tokenize_clients
from fedllm.model.evaluation import Generation
from fedllm.model.modeling import context_length, is_quantized, load_base
from fedllm.model.parallel import Layout, uses_deepspeed, zero_stage
from fedllm.protocol import ClientInfo, Codec, TrainExchange, derive_seed
from fedllm.server import Sampling, Server, ServerPolicy

log = logging.getLogger(__name__)

DENSE_WARNING = 5_000_000  # dense parameters per upload above which a LoRA-only federation is suggested


def layout_for(cfg: Config, accelerator, strategy: Strategy) -> Layout:
    """How this launch's processes share the run (``federation.parallel``); refuses what it cannot run."""
    ds, stage = uses_deepspeed(accelerator), zero_stage(accelerator)
    mode = cfg.federation.parallel
    if mode == "auto":
        mode = "data" if ds else "clients"
    if ds and mode == "clients":
        raise ConfigError(
            "federation.parallel = clients cannot run under DeepSpeed (it shards one model over all "
            "processes): use federation.parallel=data, or launch without a DeepSpeed config"
        )
    layout = Layout(mode, accelerator.process_index, accelerator.num_processes, ds, stage)
    if layout.data_parallel:
        n = layout.num_processes
        if cfg.client.batch_size % n:
            raise ConfigError(
                f"client.batch_size = {cfg.client.batch_size} must be a multiple of the {n} processes "
                "with federation.parallel=data (each process takes an equal share of every batch)"
            )
        if strategy.hook.local_params or strategy.hook.params_outside_model:
            raise ConfigError(
                f"aggregation.name = {strategy.name} is not supported with federation.parallel=data (or "
                "DeepSpeed): its clients train parameters outside the model (FLoRAL's routers, Fed-SB's R), "
                "which the data layout does not synchronize; use federation.parallel=clients"
            )
    if str(getattr(accelerator, "mixed_precision", "no")) == "fp16" and not ds:
        raise ConfigError(
            "mixed precision fp16 needs loss scaling, which fedllm's client loops leave to DeepSpeed: "
            "use bf16 (or no) in the accelerate config, or fp16 under a DeepSpeed config"
        )
    if ds:
        _check_deepspeed(cfg, stage)
    return layout


def _check_deepspeed(cfg: Config, stage: int) -> None:
    if ALGORITHMS[cfg.client.algorithm].changes_gradients:
        raise ConfigError(
            f"client.algorithm = {cfg.client.algorithm} changes gradients between backward and step, which a "
            "DeepSpeed engine does in one call: use client.algorithm=sft under DeepSpeed, or a plain "
            "multi-GPU launch"
        )
    if cfg.client.grad_accum != 1:
        raise ConfigError(
            "client.grad_accum must be 1 under DeepSpeed (the engine accumulates by itself): raise "
            "client.batch_size instead"
        )
    if cfg.model.quantization != "none" and stage == 3:
        raise ConfigError(
            "model.quantization cannot be combined with DeepSpeed ZeRO-3: use ZeRO-2, or a full-precision "
            "base"
        )
    if stage == 3 and cfg.eval.personalized:
        raise ConfigError(
            "eval.personalized must be false under DeepSpeed ZeRO-3 (every process must run the same forward "
            "passes): set eval.personalized=false"
        )


def assign_ranks(cfg: Config) -> list[int]:
    """Each client's LoRA rank: the configured list cycled, or draws from ``lora.rank_distribution``."""
    n = cfg.federation.num_clients
    if cfg.lora.rank_distribution:
        rng = random.Random(derive_seed(cfg.federation.seed, 17))
        ranks, probs = zip(*sorted(cfg.lora.rank_distribution.items()), strict=True)
        return [rng.choices(ranks, probs)[0] for _ in range(n)]
    return [cfg.lora.ranks[k % len(cfg.lora.ranks)] for k in range(n)]


def describe_ranks(ranks: list[int]) -> str:
    """Clients' ranks for people: the list when short, else how many clients hold each rank.

    A 1,000-client federation's list would fill the terminal and the model card.
    """
    if len(ranks) <= 16:
        return str(ranks)
    counts = Counter(ranks)
    return ", ".join(f"{r} ({counts[r]} clients)" for r in sorted(counts))


def client_infos(cfg: Config, strategy: Strategy, sizes: dict[int, int]) -> list[ClientInfo]:
    """What the server knows of each client in ``sizes`` (its example count): rank, scale and count."""
    ranks = assign_ranks(cfg)
    out = []
    for k, n in sorted(sizes.items()):
        r = strategy.adapter_rank(ranks[k])
        out.append(ClientInfo(k, ranks[k], lora_scale(cfg.lora.alpha_ratio * r, r, cfg.lora.use_rslora), n))
    return out


def benchmark_for(cfg: Config) -> Benchmark | None:
    """The benchmark a run scores (see ``eval.benchmark``), loaded now so bad data fails before the model.

    With ``auto`` and a user's own data the built-in benchmark would measure
    nothing the data teaches, so MMLU is used when a copy can be loaded and
    held-out loss alone otherwise (said once, with the fix).
    """
    e = cfg.eval
    if e.benchmark == "none":
        return None
    if e.benchmark != "auto":
        return load_benchmark(e.benchmark, e.shots, e.subjects or None, e.limit, e.overflow)
    if cfg.data.dataset in ("builtin", "testbed"):
        return load_benchmark(cfg.data.dataset, e.shots, e.subjects or None, e.limit, e.overflow)
    try:
        return load_benchmark("cais/mmlu", e.shots, e.subjects or None, e.limit, e.overflow)
    except MMLUDataError as err:
        log.warning(
            "eval.benchmark = auto: MMLU cannot be loaded (%s); evaluating held-out loss only. Set "
            "eval.benchmark to a local MMLU copy (or none to silence this)",
            str(err).split(":")[0],
        )
        return None


def load_model(cfg: Config, accelerator, path: str | None = None):
    """The base and its tokenizer on the launch's device (the built-in base is built once, by the main
    process); ``path``: a local copy of ``model.name`` (a site's own folder) to load instead."""
    model_cfg = dataclasses.replace(cfg.model, name=path) if path else cfg.model
    with accelerator.main_process_first():
        return load_base(model_cfg, accelerator.device)


def build_runtime(
    cfg: Config,
    strategy: Strategy,
    layout: Layout,
    accelerator,
    model,
    tokenizer,
    ranks: list[int],
    **kw: Any,
) -> ClientRuntime:
    """A client runtime on ``model`` with one adapter per adapter rank in ``ranks`` (FLoRAL: C * r)."""
    # merged updates cannot be written into 4/8-bit weights (or ZeRO-3 shards): keep them as a frozen adapter
    residual = strategy.merges_into_base and (is_quantized(model) or layout.zero_stage == 3)
    return ClientRuntime(
        model=model,
        tokenizer=tokenizer,
        ranks=ranks,
        lora_cfg=cfg.lora,
        client_cfg=cfg.client,
        seed=cfg.federation.seed,
        rounds=cfg.federation.rounds,
        layout=layout,
        accelerator=accelerator,
        hook=strategy.client_hook(),
        residual_merges=residual,
        client_timeout_s=cfg.federation.client_timeout_s,
        transforms=[t for f in FEATURES for t in f.upload_transforms(getattr(cfg, f.section), cfg)],
        **kw,
    )


def token_budget(cfg: Config, model) -> tuple[str, int]:
    """The prompt template and the maximum tokens per example for this config on this model."""
    return prompt_template(cfg), max_seq_len(cfg, context_length(model))


ClientTokens = tuple[Sequence[TokenizedExample], Sequence[TokenizedExample]]  # a client's (train, test)


def tokenize_partitions(
    cfg: Config, parts: Partitions, model, tokenizer, accelerator=None, clients: bool = True
) -> tuple[list[ClientTokens], Sequence[TokenizedExample]]:
    """Every client's (train, test) token rows and the held-out evaluation split, for this base: one batched
    tokenization cached on disk, written by the main process while the others wait, then read by all
    (``clients=False``: only the held-out split, for a server)."""
    template, max_len = token_budget(cfg, model)
    groups = (parts.clients, parts.test_sizes) if clients else ([], [])
    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        data, held_out = tokenize_clients(
            *groups, tokenizer, template, max_len, extra=parts.eval_examples, truncation=cfg.data.truncation
        )
    check_unknown_tokens(cfg, tokenizer, [*[t for pair in data for t in pair], held_out])
    return list(data), held_out


UNKNOWN_WARNING = 0.02


def check_unknown_tokens(cfg: Config, tokenizer, rows: list) -> None:
    """Refuse (above ``data.max_unknown_share``) or warn (above 2%) when the base's tokenizer cannot read
    the data: a loss that falls on ``<unk>`` tokens looks like learning and is not."""
    unk_id = getattr(tokenizer, "unk_token_id", None)
    tables = {id(r.table): r.table for r in rows if isinstance(r, TokenRows)}
    if unk_id is None or not tables:
        return
    unknown, total = unknown_share(tables.values(), unk_id)
    share = unknown / total if total else 0.0
    what = (
        f"{share:.1%} of the response tokens trained on ({unknown:,} of {total:,}) are unknown to the "
        f"tokenizer of model.name={cfg.model.name!r}"
    )
    hint = (
        "the built-in base knows only the built-in data's words: point model.name at a real model folder "
        "(or Hub id)"
        if cfg.model.name.startswith("builtin")
        else "check that model.name is the model this data is meant for"
    )
    if share > cfg.data.max_unknown_share:
        raise DataError(f"data.dataset: {what}; {hint}, or raise data.max_unknown_share to train anyway")
    if share > UNKNOWN_WARNING:
        log.warning("%s; %s", what, hint)


def check_client_batches(cfg: Config, layout: Layout, data: list[ClientTokens]) -> None:
    if not layout.data_parallel:
        return
    for k, (train, _) in enumerate(data):
        if len(train) < cfg.client.batch_size:
            raise ValueError(
                f"client {k} has {len(train)} training examples, fewer than client.batch_size = "
                f"{cfg.client.batch_size}, which federation.parallel=data splits over {layout.num_processes} "
                "processes: raise data.min_examples_per_client or lower client.batch_size"
            )


def train_exchange(cfg: Config) -> TrainExchange | None:
    """The way a feature has the driver gather each round's uploads (secure aggregation's sum), or None: each
    update as it is (see ``Feature.train_exchange``)."""
    for feature in FEATURES:
        exchange = feature.train_exchange(getattr(cfg, feature.section), cfg)
        if exchange is not None:
            return exchange
    return None


def codecs(cfg: Config) -> list[Codec]:
    """How the run's features change what travels on a real wire, in the order they encode (a driver
    that serializes decodes in reverse; see ``Feature.codec``)."""
    out = [feature.codec(getattr(cfg, feature.section), cfg) for feature in FEATURES]
    return [c for c in out if c is not None]


def server_policy(cfg: Config) -> ServerPolicy:
    """The server's policy under the run's features (``Feature.server_policy``): what a site may also ask,
    e.g. whether the weighting needs its example count."""
    fed = cfg.federation
    policy = ServerPolicy(
        min_clients=fed.min_clients,
        clip_norm_ratio=settle_clip(cfg, organizations=False),  # a driver of other sites settled it first
        client_timeout_s=fed.client_timeout_s,
        weighting=fed.weighting,
        max_client_weight=fed.max_client_weight,
    )
    for feature in FEATURES:
        policy = feature.server_policy(policy, getattr(cfg, feature.section), cfg)
    return policy


def site_figures_hidden(cfg: Config) -> str:
    """Why the run's sites keep their own figures (``Feature.hides_site_figures``); empty: they send them."""
    return "; ".join(w for f in FEATURES if (w := f.hides_site_figures(getattr(cfg, f.section), cfg)))


def build_server(cfg: Config, strategy: Strategy, infos: list[ClientInfo], runtime: ClientRuntime) -> Server:
    """The server over ``infos``, starting from the base's dense modules (warns when they are large)."""
    fed = cfg.federation
    dense = runtime.initial_dense()
    n_dense = sum(t.numel() for t in dense.values())
    if n_dense > DENSE_WARNING:
        log.warning(
            "lora.trainable_modules %s add %.1fM parameters to every upload and download; set "
            "lora.trainable_modules=[] for a LoRA-only federation",
            cfg.lora.trainable_modules,
            n_dense / 1e6,
        )
    policy = server_policy(cfg)
    sampling = Sampling(fed.seed, fed.clients_per_round, fed.client_fraction, fed.dropout)
    for feature in FEATURES:  # each cross-cutting feature hooks the server from outside
        options = getattr(cfg, feature.section)
        strategy = feature.wrap_strategy(strategy, options, cfg)
        sampling = feature.sampling(sampling, options, cfg)
    # outermost: a server optimizer steps with what the features release (under central DP, the noised
    # aggregate: post-processing)
    strategy = with_server_opt(strategy, cfg.aggregation)
    return Server(
        strategy=strategy,
        clients=infos,
        modules=runtime.module_shapes(),
        algorithm=ALGORITHMS[cfg.client.algorithm].server_half.from_config(cfg.client),
        sampling=sampling,
        dense=dense,
        policy=policy,
    )


@dataclass
class Federation:
    """Everything a simulated run needs: the server, one runtime hosting every client, data, benchmark."""

    cfg: Config
    strategy: Strategy
    layout: Layout
    runtime: ClientRuntime
    server: Server
    clients: list[ClientData]
    eval_data: Sequence[TokenizedExample]
    benchmark: Benchmark | None
    partition_stats: list[dict]
    generation: Generation | None = None
    general: GeneralCheck | None = None


def assemble(cfg: Config, accelerator, progress: bool = False) -> Federation:
    """A simulated federation: every client of ``cfg`` on one base in this process (see module docstring)."""
    layout_for(cfg, accelerator, strategy_from_config(cfg.aggregation))  # refuse a bad launch before the data
    parts = load_partitions(cfg)
    benchmark = benchmark_for(cfg)
    model, tokenizer = load_model(cfg, accelerator)
    data, eval_data = tokenize_partitions(cfg, parts, model, tokenizer, accelerator)
    fed = federation_on(
        cfg,
        accelerator,
        model,
        tokenizer,
        data,
        eval_data=eval_data,
        benchmark=benchmark,
        stats=parts.stats,
        progress=progress,
    )
    fed.generation = generation_for(cfg, parts, model)
    fed.general = general_for(cfg, model)
    return fed


def generation_for(cfg: Config, parts: Partitions, model) -> Generation | None:
    """The Rouge-L evaluation of ``parts.generation`` (``eval.generate_size``): the run's template, prompts
    cut to leave ``eval.max_new_tokens`` of ``data.max_seq_len``."""
    if not parts.generation:
        return None
    template, max_len = token_budget(cfg, model)
    room = max_len - cfg.eval.max_new_tokens
    if room < 8:
        raise ValueError(
            f"eval.max_new_tokens = {cfg.eval.max_new_tokens} leaves {room} prompt tokens of "
            f"data.max_seq_len = {max_len}: lower eval.max_new_tokens or raise data.max_seq_len"
        )
    return Generation(parts.generation, template, cfg.eval.max_new_tokens, room)


def general_for(cfg: Config, model) -> GeneralCheck | None:
    """The general-prompt check (``eval.general_prompts``), answered with the run's template and length."""
    source = cfg.eval.general_prompts
    if not source:
        return None
    from eval.general import GENERAL_PROMPTS
    from fedllm.model.generate import read_prompts

    examples = (
        [Example(p, "", "") for p in GENERAL_PROMPTS] if source == "builtin" else read_prompts([], source)
    )
    template, max_len = token_budget(cfg, model)
    return GeneralCheck(
        examples, template, cfg.eval.max_new_tokens, max(8, max_len - cfg.eval.max_new_tokens)
    )


def federation_on(
    cfg: Config,
    accelerator,
    model,
    tokenizer,
    data: list[ClientTokens],
    *,
    eval_data: Sequence[TokenizedExample] | None = None,
    benchmark: Benchmark | None = None,
    stats: list[dict] | None = None,
    progress: bool = False,
) -> Federation:
    """A simulated federation on a loaded base and every client's (train, test) tokens, e.g. an in-memory
    model with synthetic data (``scripts/bench_real_shapes.py``); :func:`assemble` builds it from a config."""
    strategy = strategy_from_config(cfg.aggregation)
    layout = layout_for(cfg, accelerator, strategy)
    check_client_batches(cfg, layout, data)
    infos = client_infos(cfg, strategy, {k: len(train) for k, (train, _) in enumerate(data)})
    ranks = [strategy.adapter_rank(i.rank) for i in infos]
    runtime = build_runtime(cfg, strategy, layout, accelerator, model, tokenizer, ranks, progress=progress)
    clients = [
        ClientData(i.client_id, strategy.adapter_rank(i.rank), i.scale, train, test)
        for i, (train, test) in zip(infos, data, strict=True)
    ]
    stats = stats or [{"client": c.client_id} for c in clients]
    return Federation(
        cfg=cfg,
        strategy=strategy,
        layout=layout,
        runtime=runtime,
        server=build_server(cfg, strategy, infos, runtime),
        clients=clients,
        eval_data=eval_data or [],
        benchmark=benchmark,
        partition_stats=[
            {**s, "rank": c.rank, "train": len(c.train), "test": len(c.test)}
            for s, c in zip(stats, clients, strict=True)
        ],
    )


def assemble_site(
    cfg: Config, client_id: int, examples: list, n_test: int, accelerator, model_path: str | None = None
) -> tuple[ClientRuntime, ClientData]:
    """One real site (Flower): a runtime with the one adapter of this client's rank, and its own data.

    ``examples``: the site's own records, its test share first (``n_test``);
    ``model_path``: the site's local copy of the base (default ``model.name``).
    """
    strategy = strategy_from_config(cfg.aggregation)
    layout = layout_for(cfg, accelerator, strategy)
    model, tokenizer = load_model(cfg, accelerator, model_path)
    info = client_infos(cfg, strategy, {client_id: 0})[0]
    rank = strategy.adapter_rank(info.rank)
    runtime = build_runtime(cfg, strategy, layout, accelerator, model, tokenizer, [rank])
    template, max_len = token_budget(cfg, runtime.model)
    with accelerator.main_process_first():
        [(train, test)], _ = tokenize_clients(
            [examples], [n_test], tokenizer, template, max_len, [client_id], truncation=cfg.data.truncation
        )
    return runtime, ClientData(client_id, rank, info.scale, train, test)


def restore(
    server: Server, runtime: ClientRuntime, clients: list[ClientData], run_dir: Path, store=None
) -> dict | None:
    """Bring a federation to the newest intact checkpoint of ``run_dir``: the server, the state of ``clients``
    (the ones this process holds: into ``store``, a :class:`~fedllm.client.store.ClientStore`, when the
    driver keeps client state on disk), and the merged base.

    Returns the checkpoint's metadata (None when the run has none yet); a
    damaged newer checkpoint is passed over, and a checkpoint of another
    strategy is refused.
    """
    from fedllm import files
    from fedllm.run import checkpoint as ckpt

    found = ckpt.load_latest(run_dir)
    if found is None:
        return None
    path, tensors, meta = found
    if meta["strategy"] != server.strategy.name:
        raise files.CheckpointError(
            f"{path}: written by strategy {meta['strategy']!r}, config says {server.strategy.name!r}"
        )
    server.load_state_dict(tensors, meta)
    if store is not None and "client_state" in meta:
        store.restore(meta)
    else:  # the state in the checkpoint itself (a checkpoint written before the client store)
        for client in clients:
            client.state = ckpt.client_state(tensors, client.client_id)
            if store is not None:
                store.trained(client.client_id, meta["round"], store.save(client, meta["round"]))
                store.release(client)
    runtime.restore_base(server.state.residual, meta["round"])
    return meta
