"""Secure aggregation (``flower.secure_aggregation``, ``fedllm/secagg``): the secure round's sum gives each
linear strategy's plain round; Flower's SecAgg+ sums within the quantization bound, hides each site's vector
and recovers a site that drops after sharing its keys; distributed DP equals central DP and tops up the noise
of sites that drop; the refusals. The Flower runs (in-process grid, Simulation Engine) are ``slow``."""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import math
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from fedllm.config import ConfigError, load_config
from fedllm.privacy.strategy import DPStrategy
from fedllm.protocol import ClientInfo, ClientUpdate, UploadContext
from fedllm.secagg.bounds import quantization_error
from fedllm.secagg.summand import SecureSummand, layout, summed_update, survivors_weights, to_vector
from fedllm.server import Server, ServerPolicy
from tests.conftest import tiny_overrides
from tests.flower_grid import Federation
from tests.test_trust import COUNTS, MODULES, RANKS, honest, make_server

Q = 2**22


def products(server) -> dict[str, torch.Tensor]:
    """The global model's update of each module and dense module, and the raw global factors where they are
    the strategy's parameters (FedSVD's are re-factored: its SVD gauge is compared through the products)."""
    out = {k: f.folded().B @ f.folded().A for k, f in server.strategy.global_adapter(server.state).items()}
    if server.strategy.name != "fedsvd":
        for k, f in server.state.factors.items():
            out[f"{k}.A"], out[f"{k}.B"] = f.A, f.B
    return {**out, **{f"dense.{k}": t for k, t in server.state.dense.items()}}


def site_vector(server, plan, k: int, u: ClientUpdate, lay, clip: float = 0.0) -> np.ndarray:
    """What site k's masked vector carries: its upload as it leaves (the hook's outgoing factors), its change
    padded into the round's layout by the site's own transform."""
    sent = copy.deepcopy(u)
    sent.factors = server.hook.for_round(plan.round).outgoing(sent.factors)
    start = plan.starts[k]
    ctx = UploadContext(start, server.reference(plan.round, k, start), {}, ())
    return to_vector(SecureSummand(clip).apply(sent, ctx).attachments["secagg"], lay)


def secure_round(server, plan, updates: dict[int, ClientUpdate], distributed=False, clip=0.0, sampled=None):
    """The round as the server gets it under SecAgg+ (the exact weighted mean, without the protocol's
    quantization, which the protocol tests bound)."""
    lay = layout(server, plan.round)
    clients = sorted(updates)
    vecs = [site_vector(server, plan, k, updates[k], lay, clip) for k in clients]
    weights = survivors_weights(server, clients, float(max(COUNTS)), Q)
    mean = sum(w * v for w, v in zip(weights, vecs, strict=True))
    summed = summed_update(server, plan, clients, mean, lay, weights, distributed)
    summed.failures = {k: "left" for k in plan.active if k not in updates}
    return server.finish_round(plan, summed)


@pytest.mark.parametrize("strategy", ["fedit", "ffa", "fedsvd", "rolora", "fedsa"])
@pytest.mark.parametrize("drop", [None, 2], ids=["all", "one-dropped"])
def test_the_secure_sum_gives_each_linear_strategys_plain_round(strategy, drop):
    """Mixed ranks (4, 4, 8, 8), example weights, three rounds (RoLoRA: B, A, B): the strategy's global model
    from the sum equals its plain round on the same updates (FedSVD's re-factoring included)."""
    plain, secure = make_server(strategy, clip_norm_ratio=0), make_server(strategy, clip_norm_ratio=0)
    for r in (1, 2, 3):
        plan_p, plan_s = plain.plan_round(r), secure.plan_round(r)
        updates = {k: honest(plain, plan_p, k, size=0.05, seed=r) for k in plan_p.active if k != drop}
        report = plain.finish_round(plan_p, {**{k: "no reply" for k in plan_p.active}, **updates})
        assert report.row["n_updates"] == len(updates)
        got = secure_round(secure, plan_s, updates)
        assert got.row["n_updates"] == len(updates) and not got.row["skipped"]
        want, have = products(plain), products(secure)
        for key in want:
            assert_close(have[key], want[key], rtol=1e-5, atol=1e-6)
    assert secure.last_aggregated == plain.last_aggregated  # the same clients' updates were used


@pytest.mark.parametrize("strategy", ["fedit", "ffa"])
def test_the_secure_sum_under_encoded_downloads_is_the_plain_round(strategy):
    """comm.download=int8: each site starts from the decoded download and measures its change from it; the
    secure sum adds back the same decoded starts (factors and dense modules), so it equals the plain round on
    the same updates."""
    from fedllm.transport import QuantizedDownload

    down = QuantizedDownload("int8", 4)
    plain = make_server(strategy, clip_norm_ratio=0, download_transform=down)
    secure = make_server(strategy, clip_norm_ratio=0, download_transform=down)
    for r in (1, 2, 3):
        plan_p, plan_s = plain.plan_round(r), secure.plan_round(r)
        updates = {k: honest(plain, plan_p, k, size=0.05, seed=r) for k in plan_p.active}
        plain.finish_round(plan_p, updates)
        if r > 1:  # the encoding is real: what the sites start from is not the server's dense state
            name = "model.embed_tokens.weight"
            assert not torch.equal(plan_s.starts[0].dense[name], secure.state.dense[name])
        secure_round(secure, plan_s, updates)
        want, have = products(plain), products(secure)
        for key in want:
            assert_close(have[key], want[key], rtol=1e-5, atol=1e-6)


def rank_scaled_server(strategy: str, **policy) -> Server:
    """make_server's federation with each client's scale alpha / r_k (ranks 4, 4, 8, 8): the site's folding of
    its own scale into B must match the server's."""
    from fedllm.aggregation import STRATEGIES

    policy.setdefault("clip_norm_ratio", 0.0)
    return Server(
        strategy=STRATEGIES[strategy](),
        clients=[ClientInfo(k, r, 16.0 / r, n) for k, (r, n) in enumerate(zip(RANKS, COUNTS, strict=True))],
        modules=MODULES,
        dense={"model.embed_tokens.weight": torch.zeros(7, 3)},
        policy=ServerPolicy(**policy),
    )


@pytest.mark.parametrize("strategy", ["fedit", "ffa"])
def test_each_sites_own_scale_is_folded_as_the_server_folds_it(strategy):
    plain, secure = rank_scaled_server(strategy), rank_scaled_server(strategy)
    for r in (1, 2):
        plan_p, plan_s = plain.plan_round(r), secure.plan_round(r)
        updates = {k: honest(plain, plan_p, k, size=0.05, seed=r) for k in plan_p.active}
        plain.finish_round(plan_p, updates)
        secure_round(secure, plan_s, updates)
        for key, want in products(plain).items():
            assert_close(products(secure)[key], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("server_opt", [None, "fedavgm"])
def test_what_no_finishing_site_trains_is_not_in_the_round(server_opt):
    """Two rounds of FedIT with only the rank-4 sites finishing round 2 (of ranks 4, 4, 8, 8): the protocol's
    mean carries quantization dust (here 1e-9) in the rank-8 rows, but the round's update is at the finishing
    sites' largest rank, as the plain round's is: the global state has the plain state's shape and values,
    and a server optimizer (FedAvgM) steps the same components."""
    from fedllm.aggregation import STRATEGIES, with_server_opt
    from fedllm.config import load_config as load

    def server():
        s = make_server("fedit", clip_norm_ratio=0)
        if server_opt:
            agg = load(
                None, ["aggregation.server_opt=fedavgm", "aggregation.fedavgm.momentum=0.5"]
            ).aggregation
            s.strategy = with_server_opt(STRATEGIES["fedit"](), agg)
        return s

    plain, secure = server(), server()
    for r, finishing in ((1, (0, 1, 2, 3)), (2, (0, 1))):
        plan_p, plan_s = plain.plan_round(r), secure.plan_round(r)
        updates = {k: honest(plain, plan_p, k, size=0.05, seed=r) for k in finishing}
        plain.finish_round(plan_p, {**{k: "no reply" for k in plan_p.active}, **updates})
        lay = layout(secure, r)
        vecs = [site_vector(secure, plan_s, k, updates[k], lay) for k in finishing]
        weights = survivors_weights(secure, list(finishing), float(max(COUNTS)), Q)
        mean = sum(w * v for w, v in zip(weights, vecs, strict=True))
        mean = mean + 1e-9 * np.random.default_rng(r).standard_normal(mean.shape)
        secure.finish_round(plan_s, summed_update(secure, plan_s, list(finishing), mean, lay, weights, False))
    for key, f in secure.state.factors.items():
        g = plain.state.factors[key]
        assert f.A.shape == g.A.shape and f.B.shape == g.B.shape
        assert_close(f.A, g.A, rtol=1e-5, atol=1e-7)
        assert_close(f.B, g.B, rtol=1e-5, atol=1e-7)


def test_a_sum_that_is_not_finite_or_holds_too_few_sites_skips_the_round():
    server = make_server("fedit", clip_norm_ratio=0, min_clients=3)
    plan = server.plan_round(1)
    updates = {k: honest(server, plan, k) for k in plan.active}
    lay = layout(server, 1)
    vecs = {k: site_vector(server, plan, k, updates[k], lay) for k in plan.active}
    before = copy.deepcopy(server.state.factors)
    for clients, poison in (([0, 1, 2, 3], True), ([0, 1], False)):
        weights = survivors_weights(server, clients, float(max(COUNTS)), Q)
        mean = sum(w * vecs[k] for w, k in zip(weights, clients, strict=True))
        summed = summed_update(server, plan, clients, mean, lay, weights, False)
        if poison:
            next(iter(summed.update.factors.values())).B[0, 0] = float("nan")
        report = server.finish_round(plan, summed)
        assert report.row["skipped"]
        assert all(torch.equal(server.state.factors[k].B, before[k].B) for k in before)
        assert ("sum" in report.row["failed"]) == poison


def test_distributed_dp_noise_is_each_sites_share_on_every_coordinate(tmp_path):
    """privacy.mode=distributed: the DP transform only clips (it adds no noise at the site's own rank); the
    site's vector gets N(0, (sigma C)^2 / m) on every coordinate of the layout, its rank's padding included,
    so that the sum of the m sites' shares is central DP's noise everywhere."""
    from fedllm.privacy import PRIVACY
    from fedllm.secagg.bounds import noise_std
    from fedllm.secagg.summand import site_vector as pad_and_noise

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            "federation.num_clients=16",
            "federation.clients_per_round=9",
            "flower.secure_aggregation=true",
            "privacy.mode=distributed",
            "privacy.noise_multiplier=2.0",
            "privacy.clip_norm=0.5",
        ),
    )
    (dp_transform,) = PRIVACY.upload_transforms(cfg.privacy, cfg)
    assert dp_transform.noise_std == 0.0 and dp_transform.clip_norm == 0.5
    assert noise_std(cfg) == pytest.approx(2.0 * 0.5 / 3.0)  # sigma C / sqrt(9)
    lay = [("A.m", (8, 50)), ("B.m", (40, 8))]
    changes = {"A.m": torch.zeros(4, 50), "B.m": torch.zeros(40, 4)}  # a rank-4 site, no change
    vec = pad_and_noise(changes, lay, noise_std(cfg), torch.Generator().manual_seed(0))
    padded = np.concatenate([vec[200:400], vec[400:].reshape(40, 8)[:, 4:].ravel()])  # rows/cols 4..7
    assert padded.std() == pytest.approx(1 / 3, rel=0.1) and vec[:200].std() == pytest.approx(1 / 3, rel=0.15)


@pytest.mark.parametrize("total", ["one", "a third"])
def test_a_site_that_misstates_its_weight_has_the_round_refused(secure_cfg, total, monkeypatch):
    """A hostile site masks a weight of its choosing (Flower takes it from the site's own reply): here one
    that drives the protocol's total weight near 1, which multiplies the mean ~2^28-fold. The mean then
    leaves the protocol's range, which no weighted mean of in-range values can, and the server refuses the
    round."""
    from fedllm.secagg.bounds import clipping_range, quantization_bits
    from fedllm.secagg.flower import in_range

    vectors = clipped_vectors(5, 300, seed=6)
    field, q = 2**secure_cfg.secagg.modulus_bits, 2 ** quantization_bits(secure_cfg)
    honest_mean, _, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors})
    target = 1 if total == "one" else 5 * q // 3  # the mean x 2^29 / 5, or x 3 (every value still in range)
    bound, step = clipping_range(secure_cfg), 2 * clipping_range(secure_cfg) / q
    norm_bound = 1.0 + math.sqrt(300) * step  # the clip, plus the quantization's error over the values
    assert np.array_equal(in_range(honest_mean, bound, step, norm_bound), honest_mean)
    masking_lies(monkeypatch, 101, lambda a: [(a[0] + target - 5 * q) % field, *a[1:]])  # total 5q -> target
    mean, _, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors})
    if total == "one":
        assert np.abs(mean).max() > 1e3 * bound
    else:  # in range: only the norm shows it
        assert np.abs(mean).max() < bound and np.linalg.norm(mean) > 1.2
    with pytest.raises(ValueError, match="range|norm"):
        in_range(mean, bound, step, norm_bound)


def test_a_wrong_strategy_would_show_the_sum_is_not_each_update():
    """Guard of the test above: FLoRA stacks each client's factors, so the secure sum's one update does not
    give its round (the config refuses it; this shows why the refusal is needed)."""
    plain, secure = make_server("flora", clip_norm_ratio=0), make_server("flora", clip_norm_ratio=0)
    plan_p, plan_s = plain.plan_round(1), secure.plan_round(1)
    updates = {k: honest(plain, plan_p, k, size=0.05) for k in plan_p.active}
    plain.finish_round(plan_p, updates)
    secure_round(secure, plan_s, updates)
    merged_p, merged_s = plain.state.residual, secure.state.residual
    assert max(float((merged_p[k].delta() - merged_s[k].delta()).abs().max()) for k in merged_p) > 1e-4


def dp(inner_name: str, mode: str, sigma: float, seed: int = 0):
    from fedllm.aggregation import STRATEGIES

    return DPStrategy(
        STRATEGIES[inner_name](),
        mode=mode,
        clip_norm=0.5,
        noise_multiplier=sigma,
        noise_seed=seed,
        epsilon_after=lambda rounds: 0.0,
        summary=lambda rounds: {"privacy": {}, "metrics": {}, "guarantees": []},
    )


@pytest.mark.parametrize("strategy", ["fedit", "ffa"])
@pytest.mark.parametrize("dropped", [(1,), (2, 3)], ids=["a-rank-4", "both-rank-8"])
def test_distributed_dp_without_noise_is_central_dp_and_tops_up_a_dropped_sites_share(strategy, dropped):
    """sigma = 0: the secure sum of clipped changes gives central DP's round (clip 0.5, uniform weights over
    the 4 sampled, one site dropped); sigma > 0: what the server adds is the dropped site's share,
    N(0, (sigma C)^2 / m) on the sum, so (sigma C / m) sqrt(1/m) on the average."""
    central = make_server(dp(strategy, "central", 0.0), clip_norm_ratio=0, weighting="uniform")
    dist = make_server(dp(strategy, "distributed", 0.0), clip_norm_ratio=0, weighting="uniform")
    noisy = make_server(dp(strategy, "distributed", 3.0), clip_norm_ratio=0, weighting="uniform")
    plan_c, plan_d, plan_n = central.plan_round(1), dist.plan_round(1), noisy.plan_round(1)
    updates = {k: honest(central, plan_c, k, size=0.3) for k in plan_c.active if k not in dropped}
    central.finish_round(plan_c, {**{k: "no reply" for k in plan_c.active}, **updates})
    report = secure_round(dist, plan_d, updates, distributed=True, clip=0.5)
    assert report.row["agg_dp_server_noise_share"] == pytest.approx(len(dropped) / 4)
    for key, want in products(central).items():
        assert_close(products(dist)[key], want, rtol=1e-5, atol=1e-6)
    secure_round(noisy, plan_n, updates, distributed=True, clip=0.5)
    moved = torch.cat(
        [(noisy.state.factors[k].B - dist.state.factors[k].B).flatten() for k in dist.state.factors]
    )
    want = 3.0 * 0.5 * math.sqrt(len(dropped) / 4) / 4
    assert float(moved.std()) == pytest.approx(want, rel=0.25)  # 96 values of B


def test_distributed_dps_epsilon_against_the_server_counts_only_the_sites_noise_and_no_amplification():
    """Three rounds of 4 sampled sites at sigma 2, the second with one site dropped: the epsilon against the
    server is dp-accounting's unamplified Gaussian composed over every round with each round's finishing
    sites' noise (sigma sqrt(n / m): the server's own top-up protects no one from it), larger than without
    the dropout, and far above the model observers' amplified number (8 clients, 4 a round)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from fedllm.privacy import against_server, spent

    sigma, delta = 2.0, 1e-5
    cfg = SimpleNamespace(
        privacy=SimpleNamespace(mode="distributed", delta=delta, noise_multiplier=sigma, sampling="secret"),
        federation=SimpleNamespace(num_clients=8, clients_per_round=4, client_fraction=0.0, seed=0),
    )
    strategy = dp("fedit", "distributed", sigma)
    strategy.against_server = against_server(cfg)
    server = make_server(strategy, clip_norm_ratio=0, weighting="uniform")
    finishing = {1: (0, 1, 2, 3), 2: (0, 1, 2), 3: (0, 1, 2, 3)}
    for r, sites in finishing.items():
        plan = server.plan_round(r)
        updates = {k: honest(server, plan, k, size=0.3) for k in sites}
        report = secure_round(server, plan, updates, distributed=True, clip=0.5)
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for sites in finishing.values():  # sensitivity 2C: the multiplier over 2
        accountant.compose(dp_accounting.GaussianDpEvent(sigma * math.sqrt(len(sites) / 4) / 2))
    want = accountant.get_epsilon(delta)
    assert report.row["epsilon_server"] == pytest.approx(want, rel=1e-6)
    no_dropout = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    no_dropout.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / 2), 3))
    assert want > no_dropout.get_epsilon(delta)
    assert want > spent(cfg, 3)  # the amplified central number holds only against the released models
    summary = strategy.run_summary(3)
    assert summary["privacy"]["against_server"]["epsilon"] == pytest.approx(want, rel=1e-6)
    assert any("against the server itself" in line for line in summary["guarantees"])


# ------------------------------------------------------------------ Flower's protocol on plain vectors
@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """What Flower sets in a ServerApp's process (a Message names its run and node from it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


class VectorGrid:
    """A Grid that hands Flower's messages to a ClientApp in this process (real Messages, copied as the wire
    copies them): ``contexts`` by node; ``dead_at``: node -> the SecAgg+ stage at which it vanishes;
    ``received``: what the server got back, with the stage of each (None: not a protocol message)."""

    def __init__(self, app, contexts: dict, dead_at=None):
        self.app, self.contexts, self.ids, self.dead_at = (
            app,
            contexts,
            itertools.count(1),
            dict(dead_at or {}),
        )
        self.received: list[tuple[int, str | None, object]] = []
        self.run = SimpleNamespace(run_id=1)

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=b"") for n in self.contexts]

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Error, Message
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{next(self.ids)}"
            m = copy.deepcopy(m)
            node = m.metadata.dst_node_id
            records = m.content.config_records
            stage = records[RECORD_KEY_CONFIGS]["stage"] if RECORD_KEY_CONFIGS in records else None
            if stage is not None and self.dead_at.get(node) == stage:
                self.contexts.pop(node, None)
            if node not in self.contexts:
                continue  # no reply: the node is gone
            try:
                reply = self.app(m, self.contexts[node])
            except Exception as e:  # the SuperNode's error reply
                reply = Message(Error(code=0, reason=repr(e)), reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = node
            if not reply.has_error():
                self.received.append((node, stage, copy.deepcopy(reply.content)))
            out.append(reply)
        return out


def bare_contexts(nodes, node_config=None, colluders: int = 0) -> dict:
    """Each node's context; ``node_config``: one for every node, or (a callable) each node's own, over the
    colluders the site tolerates (``secagg-colluders``)."""
    from flwr.app import Context, RecordDict

    def own(n):
        mine = node_config(n) if callable(node_config) else node_config or {}
        return {"secagg-colluders": str(colluders), **mine}

    return {
        n: Context(run_id=1, node_id=n, node_config=own(n), state=RecordDict(), run_config={}) for n in nodes
    }


def masking_lies(monkeypatch, node: int, edit) -> None:
    """From now on ``node`` edits the arrays it masks (``edit(arrays) -> arrays``: the weight first, then
    the values, as integers of the field) after Flower's mod made them: a hostile site."""
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    original = VectorGrid.send_and_receive

    def lying(self, messages, timeout=None):
        replies = original(self, messages, timeout)
        for reply in replies:
            config = {} if reply.has_error() else reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
            if reply.metadata.src_node_id == node and Key.MASKED_PARAMETERS in config:
                arrays = edit([bytes_to_ndarray(b) for b in config[Key.MASKED_PARAMETERS]])
                config[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in arrays]
        return replies

    monkeypatch.setattr(VectorGrid, "send_and_receive", lying)


class StateSites:
    """fedllm's site admission on plain vectors: each node a site of the run's config (client = its index
    in the round), its state folder under ``root`` (kept from one Flower run to the next, as a SuperNode's
    state-dir is), so the real :func:`fedllm.secagg.flower.admitted` decides whether it trains."""

    def __init__(self, root, nodes: list[int]) -> None:
        self.root, self.index = root, {n: k for k, n in enumerate(nodes)}

    def site(self, context, config_text):
        from fedllm.config import config_from_text

        node = context.node_id
        return SimpleNamespace(
            cfg=config_from_text(config_text),
            client_id=self.index[node],
            pinned=False,
            codecs=[],
            state_dir=self.root / f"node-{node}",
        )


def vector_app(
    vectors: dict[int, np.ndarray], weights: dict[int, int], sites: StateSites | None = None, scale=None
):  # fmt: skip
    """A ClientApp of fedllm's mod whose training step replies a node's fixed vector (times ``scale(site,
    start)``: what the site's config or start makes of its training, 1 by default) once fedllm's own
    admission lets it train."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedllm.secagg.flower import secure_mod

    app = ClientApp()

    from fedllm.flower.site import round_terms

    given = SimpleNamespace(round_terms=round_terms)  # what the ClientApp gives the mod

    @app.train(mods=[secure_mod(given)])
    def train(msg, ctx):  # only reached through the mod's training stage
        raise AssertionError("a secure message reached the plain handler")

    import fedllm.secagg.flower as sf

    def fake_train(msg, ctx, _=None):
        n = ctx.node_id
        # the site's own admission first: the setup against the config, once a round
        admitted = sf.admitted(msg, ctx, sites)
        factor = 1.0 if scale is None or admitted is None else scale(admitted[0], admitted[1])
        return Message(
            RecordDict(
                {
                    "fitres.parameters": ArrayRecord([vectors[n] * factor]),
                    "fitres.num_examples": MetricRecord({"num_examples": weights[n]}),
                    "fitres.metrics": ConfigRecord({}),
                    "fitres.status": ConfigRecord({"code": 0, "message": ""}),
                }
            ),
            reply_to=msg,
        )

    return app, sf, fake_train


def start_of(cfg, client: int, round_idx: int = 1, start=None) -> dict:
    """A collect message's FitIns config as fedllm's server sends it: the start record (``start``, default a
    first round's: a fresh adapter) with the run's config (what each site checks the setup's parameters
    against) and the layout."""
    from fedllm.config import config_to_text
    from fedllm.flower.records import start_record
    from fedllm.protocol import ClientStart
    from fedllm.secagg.flower import LAYOUT, START, _to_bytes

    start = start if start is not None else ClientStart(round=round_idx)
    record = start_record(start, config_to_text(cfg), client, [])
    return {START: _to_bytes(record), LAYOUT: "[]"}


def protocol_round(
    cfg, vectors, weights, dead_at=None, uniform=True, deviating=False, node_config=None, sites=None,
    colluders: int = 0, fitins=None, scale=None, global_state=None,
):  # fmt: skip
    """One SecAgg+ round of Flower's workflow as fedllm configures it (clipping range from the clip, the
    quantization bits from the field), on plain vectors; returns (mean, finishing nodes, grid). ``colluders``:
    what the server's config and every site tolerate; 0 (a strict majority, as the protocol's other
    mechanisms were written for) unless a test of the colluders' threshold says otherwise; the real sites'
    runs (``flower_run``) keep fedllm's defaults. ``fitins``: a node's FitIns config (default: the run's
    start, ``start_of``); ``scale``: :func:`vector_app`'s; ``global_state``: the round's full-rank state the
    server sends every site (default: none yet, a first round's)."""
    cfg = copy.deepcopy(cfg)
    cfg.secagg.colluders = colluders
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    from fedllm.secagg.flower import SecureExchange, _round_strategy

    sites = sites or StateSites(Path(tempfile.mkdtemp(prefix="fedllm-sites-")), list(vectors))
    app, sf, fake_train = vector_app(vectors, weights, sites, scale)
    grid = VectorGrid(app, bare_contexts(vectors, node_config, colluders), dead_at)
    ex = SecureExchange(cfg.secagg, cfg)
    if global_state is not None:
        from fedllm.secagg.agreement import encode_state

        ex.global_bytes = encode_state(global_state)
    ins = [
        (
            GridClientProxy(n, grid, 1),
            FitIns(
                Parameters([], ""), (fitins or {}).get(n) or start_of(cfg, sites.index[n] if sites else k)
            ),
        )
        for k, n in enumerate(vectors)
    ]
    strategy = _round_strategy(ins)
    ctx = LegacyContext(
        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}), strategy=strategy
    )
    ctx.state.config_records["config"] = ConfigRecord({"current_round": 1})
    ctx.state.array_records["parameters"] = ArrayRecord()
    max_weight = 1.0 if uniform else float(max(weights.values()))
    original = sf._secure_train
    sf._secure_train = fake_train
    try:
        ex.workflow(max_weight, 10.0, len(vectors))(grid, ctx)
    except Exception:  # the workflow's own failure on replies a deviating server provoked
        if not deviating:
            raise
        return None, [], grid
    finally:
        sf._secure_train = original
    if strategy.results is None:
        return None, [], grid
    results = strategy.results[0]
    mean = np.asarray(parameters_to_ndarrays(results[0][1].parameters)[0], dtype=np.float64)
    return mean, sorted(int(p.node_id) for p, _ in results), grid


@pytest.fixture(scope="module")
def secure_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secagg")
    return load_config(
        None,
        tiny_overrides(
            tmp / "run",
            "federation.num_clients=5",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
            "secagg.reconstruction_threshold=0.6",
        ),
    )


def clipped_vectors(n: int, d: int, seed: int, clip: float = 1.0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(n):
        v = rng.normal(size=d) * rng.uniform(0.1, 3.0)
        out[100 + k] = v * min(1.0, clip / np.linalg.norm(v))
    return out


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "example-weights"])
def test_flowers_secure_mean_is_the_true_mean_within_the_quantization_bound(secure_cfg, uniform):
    """5 sites, 2,000 values each, clipped to 1: the protocol's mean differs from the exact weighted mean by
    at most ``quantization_error`` per value (one step 2 range / 2^bits, over the mean weight), and by more
    than float error (the bound is not vacuous: the quantization is real)."""
    vectors = clipped_vectors(5, 2000, seed=1)
    counts = {n: (1 if uniform else c) for n, c in zip(vectors, (3, 50, 7, 200, 31), strict=True)}
    mean, nodes, _ = protocol_round(secure_cfg, vectors, counts, uniform=uniform)
    assert nodes == sorted(vectors)
    max_w = 1.0 if uniform else float(max(counts.values()))
    q = 2**29  # 32 bits of field for 5 sites: 29 bits each (quantization_bits = 0: the most that fits)
    ratios = [round(counts[n] / max_w * q) / q for n in vectors]
    want = sum(r * vectors[n] for r, n in zip(ratios, vectors, strict=True)) / sum(ratios)
    bound = quantization_error(secure_cfg, ratios)
    err = np.abs(mean - want).max()
    assert err <= bound, (err, bound)
    assert err > 1e-3 * bound


def test_what_the_server_receives_from_a_site_is_uncorrelated_with_its_vector(secure_cfg):
    """The masked vector each site uploads (stage collect_masked_vectors) against its true vector: the
    correlation is that of independent noise (|r| < 4 / sqrt(d)), while the unmasked mean correlates with
    the mean it is (> 0.99)."""
    vectors = clipped_vectors(5, 4000, seed=2)
    mean, _, grid = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors})
    masked = _masked(grid)
    assert sorted(masked) == sorted(vectors)
    for node, got in masked.items():
        r = np.corrcoef(got.astype(np.float64)[-4000:], vectors[node])[0, 1]
        assert abs(r) < 4 / math.sqrt(4000), (node, r)
    true_mean = sum(vectors.values()) / 5
    assert np.corrcoef(mean, true_mean)[0, 1] > 0.99


def _masked(grid) -> dict[int, np.ndarray]:
    """Each site's masked vector as the server received it (Flower's NumPy bytes of the arrays)."""
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    out = {}
    for node, stage, content in grid.received:
        if stage == "collect_masked_vectors":
            arrays = [
                bytes_to_ndarray(b) for b in content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
            ]
            out[node] = np.concatenate([a.ravel() for a in arrays])
    return out


@pytest.mark.parametrize("shift", ["quarter-range", "half-field"])
def test_a_hostile_site_moves_the_mean_by_at_most_what_the_field_lets_it(secure_cfg, monkeypatch, shift):
    """Site 101 adds an integer to every value it masks (past the quantization): a quarter of the quantization
    range, or half the field (the largest move modulo the field). The mean stays finite and moves by at most
    2 range x 2^modulus / 2^bits / sites per value; a mean the server accepts (in the range) has moved by at
    most 2 range, and the half-field shift is refused (docs/trust.md)."""
    from fedllm.secagg.bounds import clipping_range, quantization_bits
    from fedllm.secagg.flower import in_range

    vectors = clipped_vectors(5, 1000, seed=5)
    honest_mean, _, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors})
    field, q = 2**secure_cfg.secagg.modulus_bits, 2 ** quantization_bits(secure_cfg)
    added = q // 4 if shift == "quarter-range" else field // 2
    masking_lies(monkeypatch, 101, lambda a: [a[0], *((x + added) % field for x in a[1:])])  # the values
    mean, nodes, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors})
    assert nodes == sorted(vectors) and np.isfinite(mean).all()
    r = clipping_range(secure_cfg)
    moved = np.abs(mean - honest_mean).max()
    assert moved <= 2 * r * field / q / 5 + 2 * quantization_error(secure_cfg), moved
    assert moved > 10 * quantization_error(secure_cfg)  # the tampering did move it
    if shift == "half-field":
        with pytest.raises(ValueError, match="leaves the protocol's range"):
            in_range(mean, r, 2 * r / q)
    else:
        in_range(mean, r, 2 * r / q)
        assert moved <= 2 * r


def test_under_distributed_dp_a_hostile_shift_of_two_clips_is_refused(tmp_path):
    """50 sites, d = 5,000, sigma 1, clip 1: an honest mean (every site's change at the clip, all in one
    direction: the largest honest norm) passes the L2 check on 5 noise draws; a site that moves the mean by 2
    clips (100x what an honest site can: C / n) is refused on each. The bound that added the whole noise
    norm to the clip (1 + tau (sqrt(d) + 7) = 2.55) accepted that shift."""
    from fedllm.secagg.bounds import noise_std
    from fedllm.secagg.flower import SecureExchange, in_range

    n, d, clip = 50, 5000, 1.0
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            f"federation.num_clients={n}",
            "flower.secure_aggregation=true",
            "privacy.mode=distributed",
            "privacy.noise_multiplier=1.0",
            f"privacy.clip_norm={clip}",
        ),
    )
    ex = SecureExchange(cfg.secagg, cfg)
    ex.size = d
    server = SimpleNamespace(policy=SimpleNamespace(weighting="uniform"))
    per_value, norm_bound = ex.tolerances(server, list(range(n)), 1.0)
    tau = noise_std(cfg) / math.sqrt(n)
    assert norm_bound < clip + tau * (math.sqrt(d) + 7)  # tighter than the whole noise norm
    for seed in range(5):
        rng = np.random.default_rng(seed)
        direction = rng.normal(size=d)
        direction /= np.linalg.norm(direction)
        noise = rng.normal(size=(n, d)) * noise_std(cfg)
        honest = (clip * direction + noise).mean(axis=0)  # each site's clipped change + its noise share
        in_range(honest, ex.range, per_value, norm_bound)
        shift = rng.normal(size=d)
        shift *= 2 * clip / np.linalg.norm(shift)  # one site's vector moved by n x 2C: the mean by 2C
        with pytest.raises(ValueError, match="norm passes"):
            in_range(honest + shift, ex.range, per_value, norm_bound)


@pytest.mark.parametrize("stage", ["collect_masked_vectors", "unmask"])
def test_a_site_that_drops_after_sharing_its_keys_is_recovered(secure_cfg, stage):
    """Site 102 vanishes after the key exchange: before sending its masked vector (its pairwise masks are
    rebuilt from the others' shares and the mean is the other four's), or after it (its vector is in)."""
    vectors = clipped_vectors(5, 500, seed=3)
    mean, nodes, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors}, dead_at={102: stage})
    kept = [n for n in vectors if n != 102] if stage == "collect_masked_vectors" else list(vectors)
    assert nodes == kept
    want = sum(vectors[n] for n in kept) / len(kept)
    assert np.abs(mean - want).max() <= quantization_error(secure_cfg)


def test_too_many_sites_gone_halts_the_round_without_a_result(secure_cfg):
    vectors = clipped_vectors(5, 100, seed=4)
    dead = {101: "share_keys", 102: "share_keys", 103: "share_keys"}
    mean, nodes, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors}, dead_at=dead)
    assert mean is None and nodes == []


# ------------------------------------------------------------------ a server that deviates from the protocol
def server_sends(monkeypatch, edit) -> None:
    """From now on the server edits each protocol message before it leaves (``edit(stage, node, configs)``,
    in place): a server that deviates from SecAgg+'s messages."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    original = VectorGrid.send_and_receive

    def deviating(self, messages, timeout=None):
        for m in messages:
            records = m.content.config_records
            if RECORD_KEY_CONFIGS in records:
                configs = records[RECORD_KEY_CONFIGS]
                edit(configs["stage"], m.metadata.dst_node_id, configs)
        return original(self, messages, timeout)

    monkeypatch.setattr(VectorGrid, "send_and_receive", deviating)


def server_view(grid, target: int):
    """What a server holds after a round: each site's first public key (setup), the target's masked vector
    (None if it sent none) and each site's unmask reply as (node, node ids, shares)."""
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    pk1, masked, replies = {}, None, []
    for node, stage, content in grid.received:
        c = content.config_records[RECORD_KEY_CONFIGS]
        if stage == "setup":
            pk1[node] = c[Key.PUBLIC_KEY_1]
        elif stage == "collect_masked_vectors" and node == target:
            masked = [bytes_to_ndarray(b) for b in c[Key.MASKED_PARAMETERS]]
        elif stage == "unmask":
            replies.append((node, list(c[Key.NODE_ID_LIST]), list(c[Key.SHARE_LIST])))
    return pk1, masked, replies


def unmask_one(
    cfg, target: int, masked, pk1: dict, seeds: list, secrets: dict[int, list]
) -> np.ndarray | None:
    """The target's vector from its masked one: its private mask from ``seeds`` (shares of its seed), each
    pairwise mask from the shares of one side's secret key (``secrets``: owner -> shares; the target's own
    key removes every pairwise mask, a partner's key the one it shares with the target). None without a
    masked vector or a threshold of each kind of share."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    from fedllm.secagg.bounds import clipping_range, quantization_bits
    from fedllm.secagg.guard import threshold_for

    # the threshold of protocol_round's rounds: the config's fraction, no colluder (its default)
    t = threshold_for(cfg.secagg.reconstruction_threshold, len(pk1), 0)
    if masked is None or len(seeds) < t or not secrets or min(len(v) for v in secrets.values()) < t:
        return None
    mod, q = 2**cfg.secagg.modulus_bits, 2 ** quantization_bits(cfg)
    shapes = get_parameters_shape(masked)
    vec = parameters_subtraction(masked, pseudo_rand_gen(combine_shares(seeds[:t]), mod, shapes))
    keys = {j: bytes_to_private_key(combine_shares(v[:t])) for j, v in secrets.items()}
    partners = [j for j in pk1 if j != target] if target in keys else list(keys)
    for j in partners:
        own = keys.get(target)
        shared = generate_shared_key(own, bytes_to_public_key(pk1[j])) if own else None
        if shared is None:
            shared = generate_shared_key(keys[j], bytes_to_public_key(pk1[target]))
        mask = pseudo_rand_gen(shared, mod, shapes)
        vec = parameters_subtraction(vec, mask) if target > j else parameters_addition(vec, mask)
    _, arrays = factor_extract(parameters_mod(vec, mod))
    return dequantize(arrays, clipping_range(cfg), q)[0]


def rebuild(grid, target: int, cfg) -> np.ndarray | None:
    """The both-lists attack's rebuild: each unmask reply names the target twice, first for its seed's
    share, then for its secret key's."""
    pk1, masked, replies = server_view(grid, target)
    seeds, own = [], []
    for _, nids, shares in replies:
        hits = [share for n, share in zip(nids, shares, strict=True) if n == target]
        seeds += hits[:1]
        own += hits[1:2]
    return unmask_one(cfg, target, masked, pk1, seeds, {target: own})


def site_errors(monkeypatch) -> list[str]:
    """From now on every site's error reply (its refusal) is recorded here, in order."""
    errors: list[str] = []
    original = VectorGrid.send_and_receive

    def recording(self, messages, timeout=None):
        replies = original(self, messages, timeout)
        errors.extend(r.error.reason for r in replies if r.has_error())
        return replies

    monkeypatch.setattr(VectorGrid, "send_and_receive", recording)
    return errors


def unguarded(monkeypatch) -> None:
    """Flower's own mod alone, as fedllm's sites ran it before their guard: no checks (nor fedllm's admission
    of a training), and Flower's own mask generator (its seed folded to 32 bits) on both ends."""
    import importlib

    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    import fedllm.secagg.flower as sf
    from fedllm.secagg import prg

    monkeypatch.setattr(sf, "_guard", lambda msg, context: None)
    monkeypatch.setattr(sf, "admitted", lambda msg, context, sites: None)
    monkeypatch.setattr(prg, "install", lambda: None)
    for name in prg.FLOWER_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "pseudo_rand_gen", pseudo_rand_gen)


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_server_listing_a_site_as_surviving_and_dropped_cannot_rebuild_its_update(
    secure_cfg, monkeypatch, guarded
):
    """An ordinary 5-site round whose server adds site 102 to the dropped list of every unmask message. Under
    Flower's mod alone every site returns both kinds of 102's shares and the server rebuilds 102's exact
    vector (the attack is real: within the quantization); fedllm's sites refuse that message, so the server
    holds no share of either kind, nor a sum."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    vectors = clipped_vectors(5, 300, seed=8)
    if not guarded:
        unguarded(monkeypatch)

    def both_lists(stage, node, configs):
        if stage == "unmask":
            configs[Key.DEAD_NODE_ID_LIST] = [*configs[Key.DEAD_NODE_ID_LIST], 102]

    server_sends(monkeypatch, both_lists)
    mean, _, grid = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True)
    got = rebuild(grid, 102, secure_cfg)
    if not guarded:
        assert got is not None
        assert np.abs(got - vectors[102]).max() <= quantization_error(secure_cfg)
        assert np.corrcoef(got, vectors[102])[0, 1] > 0.999
    else:
        assert got is None and mean is None
        assert not [r for r in grid.received if r[1] == "unmask"]  # no site answered the unmask message


@pytest.mark.parametrize(
    "edit, says",
    [
        ("self-dropped", "does not list this site among the survivors"),
        ("stranger", "shared no keys with"),
        ("repeated", "repeats a node"),
        ("too-few-survivors", "below the round's quorum"),
    ],
)
def test_each_site_refuses_an_unmask_message_that_is_not_the_protocols(secure_cfg, monkeypatch, edit, says):
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    def deviate(stage, node, configs):
        if stage != "unmask":
            return
        active = list(configs[Key.ACTIVE_NODE_ID_LIST])
        if edit == "self-dropped":
            configs[Key.ACTIVE_NODE_ID_LIST] = [n for n in active if n != node]
            configs[Key.DEAD_NODE_ID_LIST] = [*configs[Key.DEAD_NODE_ID_LIST], node]
        elif edit == "stranger":
            configs[Key.DEAD_NODE_ID_LIST] = [*configs[Key.DEAD_NODE_ID_LIST], 999]
        elif edit == "repeated":
            configs[Key.ACTIVE_NODE_ID_LIST] = [*active, active[0]]
        else:  # three survive by the server's word: Flower's threshold (3 of 5) holds, the floor (4) not
            configs[Key.ACTIVE_NODE_ID_LIST] = [node, *[n for n in active if n != node][:2]]

    server_sends(monkeypatch, deviate)
    errors = site_errors(monkeypatch)
    vectors = clipped_vectors(5, 50, seed=9)
    floor = {"secagg-min-sites": "4"} if edit == "too-few-survivors" else None
    mean, _, grid = protocol_round(
        secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=floor
    )
    assert mean is None and not [r for r in grid.received if r[1] == "unmask"]
    assert len(errors) == 5 and all(says in e for e in errors), errors


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_server_showing_sites_different_lists_cannot_rebuild_a_site(tmp_path, monkeypatch, guarded):
    """7 sites, threshold 4 (a strict majority). The server hands site 100 the key shares of 3 neighbours
    only (so it masks with those 3), then asks the others for 100's seed shares and for the 3's secret-key
    shares, each site's lists consistent on their own. Under Flower's mod alone it rebuilds 100's vector;
    fedllm's site 100 refuses a collect message without every neighbour's key shares, so nothing of it
    leaves (found by review on this change's first version, which checked each list alone)."""

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            "federation.num_clients=7",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
            "secagg.reconstruction_threshold=0.6",
        ),
    )
    target, partners = 100, [101, 102, 103]
    lists = {
        104: ([104, 100, 105, 106], [101, 102, 103]),
        105: ([105, 100, 104, 106], [101, 102, 103]),
        106: ([106, 100, 104, 105], [101, 102, 103]),
        101: ([101, 100, 104, 105], [102, 103]),
        102: ([102, 100, 104, 105], [101, 103]),
        103: ([103, 100, 104, 105], [101, 102]),
        100: ([100, 101, 102, 103], []),
    }

    def deviate(stage, node, c):
        partners_only(stage, node, c, target, partners, lists)

    if not guarded:
        unguarded(monkeypatch)
    server_sends(monkeypatch, deviate)
    vectors = clipped_vectors(7, 200, seed=3)
    _, _, grid = protocol_round(cfg, vectors, {n: 1 for n in vectors}, deviating=True)
    got = rebuild_from_partners(grid, target, partners, lists, cfg)
    if guarded:
        assert got is None
    else:
        assert np.abs(got - vectors[target]).max() <= quantization_error(cfg)


def partners_only(stage: str, node: int, c, target: int, partners: list[int], lists: dict) -> None:
    """The different-lists attack's edits: the target gets the key shares of ``partners`` only, and each site
    its own unmask lists (``lists``: node -> (surviving, dropped))."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    if stage == "collect_masked_vectors" and node == target:
        keep = [i for i, src in enumerate(c[Key.SOURCE_LIST]) if src in partners]
        c[Key.SOURCE_LIST] = [c[Key.SOURCE_LIST][i] for i in keep]
        c[Key.CIPHERTEXT_LIST] = [c[Key.CIPHERTEXT_LIST][i] for i in keep]
    if stage == "unmask":
        c[Key.ACTIVE_NODE_ID_LIST], c[Key.DEAD_NODE_ID_LIST] = list(lists[node][0]), list(lists[node][1])


def rebuild_from_partners(grid, target: int, partners: list[int], lists: dict, cfg) -> np.ndarray | None:
    """The different-lists attack's rebuild: the target's seed from the sites that listed it as surviving,
    its partners' secret keys from those that listed them as dropped."""
    pk1, masked, replies = server_view(grid, target)
    seeds, secrets = [], {j: [] for j in partners}
    for node, nids, shares in replies:
        alive = len(lists[node][0])
        for i, (n, share) in enumerate(zip(nids, shares, strict=True)):
            if i < alive and n == target:
                seeds.append(share)
            if i >= alive and n in secrets:
                secrets[n].append(share)
    return unmask_one(cfg, target, masked, pk1, seeds, secrets)


def test_a_site_refuses_share_keys_without_every_announced_neighbour(secure_cfg, monkeypatch):
    """The server hands every site the keys of 3 of the 5 announced neighbours (the others "dropped" at
    setup): each refuses, so no site masks with a chosen few."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    def cut(stage, node, c):
        if stage == "share_keys":
            for k in [k for k in c if k not in (Key.STAGE, str(node))][2:]:
                del c[k]

    server_sends(monkeypatch, cut)
    errors = site_errors(monkeypatch)
    vectors = clipped_vectors(5, 30, seed=11)
    mean, _, _ = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True)
    assert mean is None and len(errors) == 5 and all("where the setup announced 5" in e for e in errors)


def test_a_protocol_message_of_another_type_is_refused_not_trained_unmasked():
    """Flower's ClientApp hands ``train.default`` to the train handler and its mods, and Flower's SecAgg+ mod
    passes any type but ``train`` straight to the training step: without the check the site would answer a
    ``train.default`` message carrying the protocol's record with its vector, unmasked, even when pinned."""
    from flwr.app import Context, RecordDict

    app, _, _ = vector_app({100: np.arange(3.0)}, {100: 1})
    ctx = Context(
        run_id=1,
        node_id=100,
        node_config={"secure-aggregation": "required"},
        state=RecordDict(),
        run_config={},
    )
    grid = VectorGrid(app, {100: ctx})
    msg = setup_message(100, 5, 5, 3)
    msg.metadata.__dict__["_message_type"] = "train.default"
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and "of type 'train.default'" in reply.error.reason


def test_a_site_trains_once_per_round_of_its_trajectory_across_runs_and_refuses_a_known_noise_seed(
    tmp_path, monkeypatch
):
    """The collect stage's training step on a site whose runtime is replaced by a counter: a second secure
    training for a round it trained (a server that restarts the protocol to get two sums differing by one
    site) is refused before the site trains, also in a new Flower run (a new context.state, the same state
    folder: the record lives there, per trajectory); under distributed DP a pinned site refuses
    privacy.noise_seed >= 0 (the server that sent the seed could remove its noise)."""
    from flwr.app import ConfigRecord, Context, RecordDict
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

    import fedllm.secagg.flower as sf
    from fedllm.secagg import guard

    def run(cfg, pinned, rounds, state_dir):
        trained = []
        site = SimpleNamespace(
            cfg=cfg,
            client_id=0,
            pinned=pinned,
            codecs=[],
            state_dir=state_dir,
            client=SimpleNamespace(num_examples=5),
            train=lambda start: trained.append(start.round) or SimpleNamespace(attachments={}),
        )
        sites = SimpleNamespace(site=lambda context, text: site, keep=lambda c, s: None)
        monkeypatch.setattr(sf, "_from_bytes", len)  # bytes(r) stands for round r's start record
        monkeypatch.setattr("fedllm.flower.records.start_config", lambda content: ("cfg", 0))
        monkeypatch.setattr(
            "fedllm.flower.records.read_start", lambda content, codecs: SimpleNamespace(round=content)
        )
        state = RecordDict()  # the round's setup, as the config gives it (checked before training)
        state.config_records[RECORD_KEY_STATE] = ConfigRecord(
            SecAggPlusState(sample_num=4, nid=100, **{"max_weight": 5.0, **guard.pinned(4, 4, cfg)}).to_dict()
        )
        ctx = Context(run_id=1, node_id=100, node_config={}, state=state, run_config={})  # a new run
        errors = []
        for r in rounds:
            msg = SimpleNamespace(
                content=SimpleNamespace(config_records={"fitins.config": {sf.START: r, sf.LAYOUT: "[]"}})
            )
            try:
                sf._secure_train(msg, ctx, sites)
            except guard.Refused as e:
                errors.append(str(e))
            except RuntimeError as e:  # the counter's update carries no summand: training happened
                assert "made no secure summand" in str(e)
        return trained, errors

    base = ("federation.num_clients=4", "flower.secure_aggregation=true")
    cfg = load_config(None, tiny_overrides(tmp_path / "a", *base, "secagg.clip_norm=1"))
    trained, errors = run(cfg, False, [1, 1, 2], tmp_path / "site")
    once = "that this site's federation has had already: a site trains each round once"
    assert trained == [1, 2] and len(errors) == 1 and f"round 1 {once}" in errors[0]
    trained, errors = run(cfg, False, [1, 2, 3], tmp_path / "site")  # run 2, the same trajectory
    assert trained == [3] and len(errors) == 2 and f"round 2 {once}" in errors[1]
    assert not any("round 2" in e for e in errors[:1])  # a refusal names no round the site trained
    dp_cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "b", *base, "privacy.mode=distributed", "privacy.noise_seed=0", "privacy.delta=1e-5"
        ),
    )
    assert run(dp_cfg, False, [1], tmp_path / "dp")[0] == [1]  # an unpinned site trusts the server's config
    trained, errors = run(dp_cfg, True, [1], tmp_path / "dp-pinned")
    assert trained == [] and "privacy.noise_seed" in errors[0]


@pytest.fixture
def federation(tmp_path):
    """A federation per test: its sites' state folders keep the statements they signed for each round (a
    federation's round 1 signed in one test would refuse another test's round 1)."""
    return Federation(tmp_path / "federation")


def setup_message(node: int, sample: int, share: int, threshold: int):
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.app.message_type import MessageType
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    configs = {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: sample,
        Key.SHARE_NUMBER: share,
        Key.THRESHOLD: threshold,
        Key.CLIPPING_RANGE: 1.0,
        Key.TARGET_RANGE: 2**20,
        Key.MOD_RANGE: 2**32,
        Key.MAX_WEIGHT: 1.0,
    }
    content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(configs)})
    return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN, group_id="1")


@pytest.mark.parametrize(
    "sample, share, threshold, node_config, says",
    [
        (1, 1, 1, {}, "a secure round of 1 site"),  # the one-site round: its vector in the clear
        (2, 2, 2, {}, "a secure round of 2 site"),
        (5, 5, 2, {}, "not a strict majority"),
        (6, 6, 3, {}, "not a strict majority"),
        (4, 4, 3, {"secagg-min-sites": "5"}, "at least 5"),
        (4, 4, 3, {"secagg-min-sites": "1"}, None),  # a floor below 3 is 3
        (5, 5, 3, {"secagg-min-threshold": "0.8", "secagg-colluders": "0"}, "below this site's floor"),
        (5, 5, 4, {"secagg-min-threshold": "0.8"}, None),
        # one colluder (the default) signing for two sets of neighbours: t > (n + 1) / 2 (issue 88)
        (5, 5, 3, {}, "1 colluding site(s) could sign for two sets of neighbours"),
        (7, 7, 4, {}, "t >= 5; node config secagg-colluders=1"),
        (7, 7, 5, {}, None),
        (4, 4, 3, {}, None),
        (5, 5, 4, {"secagg-colluders": "3"}, "3 colluding site(s)"),
        (5, 5, 4, {"secagg-colluders": "2"}, None),
        (5, 5, 3, {"secagg-colluders": "0"}, None),
        (5, 5, 4, {"secagg-colluders": "-1"}, "secagg-colluders=-1: expected an integer >= 0"),
        (5, 2, 2, {}, "a neighbourhood of 2"),
        # the default config's smaller neighbourhoods (6 sites, 5 neighbours, threshold 3): each site's view
        # consistent on its own, the counting argument (every site the same neighbourhood) void (issue 78)
        (6, 5, 3, {}, "a neighbourhood of 5 in a round of 6"),
    ],
)
def test_a_site_refuses_a_setup_it_was_not_configured_to_accept(
    sample, share, threshold, node_config, says, federation
):
    """Whatever the server sends at setup, even with the site pinned to secure aggregation: a round too small
    to hide a site, a threshold two disjoint halves of the neighbours could each reach, or below the site's
    own floors (``--node-config secagg-min-sites`` / ``secagg-min-threshold``), or a threshold its colluders
    could split (``secagg-colluders``, default 1: t > (n + c) / 2)."""
    from flwr.app import Context, RecordDict

    app, _, _ = vector_app({100: np.zeros(3)}, {100: 1})
    config = {"secure-aggregation": "required", **federation.node_config(100, 0), **node_config}
    ctx = Context(run_id=1, node_id=100, node_config=config, state=RecordDict(), run_config={})
    grid = VectorGrid(app, {100: ctx})
    (reply,) = grid.send_and_receive([setup_message(100, sample, share, threshold)])
    if says is None:
        assert not reply.has_error()
    else:
        assert reply.has_error() and says in reply.error.reason, (
            reply.error.reason if reply.has_error() else ""
        )


@pytest.mark.parametrize(
    "change, says",
    [
        ({}, None),
        ({"sample_num": 3, "share_num": 3, "threshold": 2}, "at least 4"),
        ({"sample_num": 7, "share_num": 7, "threshold": 5}, "samples 6 a round"),
        ({"threshold": 3}, "threshold=3 (the config gives 4)"),
        ({"mod_range": 2}, "mod_range=2"),
        ({"target_range": 1}, "target_range=1"),
        ({"clipping_range": 1e-12}, "clipping_range=1e-12"),
        ({"max_weight": 7.0}, "max_weight=7.0"),
    ],
)
def test_the_protocols_parameters_must_be_those_the_runs_config_promises(tmp_path, change, says):
    """At the collect stage, before it trains or masks, the site checks every setup parameter against the
    run's config the server sent (6 clients a round, min_clients 4, reconstruction threshold 0.67, a 32-bit
    field, uniform weights): a round outside 4..6 sites, a threshold below the config's, and any other
    modulus, target range, clipping range or maximum weight (a modulus of 2 made Flower's masks all 0 and a
    target range of 1 the reply the sign of every value, in the clear) are refused; the quorum is returned,
    which the unmask check then requires."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState

    from fedllm.secagg import guard

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            "federation.num_clients=6",
            "federation.min_clients=4",
            "federation.weighting=uniform",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1",
        ),
    )
    honest = {"sample_num": 6, **guard.pinned(6, 6, cfg)}
    assert honest["threshold"] == 4 and honest["mod_range"] == 2**32 and honest["max_weight"] == 1.0
    state = SecAggPlusState(**{**honest, **change})
    if says is None:
        assert guard.check_round_config(state, cfg, guard.Floor()) == 4
    else:
        with pytest.raises(guard.Refused, match=re.escape(says)):
            guard.check_round_config(state, cfg, guard.Floor())


def test_a_round_that_loses_its_quorum_before_the_unmask_is_never_unmasked(tmp_path_factory, monkeypatch):
    """3 sites, federation.min_clients=3, one vanishing before it sends its masked vector: Flower's workflow
    would unmask the other two's sum (the threshold, 2 of 3, still holds); fedllm's stops before the unmask
    stage, so no unmask message is sent and no sum exists."""
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path_factory.mktemp("quorum") / "run",
            "federation.num_clients=3",
            "federation.min_clients=3",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
        ),
    )
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    unguarded(monkeypatch)  # the sites would refuse too: this is the server's own stop
    stages = []
    original = VectorGrid.send_and_receive

    def recording(self, messages, timeout=None):
        stages.extend(
            m.content.config_records[RECORD_KEY_CONFIGS]["stage"]
            for m in messages
            if RECORD_KEY_CONFIGS in m.content.config_records
        )
        return original(self, messages, timeout)

    monkeypatch.setattr(VectorGrid, "send_and_receive", recording)
    vectors = clipped_vectors(3, 40, seed=10)
    mean, nodes, grid = protocol_round(
        cfg, vectors, {n: 1 for n in vectors}, dead_at={101: "collect_masked_vectors"}
    )
    assert mean is None and nodes == []
    assert [r for r in grid.received if r[1] == "collect_masked_vectors"]  # the others did send theirs
    assert "collect_masked_vectors" in stages and "unmask" not in stages  # no unmask message was sent


# ------------------------------------------------------------------ the refusals
@pytest.mark.parametrize(
    "extra, says",
    [
        (["aggregation.name=flora"], "stacks each client's factors"),
        (["aggregation.name=flexlora"], "SVD of each client's product"),
        (["aggregation.name=florist"], "stacks each client's factors"),
        (["aggregation.name=hetlora"], "by its own norm"),
        (["aggregation.name=floral"], "router"),
        (["aggregation.name=fedex"], "residual of each client's own product"),
        (["aggregation.name=fedsa", "aggregation.fedsa.share_b_every=2"], "clients that send it"),
        (["aggregation.name=fedsb"], "strategy extras"),
        (["client.algorithm=scaffold"], "control-variate"),
        (["aggregation.fedit.robust=median"], "aggregation.fedit.robust=median"),
        (["comm.upload=int8"], "comm.upload=int8"),
        (["privacy.mode=central"], "privacy.mode=distributed"),
        (["federation.max_client_weight=0.5"], "federation.max_client_weight"),
        (["federation.clients_per_round=2"], "at least 3 clients per round"),
        (["secagg.quantization_bits=30"], "secagg.quantization_bits=30"),
        (["secagg.colluders=4"], "secagg.colluders=4: a round of 4 sites cannot withstand it"),
    ],
)
def test_what_secure_aggregation_cannot_run_is_refused_in_one_line(tmp_path, extra, says):
    base = ["flower.secure_aggregation=true", "secagg.clip_norm=1", "federation.num_clients=4"]
    with pytest.raises(ConfigError) as e:
        load_config(None, tiny_overrides(tmp_path, *base, *extra))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["flower.secure_aggregation=true"], "secagg.clip_norm"),
        (["secagg.clip_norm=2"], "flower.secure_aggregation is false"),
        (["privacy.mode=distributed"], "flower.secure_aggregation=true"),
        (
            ["flower.secure_aggregation=true", "privacy.mode=distributed", "secagg.clip_norm=3"],
            "leave secagg.clip_norm at 0",
        ),
    ],
)
def test_secure_aggregations_own_options_are_checked(tmp_path, extra, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, tiny_overrides(tmp_path, "federation.num_clients=4", *extra))
    assert says in str(e.value)


def test_the_in_process_simulation_refuses_secure_aggregation(tmp_path):
    from fedllm.simulation import Simulation

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "federation.num_clients=4", "flower.secure_aggregation=true", "secagg.clip_norm=1"
        ),
    )
    with pytest.raises(ConfigError, match="runs on Flower only"):
        Simulation(cfg, tmp_path)


# ------------------------------------------------------------------ fedllm's ServerApp and ClientApp
def site_grid(tmp_path, n: int, dead_at=None) -> VectorGrid:
    """Nodes 100+k host site k in this process behind fedllm's real ClientApp (its mods included), with real
    Messages: what a SuperLink would carry."""
    from flwr.app import Context, RecordDict

    from fedllm.flower import client_app

    contexts = {
        100 + k: Context(
            run_id=1,
            node_id=100 + k,
            node_config={"client-id": k, "state-dir": str(tmp_path / f"site-{k}")},
            state=RecordDict(),
            run_config={},
        )
        for k in range(n)
    }
    return VectorGrid(client_app.app, contexts, dead_at)


def flower_run(tmp_path, name, *extra, dead_at=None, n=4):
    from fedllm.flower import server_app

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / name,
            f"federation.num_clients={n}",
            "flower.share_token_modules=true",
            "client.sft.optimizer=sgd",
            "client.lr=0.05",
            "eval.personalized=false",
            *extra,
        ),
    )
    grid = site_grid(tmp_path / f"{name}-sites", n, dead_at)
    driver = server_app.FlowerDriver(cfg, tmp_path / name, grid, startup_timeout_s=5)
    driver.setup()
    return driver, grid, driver.run()


def server_tensors(run_dir, round_idx: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    t = load_file(run_dir / "checkpoints" / f"round-{round_idx:04d}" / "state.safetensors")
    return {k: v for k, v in t.items() if k.startswith(("global.", "dense."))}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_a_secure_fedit_run_is_the_plain_run_within_the_quantization_bound(tmp_path, monkeypatch):
    """Two rounds of FedIT on fedllm's ServerApp and ClientApp (4 sites, mixed ranks, example weights, SGD):
    round 1's global state is the plain run's within the quantization bound of each value; round 2's within
    three bounds (its own quantization, and round 1's carried through two SGD steps); what the server
    received from each site at the masking stage is uncorrelated with the site's true vector."""
    from fedllm.secagg import summand

    sent: dict[int, np.ndarray] = {}
    original = summand.site_vector

    def recording(changes, lay, noise_std=0.0, gen=None):
        v = original(changes, lay, noise_std, gen)
        sent[len(sent)] = v
        return v

    import fedllm.secagg.flower as sf

    monkeypatch.setattr(sf, "site_vector", recording)
    _, _, plain = flower_run(tmp_path, "plain")
    driver, grid, secure = flower_run(
        tmp_path, "secure", "flower.secure_aggregation=true", "secagg.clip_norm=10"
    )
    cfg = driver.cfg
    counts = [c.num_examples for c in driver.server.clients.values()]
    bound = quantization_error(cfg, [c / max(counts) for c in counts])
    r1 = max_diff(server_tensors(tmp_path / "plain", 1), server_tensors(tmp_path / "secure", 1))
    r2 = max_diff(server_tensors(tmp_path / "plain", 2), server_tensors(tmp_path / "secure", 2))
    assert 0 < r1 <= bound * (1 + 1e-3) + 1e-7, (r1, bound)
    assert r2 <= 3 * bound, (r2, bound)
    assert secure["loss_after"] == pytest.approx(plain["loss_after"], rel=1e-3)
    masked = _masked(grid)  # the last round's masked vectors, by node (the first round's were replaced)
    assert len(masked) == 4 and len(sent) == 8
    for i, node in enumerate(sorted(masked)):
        true = sent[4 + i]
        got = masked[node][-true.size :].astype(np.float64)
        assert abs(np.corrcoef(got, true)[0, 1]) < 4 / math.sqrt(true.size)
    rows = [json.loads(x) for x in (tmp_path / "secure" / "metrics.jsonl").read_text().splitlines()]
    assert [r["n_updates"] for r in rows[1:]] == [4, 4]
    assert rows[1]["up_bytes"] == 4 * 8 * (driver.exchange.last["mean"].size + 1)
    assert "flower_up_bytes" not in rows[1]  # the protocol's own messages are not measured (never a false 0)


@pytest.mark.slow
def test_a_secure_run_with_encoded_downloads_is_the_plain_run_with_them(tmp_path):
    """comm.download=int8 under secure aggregation, through fedllm's ServerApp and ClientApp: each site
    decodes its start with the run's codecs inside the protocol's stage, and the server adds back the same
    decoded starts; round 1 (whose dense modules travel encoded) equals the plain run with the same encoding
    within the quantization bound, where a start the two sides saw differently would show the download's int8
    error. (Round 2 is not compared: an encoding rounds, so round 1's 1e-8 difference can move a value of the
    next download by a whole int8 step.)"""
    flower_run(tmp_path, "plain", "comm.download=int8")
    driver, _, _ = flower_run(
        tmp_path, "secure", "comm.download=int8", "flower.secure_aggregation=true", "secagg.clip_norm=10"
    )
    counts = [c.num_examples for c in driver.server.clients.values()]
    bound = quantization_error(driver.cfg, [c / max(counts) for c in counts])
    r1 = max_diff(server_tensors(tmp_path / "plain", 1), server_tensors(tmp_path / "secure", 1))
    assert r1 <= bound * (1 + 1e-3) + 1e-7, (r1, bound)


@pytest.mark.slow
@pytest.mark.parametrize("site_metrics", [False, True], ids=["default", "site-metrics"])
def test_a_secure_run_sends_no_per_site_figures_by_default(tmp_path, monkeypatch, site_metrics):
    """Two secure rounds under uniform weighting with eval.personalized=true. By default the server asks no
    site for an evaluation, each masked reply's plain example count is 0, each handshake says 1 (uniform
    weights need none), and neither metrics.jsonl nor summary.json nor partition.json holds a per-site
    figure; with secagg.site_metrics=true the sites' evaluations and handshake counts are there (the check
    sees them), and the masked replies' plain count is still 0 (never needed: the weight is masked)."""
    from flwr.app.message_type import MessageType
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    types, counts = [], []
    original = VectorGrid.send_and_receive

    def recording(self, messages, timeout=None):
        types.extend(m.metadata.message_type for m in messages)
        replies = original(self, messages, timeout)
        for r in replies:
            if not r.has_error() and RECORD_KEY_CONFIGS in r.content.config_records:
                record = r.content.metric_records.get("fitres.num_examples")
                if record is not None:
                    counts.append(record["num_examples"])
        return replies

    monkeypatch.setattr(VectorGrid, "send_and_receive", recording)
    name = "figures" if site_metrics else "plain"
    flower_run(
        tmp_path,
        name,
        "flower.secure_aggregation=true",
        "secagg.clip_norm=10",
        "federation.weighting=uniform",
        "eval.personalized=true",
        f"secagg.site_metrics={str(site_metrics).lower()}",
    )
    run = tmp_path / name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = (run / "summary.json").read_text()
    sizes = [c["train"] for c in json.loads((run / "partition.json").read_text())]
    assert (
        counts == [0] * 8
    )  # 4 sites' masked replies in each of 2 rounds: the weight is in the masked vector
    if site_metrics:
        assert MessageType.EVALUATE in types and any("personal" in r for r in rows[1:])
        assert min(sizes) > 1
    else:
        assert MessageType.EVALUATE not in types
        assert not any("personal" in r for r in rows) and '"personal"' not in summary
        assert sizes == [1, 1, 1, 1]


@pytest.mark.slow
def test_a_site_vanishing_mid_protocol_leaves_the_round_to_the_others(tmp_path):
    """Of 5 sites, site 2 vanishes after round 1's key exchange: round 1 is the other four's sum (the protocol
    rebuilds its masks from their shares), round 2 runs without it, each row names its failure."""
    _, _, out = flower_run(
        tmp_path,
        "drop",
        "flower.secure_aggregation=true",
        "secagg.clip_norm=10",
        dead_at={102: "collect_masked_vectors"},
        n=5,
    )
    rows = [json.loads(x) for x in (tmp_path / "drop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["n_updates"] for r in rows[1:]] == [4, 4]
    assert "left the secure aggregation" in json.dumps(rows[1]["failed"])  # after its keys were shared
    assert "site not connected" in json.dumps(rows[2]["failed"])  # round 2: gone before the protocol
    assert math.isfinite(out["loss_after"])


@pytest.mark.slow
def test_distributed_dp_reports_the_central_epsilon_of_the_summed_noise(tmp_path, monkeypatch):
    """privacy.mode=distributed: each site adds sigma C / sqrt(m) before masking; the run's epsilon is what
    dp-accounting gives central DP with sigma (the same function, fed the same numbers), and no round needed
    the server's top-up."""
    import fedllm.secagg.flower as sf
    from fedllm.privacy import spent
    from fedllm.secagg.summand import site_vector as original

    stds = []

    def recording(changes, lay, noise_std=0.0, gen=None):
        stds.append(noise_std)
        return original(changes, lay, noise_std, gen)

    monkeypatch.setattr(sf, "site_vector", recording)
    driver, _, out = flower_run(
        tmp_path,
        "ddp",
        "flower.secure_aggregation=true",
        "privacy.mode=distributed",
        "privacy.noise_multiplier=1.0",
        "privacy.clip_norm=0.5",
        "privacy.noise_seed=0",
    )
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    central = copy.deepcopy(driver.cfg)
    central.privacy.mode, central.flower.secure_aggregation = "central", False
    assert (
        summary["privacy"]["epsilon"] == pytest.approx(spent(central, 2))
        and summary["privacy"]["epsilon"] > 0
    )
    rows = [json.loads(x) for x in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["agg_dp_server_noise_share"] for r in rows[1:]] == [0.0, 0.0]
    assert "secure_aggregation" in summary and any("SecAgg+" in g for g in summary["guarantees"])
    assert stds == [pytest.approx(1.0 * 0.5 / 2)] * 8  # sigma C / sqrt(4) on each of 4 sites, 2 rounds
    assert math.isfinite(out["loss_after"])


@pytest.mark.slow
@pytest.mark.parametrize("dp", [False, True], ids=["secure", "secure-distributed-dp"])
def test_a_two_round_simulation_engine_run(tmp_path, builtin_base, dp):
    """Flower's Simulation Engine (Ray workers, the real ClientApp with its mods), 4 sites, 2 rounds of FedIT:
    with secure aggregation the global state is the in-process plain simulation's within the quantization
    bound after round 1 and three bounds after round 2 (SGD); with distributed DP, the summary's epsilon is
    dp-accounting's for central DP with the summed noise."""
    from fedllm.privacy import spent
    from fedllm.simulation import Simulation
    from tests.flower_grid import run_on_simulation_engine

    extra = [
        "federation.num_clients=4",
        "federation.seed=3",
        "client.sft.optimizer=sgd",
        "client.lr=0.05",
        "eval.limit=2",
        "eval.personalized=false",
        "flower.share_token_modules=true",
    ]
    secure = ["flower.secure_aggregation=true", "secagg.clip_norm=10"]
    if dp:
        secure = [
            "flower.secure_aggregation=true",
            "privacy.mode=distributed",
            "privacy.noise_multiplier=1.0",
        ]
        secure += ["privacy.clip_norm=0.5", "privacy.noise_seed=0", "privacy.sampling=public"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker computes
    try:
        if not dp:
            reference = Simulation(
                load_config(None, tiny_overrides(tmp_path / "sim", *extra)), tmp_path / "sim"
            )
            reference.setup()
            reference.run()
        cfg = load_config(None, tiny_overrides(tmp_path / "flower", *extra, *secure))
        run_on_simulation_engine(cfg, tmp_path / "flower")
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    assert [r["n_updates"] for r in rows[1:]] == [4, 4]
    if dp:
        assert summary["privacy"]["mode"] == "distributed"
        central = copy.deepcopy(cfg)
        central.privacy.mode, central.flower.secure_aggregation = "central", False
        assert summary["privacy"]["epsilon"] == pytest.approx(spent(central, 2))
        assert math.isfinite(summary["loss_after"])
        return
    sizes = json.loads((tmp_path / "flower" / "partition.json").read_text())
    counts = [c["train"] for c in sizes]
    bound = quantization_error(cfg, [c / max(counts) for c in counts])
    r1 = max_diff(server_tensors(tmp_path / "sim", 1), server_tensors(tmp_path / "flower", 1))
    r2 = max_diff(server_tensors(tmp_path / "sim", 2), server_tensors(tmp_path / "flower", 2))
    assert 0 < r1 <= bound * (1 + 1e-3) + 1e-7, (r1, bound)
    assert r2 <= 3 * bound, (r2, bound)


def test_a_site_pinned_to_secure_aggregation_refuses_a_plain_round(tmp_path):
    """A site whose operator set ``secure-aggregation='required'`` in its node config refuses a plain train
    message before reading it, so a server cannot ask it for its update in the clear."""
    from flwr.app import Context, RecordDict

    from fedllm.flower import client_app

    context = Context(
        run_id=1,
        node_id=100,
        node_config={"client-id": 0, "state-dir": str(tmp_path), "secure-aggregation": "required"},
        state=RecordDict(),
        run_config={},
    )
    message = SimpleNamespace(content=RecordDict(), metadata=SimpleNamespace(message_id="m1"))
    with pytest.raises(RuntimeError, match="requires secure aggregation"):
        client_app.train(message, context)


def test_the_run_summary_names_secure_aggregation_beside_dps_guarantee(tmp_path):
    from fedllm.aggregation import strategy_from_config
    from fedllm.features import FEATURES

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            "federation.num_clients=4",
            "flower.secure_aggregation=true",
            "privacy.mode=distributed",
            "privacy.noise_multiplier=1.0",
            "privacy.delta=1e-5",
        ),
    )
    strategy = strategy_from_config(cfg.aggregation)
    for feature in FEATURES:
        strategy = feature.wrap_strategy(strategy, getattr(cfg, feature.section), cfg)
    summary = strategy.run_summary(2)
    assert (
        summary["privacy"]["mode"] == "distributed"
        and summary["secure_aggregation"]["quantization_bits"] == 29
    )
    # the model observers' guarantee, the server's (no round released yet: epsilon 0), secure aggregation's
    assert len(summary["guarantees"]) == 3 and "SecAgg+" in summary["guarantees"][2]
    assert "released models" in summary["guarantees"][0]
    assert "against the server itself" in summary["guarantees"][1]
    assert strategy.name == "fedit" and strategy.sums_uploads(cfg)


# ---------------------------------------------------------- a deviating server, found by review (issue 78)
def seven_sites(tmp_path):
    return load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            "federation.num_clients=7",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
            "secagg.reconstruction_threshold=0.6",
        ),
    )


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_neighbour_spelled_twice_does_not_shrink_a_sites_neighbourhood(tmp_path, monkeypatch, guarded):
    """7 sites, threshold 4. The server hands site 100 the keys of 101-103 twice, once as "0101" ... (7 keys
    to a count, 4 neighbours to Flower's int()), leaves 100 out of 104-106's share-keys the same way, then
    shows each site unmask lists consistent on their own. Under Flower's mod alone 100 masks with 101-103
    only and the server rebuilds its vector; fedllm's sites refuse an id not written as Flower writes one."""

    cfg = seven_sites(tmp_path)
    target, partners, others = 100, [101, 102, 103], [104, 105, 106]
    lists = {
        100: ([100, 101, 102, 103], []),
        101: ([101, 100, 104, 105], [102, 103]),
        102: ([102, 100, 104, 105], [101, 103]),
        103: ([103, 100, 104, 105], [101, 102]),
        104: ([104, 105, 106, 101], [102, 103]),
        105: ([105, 104, 106, 102], [101, 103]),
        106: ([106, 104, 105, 103], [101, 102]),
    }

    def deviate(stage, node, c):
        if stage == "share_keys":
            drop = others if node == target else ([target] if node in others else [])
            for i, n in enumerate(drop):
                keep = partners[i] if node == target else next(o for o in others if o != node)
                del c[str(n)]
                c["0" * (i + 1) + str(keep)] = c[str(keep)]  # the kept neighbour once more, spelled anew
        partners_only(stage, node, c, target, partners, lists)

    if not guarded:
        unguarded(monkeypatch)
    server_sends(monkeypatch, deviate)
    errors = site_errors(monkeypatch)
    vectors = clipped_vectors(7, 200, seed=3)
    _, _, grid = protocol_round(cfg, vectors, {n: 1 for n in vectors}, deviating=True)
    got = rebuild_from_partners(grid, target, partners, lists, cfg)
    if guarded:
        assert got is None and any("not written as Flower writes one" in e for e in errors), errors
        assert not _masked(grid)  # no site sent a masked vector
    else:
        assert np.abs(got - vectors[target]).max() <= quantization_error(cfg)
        assert np.corrcoef(got, vectors[target])[0, 1] > 0.999999


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_setup_of_modulus_2_and_target_range_1_does_not_reveal_the_signs(secure_cfg, monkeypatch, guarded):
    """5 sites, an ordinary round but for the setup: modulus 2, target range 1, a clipping range of 1e-12.
    Under Flower's mod alone (and its generator, whose masks stop at M - 2: all 0 here) every site's masked
    reply is the sign of every value of its change, in the clear, without any unmask stage; fedllm's sites
    refuse the round's parameters before they train or mask (they are not what the run's config gives)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    def deviate(stage, node, c):
        if stage == "setup":
            c[Key.MOD_RANGE], c[Key.TARGET_RANGE], c[Key.CLIPPING_RANGE] = 2, 1, 1e-12

    if not guarded:
        unguarded(monkeypatch)
    server_sends(monkeypatch, deviate)
    errors = site_errors(monkeypatch)
    vectors = clipped_vectors(5, 2000, seed=1)
    _, _, grid = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True)
    masked = _masked(grid)
    if guarded:
        assert masked == {} and len(errors) == 5 and all("mod_range=2" in e for e in errors), errors
    else:
        assert len(masked) == 5
        assert all(np.array_equal(m[1:], (vectors[n] > 0).astype(m.dtype)) for n, m in masked.items())


def strip_pairwise(cfg, target: int, masked, pk1: dict, own_key_shares: list) -> list:
    """The target's masked arrays without its pairwise masks, from a threshold of shares of its own secret
    key (what a server gets by listing it as dropped after it sent its vector): its quantized values plus its
    private mask, in the field."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    mod = 2**cfg.secagg.modulus_bits
    shapes = get_parameters_shape(masked)
    # the generator the sites drew their pairwise masks with (Flower's, or fedllm's where installed)
    draw = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod").pseudo_rand_gen
    own = bytes_to_private_key(combine_shares(own_key_shares))
    vec = list(masked)
    for j in pk1:
        if j != target:
            mask = draw(generate_shared_key(own, bytes_to_public_key(pk1[j])), mod, shapes)
            vec = parameters_subtraction(vec, mask) if target > j else parameters_addition(vec, mask)
    return parameters_mod(vec, mod)


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_private_mask_is_not_found_by_searching_32_bit_seeds(secure_cfg, monkeypatch, guarded):
    """An ordinary 5-site round in which the server tells the others that site 104 dropped after it received
    104's masked vector (what Flower's workflow sends for a late vector), and so gets 104's secret-key
    shares and strips its pairwise masks. Left: 104's values under its private mask. Flower's generator draws
    that mask from the seed folded to 32 bits: trying seeds finds it (here 4,096 candidates around the true
    fold stand in for the 2^32, about 2 minutes on one core) and gives 104's exact vector. fedllm's sites
    draw from ChaCha20 keyed by the whole seed: no 32-bit seed of that search (nor the true fold) gives the
    mask."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
    from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_extract, parameters_subtraction
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE, Key

    from fedllm.secagg.bounds import clipping_range, quantization_bits

    target = 104

    def late(stage, node, c):
        if stage == "unmask" and node != target:
            c[Key.ACTIVE_NODE_ID_LIST] = [n for n in c[Key.ACTIVE_NODE_ID_LIST] if n != target]
            c[Key.DEAD_NODE_ID_LIST] = [*c[Key.DEAD_NODE_ID_LIST], target]

    if not guarded:
        unguarded(monkeypatch)
    server_sends(monkeypatch, late)
    vectors = clipped_vectors(5, 400, seed=21)
    _, _, grid = protocol_round(secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True)
    pk1, masked, replies = server_view(grid, target)
    assert masked is not None and len(replies) == 5  # every site answered: this much the protocol allows
    own_shares = [  # shares of 104's secret key, from the sites told it dropped
        s
        for node, nids, shares in replies
        if node != target
        for n, s in zip(nids, shares, strict=True)
        if n == target
    ]
    left = strip_pairwise(secure_cfg, target, masked, pk1, own_shares[:3])
    seed = SecAggPlusState(**dict(grid.contexts[target].state.config_records[RECORD_KEY_STATE])).rd_seed
    fold = 0
    for i in range(0, len(seed), 4):
        fold ^= int.from_bytes(seed[i : i + 4], "little")
    mod, q = 2**secure_cfg.secagg.modulus_bits, 2 ** quantization_bits(secure_cfg)
    found = None
    for candidate in range(max(0, fold - 2048), fold + 2048):
        gen = np.random.RandomState(candidate)  # Flower's draw from a 32-bit seed
        mask = [np.array(gen.randint(0, mod - 1), dtype=np.int64) if not a.shape else
                gen.randint(0, mod - 1, a.shape, dtype=np.int64) for a in left]  # fmt: skip
        values = [np.mod(v, mod) for v in parameters_subtraction(left, mask)]
        if all(int(v.max(initial=0)) <= q for v in values[1:]):  # one site's quantized values, in range
            found = values
            break
    if guarded:
        assert found is None
    else:
        assert found is not None
        _, arrays = factor_extract(found)
        got = dequantize(arrays, clipping_range(secure_cfg), q)[0]
        assert np.abs(got - vectors[target]).max() <= quantization_error(secure_cfg)


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_second_run_of_the_same_round_does_not_give_a_sites_update(tmp_path, monkeypatch, guarded):
    """Run 1: sites 100-103, round 1; run 2 (a new Flower run: new contexts) from the same start: sites
    101-103, round 1 again. A site's training from the same start is the same in both, so 4 x the first mean
    minus 3 x the second is site 100's change. Under Flower's mod alone (its "once per round" record lived in
    the run's context.state) the server gets both sums; fedllm's sites keep the record in their state folder,
    per trajectory, and refuse run 2's training."""
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            "federation.num_clients=4",
            "federation.weighting=uniform",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
        ),
    )
    vectors = clipped_vectors(4, 300, seed=5)
    if not guarded:
        unguarded(monkeypatch)
    errors = site_errors(monkeypatch)
    sites = StateSites(tmp_path / "sites", list(vectors)) if guarded else None
    first, nodes, _ = protocol_round(cfg, vectors, {n: 1 for n in vectors}, sites=sites)
    assert nodes == [100, 101, 102, 103]
    rest = {n: v for n, v in vectors.items() if n != 100}
    second, _, _ = protocol_round(cfg, rest, {n: 1 for n in rest}, deviating=True, sites=sites)
    if guarded:
        assert (
            second is None
            and len(errors) == 3
            and all("round 1 that this site's federation has had already" in e for e in errors)
        )
    else:
        got = 4 * first - 3 * second
        assert np.abs(got - vectors[100]).max() <= 8 * quantization_error(cfg)
        assert np.corrcoef(got, vectors[100])[0, 1] > 0.9999


def bound(federation, vectors) -> callable:
    """Each node's node config in a federation whose sites hold their node keys and its registry: node n is
    client n - 100."""
    return lambda n: federation.node_config(n, n - 100)


def test_a_round_of_bound_sites_sums_as_a_plain_round_does(secure_cfg, federation):
    """5 sites with their node keys and the federation's registry: each signs its keys, checks its
    neighbours', signs the survivors list and checks theirs; the unmasked mean is the plain mean within the
    quantization (the binding adds messages, not error)."""
    vectors = clipped_vectors(5, 300, seed=2)
    mean, nodes, grid = protocol_round(
        secure_cfg, vectors, {n: 1 for n in vectors}, node_config=bound(federation, vectors)
    )
    assert nodes == sorted(vectors)
    plain = np.mean([vectors[n] for n in nodes], axis=0)
    assert np.abs(mean - plain).max() <= quantization_error(secure_cfg)
    stages = [stage for _, stage, _ in grid.received]
    assert stages.count("fedllm-consistency") == 5  # the survivors' round: one more message per site


@pytest.mark.parametrize("guarded", [False, True], ids=["flowers-mod-alone", "fedllm-site"])
def test_a_server_that_swaps_in_its_own_keys_cannot_read_a_sites_shares(
    secure_cfg, monkeypatch, federation, guarded
):
    """5 sites, threshold 3. The server hands site 100 keys of its own in place of each real neighbour's
    (a key-agreement relayed unauthenticated): 100 encrypts its mask seed's shares to the server, which reads
    them, answers 100's collect stage as its fake neighbours, and strips every mask from 100's vector. Under
    Flower's mod alone it rebuilds 100's exact vector; fedllm's bound sites refuse keys that no registered
    node key signed, before sharing anything."""
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        decrypt,
        encrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
    from flwr.common.secure_aggregation.secaggplus_utils import (
        share_keys_plaintext_concat,
        share_keys_plaintext_separate,
    )
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_public_key,
        generate_key_pairs,
        public_key_to_bytes,
    )

    from fedllm.secagg.bounds import clipping_range, quantization_bits

    target = 100
    fakes = {}  # neighbour -> the server's (sk1, pk1, sk2, pk2) in its place
    seen: dict = {}
    original = VectorGrid.send_and_receive

    def swapping(self, messages, timeout=None):
        for m in messages:
            records = m.content.config_records
            if RECORD_KEY_CONFIGS not in records:
                continue
            c, node = records[RECORD_KEY_CONFIGS], m.metadata.dst_node_id
            if c["stage"] == "share_keys" and node == target:
                for k in [k for k in c if k.isdigit() and int(k) != target]:
                    sk1, pk1 = generate_key_pairs()
                    sk2, pk2 = generate_key_pairs()
                    fakes[int(k)] = (sk1, pk1, sk2, pk2)
                    c[k] = [public_key_to_bytes(pk1), public_key_to_bytes(pk2)]
            if c["stage"] == "collect_masked_vectors":
                if node == target:  # "from" each fake neighbour, a share of nothing, under its fake key
                    pk2_t = bytes_to_public_key(seen["pk2"])
                    c[Key.SOURCE_LIST] = list(fakes)
                    c[Key.CIPHERTEXT_LIST] = [
                        encrypt(
                            generate_shared_key(f[2], pk2_t),
                            share_keys_plaintext_concat(j, target, b"x", b"y"),
                        )
                        for j, f in fakes.items()
                    ]
                else:  # the others do without the target's shares, which the server took
                    keep = [i for i, src in enumerate(c[Key.SOURCE_LIST]) if src != target]
                    c[Key.SOURCE_LIST] = [c[Key.SOURCE_LIST][i] for i in keep]
                    c[Key.CIPHERTEXT_LIST] = [c[Key.CIPHERTEXT_LIST][i] for i in keep]
        replies = original(self, messages, timeout)
        for r in replies:
            if r.has_error() or r.metadata.src_node_id != target:
                continue
            c = r.content.config_records.get(RECORD_KEY_CONFIGS, {})
            if Key.PUBLIC_KEY_2 in c:
                seen["pk1"], seen["pk2"] = c[Key.PUBLIC_KEY_1], c[Key.PUBLIC_KEY_2]
            if Key.CIPHERTEXT_LIST in c and Key.DESTINATION_LIST in c:  # its shares, under the fake keys
                pk2_t = bytes_to_public_key(seen["pk2"])
                seen["seed_shares"] = [
                    share_keys_plaintext_separate(decrypt(generate_shared_key(fakes[j][2], pk2_t), ct))[2]
                    for j, ct in zip(c[Key.DESTINATION_LIST], c[Key.CIPHERTEXT_LIST], strict=True)
                ]
            if Key.MASKED_PARAMETERS in c:
                seen["masked"] = [bytes_to_ndarray(b) for b in c[Key.MASKED_PARAMETERS]]
        return replies

    if not guarded:
        unguarded(monkeypatch)
    monkeypatch.setattr(VectorGrid, "send_and_receive", swapping)
    errors = site_errors(monkeypatch)
    vectors = clipped_vectors(5, 300, seed=4)
    protocol_round(
        secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=bound(federation, vectors)
    )
    if guarded:
        assert "seed_shares" not in seen and "masked" not in seen
        assert any("not signed by client" in e for e in errors), errors
        return
    draw = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod").pseudo_rand_gen
    mod, q = 2**secure_cfg.secagg.modulus_bits, 2 ** quantization_bits(secure_cfg)
    assert "masked" in seen, errors
    masked = seen["masked"]
    shapes = get_parameters_shape(masked)
    vec = parameters_subtraction(masked, draw(combine_shares(seen["seed_shares"][:3]), mod, shapes))
    pk1_t = bytes_to_public_key(seen["pk1"])
    for j, (sk1, *_) in fakes.items():
        mask = draw(generate_shared_key(sk1, pk1_t), mod, shapes)
        vec = parameters_subtraction(vec, mask) if target > j else parameters_addition(vec, mask)
    _, arrays = factor_extract(parameters_mod(vec, mod))
    got = dequantize(arrays, clipping_range(secure_cfg), q)[0]
    assert np.abs(got - vectors[target]).max() <= quantization_error(secure_cfg)


def test_a_site_answers_only_the_survivors_list_it_signed_and_a_threshold_signed(
    secure_cfg, federation, monkeypatch
):
    """Bell et al.'s consistency round. The server shows every site one survivors list, then an unmask
    message with another (104 moved to the dropped): every bound site refuses it, so no share leaves. And a
    list signed by fewer than the threshold (the server drops the others' signatures) is refused too."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    from fedllm.secagg import binding

    for edit, says in (
        ("other-list", "not the list this site signed"),
        ("few-signatures", "survivors signed"),
    ):

        def deviate(stage, node, c, edit=edit):
            if stage == "unmask" and edit == "other-list":
                c[Key.ACTIVE_NODE_ID_LIST] = [n for n in c[Key.ACTIVE_NODE_ID_LIST] if n != 104]
                c[Key.DEAD_NODE_ID_LIST] = [*c[Key.DEAD_NODE_ID_LIST], 104]
            if stage == "unmask" and edit == "few-signatures":
                c[binding.SIGNERS], c[binding.SIGNATURES] = c[binding.SIGNERS][:2], c[binding.SIGNATURES][:2]

        with monkeypatch.context() as m:
            server_sends(m, deviate)
            errors = site_errors(m)
            vectors = clipped_vectors(5, 40, seed=6)
            mean, _, grid = protocol_round(
                secure_cfg,
                vectors,
                {n: 1 for n in vectors},
                deviating=True,
                node_config=bound(federation, vectors),
            )
            assert mean is None and not [r for r in grid.received if r[1] == "unmask"]
            unmasked = [e for e in errors if says in e]
            assert len(unmasked) >= 4, errors  # 104 itself is told it dropped: it refuses as before


def test_a_pinned_site_without_its_federations_registry_refuses_to_start(federation):
    """A site pinned to secure aggregation must be able to check its neighbours' keys: without the registry
    in its node config it refuses the setup, saying what to give it."""
    from flwr.app import Context, RecordDict

    app, _, _ = vector_app({100: np.zeros(3)}, {100: 1})
    config = {"secure-aggregation": "required", "client-id": 0, "sign-key": str(federation.keys[0])}
    ctx = Context(run_id=1, node_id=100, node_config=config, state=RecordDict(), run_config={})
    (reply,) = VectorGrid(app, {100: ctx}).send_and_receive([setup_message(100, 5, 5, 4)])
    assert reply.has_error() and "registry=PATH" in reply.error.reason


def test_a_config_with_smaller_neighbourhoods_is_refused_before_any_run(tmp_path):
    """secagg.num_shares below 1 (SecAgg+'s overlapping neighbourhoods) is refused with the reason: no site
    of fedllm takes part in such a round (the setup check above)."""
    with pytest.raises(ConfigError, match="secagg.num_shares"):
        load_config(None, tiny_overrides(tmp_path, "flower.secure_aggregation=true", "secagg.clip_norm=1",
                                          "secagg.num_shares=0.8"))  # fmt: skip


def test_bound_sites_sum_with_flowers_64_bit_node_ids(secure_cfg, federation):
    """Flower's run and node ids are random 64-bit values, half of them at or above 2^63: the signed digests
    frame them unsigned (a signed framing failed every such round)."""
    big = {2**63 + 5 + i: v for i, v in enumerate(clipped_vectors(5, 40, seed=12).values())}
    clients = {n: k for k, n in enumerate(sorted(big))}
    mean, nodes, _ = protocol_round(
        secure_cfg, big, {n: 1 for n in big}, node_config=lambda n: federation.node_config(n, clients[n])
    )
    assert nodes == sorted(big)
    assert np.abs(mean - np.mean(list(big.values()), axis=0)).max() <= quantization_error(secure_cfg)


def test_a_trajectory_is_what_decides_the_update_not_the_servers_other_settings(tmp_path):
    """The once-a-round record is keyed by what decides a site's update: a server that changes a timeout,
    the evaluation or secure aggregation's own settings keeps the trajectory (so it cannot make a site train
    the same round again by renaming it); a change of what the site trains (its learning rate) is another
    trajectory, whose updates differ."""
    from fedllm.secagg.flower import training_digest

    base = ["federation.num_clients=4", "flower.secure_aggregation=true", "secagg.clip_norm=1"]

    def digest(*extra):
        return training_digest(load_config(None, tiny_overrides(tmp_path, *base, *extra)))

    same = digest()
    for cosmetic in (
        "secagg.timeout_s=7",
        "federation.client_timeout_s=9",
        "eval.limit=3",
        "federation.min_clients=4",
    ):
        assert digest(cosmetic) == same, cosmetic
    assert digest("client.lr=0.01") != same and digest("federation.seed=5") != same


@pytest.mark.parametrize(
    "edit, says",
    [
        ("consistency-before-collect", "expected after the collect"),
        ("second-list", "a second survivors list"),
        ("client-as-bool", "claim no client"),
        ("client-as-text", "claim no client"),
        ("share-keys-replayed", "expected after 'setup'"),
    ],
)
def test_a_bound_site_refuses_what_the_protocol_never_sends(secure_cfg, federation, monkeypatch, edit, says):
    """What a server can still try once keys are bound: a survivors list before the masked vectors, a second
    and different list in the same round, one registered client under two nodes, a client id that is not an
    integer, a share-keys message after the collect (to rewrite what the site keeps of the round): each is
    refused before the site answers."""
    from fedllm.secagg import binding

    sent: dict = {}
    injected: list[str] = []  # the site's answers to what the server slipped in
    original = VectorGrid.send_and_receive

    def slip(self, message, timeout):
        injected.extend(r.error.reason for r in original(self, [message], timeout) if r.has_error())

    def deviating(self, messages, timeout=None):
        messages = list(messages)
        for m in messages:
            c = m.content.config_records.get("secaggplus_configs")
            if c is None:
                continue
            stage, node = c["stage"], m.metadata.dst_node_id
            if stage == "share_keys":
                sent.setdefault("share_keys", copy.deepcopy(m))
                if edit in ("client-as-bool", "client-as-text") and node == 100:
                    c[binding.NEIGHBOUR_CLIENT + "101"] = True if edit == "client-as-bool" else "1"
            if stage == "collect_masked_vectors" and edit == "consistency-before-collect" and node == 100:
                early = copy.deepcopy(m)
                early.content.config_records["secaggplus_configs"] = type(c)(
                    {"stage": binding.CONSISTENCY, binding.SURVIVORS: [100, 101, 102, 103, 104]}
                )
                slip(self, early, timeout)
            if stage == binding.CONSISTENCY and edit == "second-list" and node == 100:
                other = copy.deepcopy(m)
                other.content.config_records["secaggplus_configs"][binding.SURVIVORS] = [100, 101, 102, 103]
                slip(self, m, timeout)  # the list it signs ...
                messages[messages.index(m)] = other  # ... then another
            if stage == "unmask" and edit == "share-keys-replayed" and node == 100:
                slip(self, copy.deepcopy(sent["share_keys"]), timeout)
        return original(self, messages, timeout)

    monkeypatch.setattr(VectorGrid, "send_and_receive", deviating)
    errors = site_errors(monkeypatch)
    vectors = clipped_vectors(5, 40, seed=13)
    protocol_round(
        secure_cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=bound(federation, vectors)
    )
    assert any(says in e for e in errors + injected), errors + injected


def test_one_registered_client_under_two_nodes_is_refused(tmp_path, federation):
    """A site that colludes with the server runs a second node with its own registered key, to fill a round
    with nodes it controls: every bound site refuses a round in which one client appears as two nodes."""
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            "federation.num_clients=6",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
        ),
    )
    vectors = clipped_vectors(6, 30, seed=14)
    clients = {100: 0, 101: 1, 102: 2, 103: 3, 104: 4, 105: 1}  # 105 signs with client 1's key
    errors: list[str] = []
    original = VectorGrid.send_and_receive

    def recording(self, messages, timeout=None):
        replies = original(self, messages, timeout)
        errors.extend(r.error.reason for r in replies if r.has_error())
        return replies

    VectorGrid.send_and_receive = recording
    try:
        mean, _, _ = protocol_round(
            cfg, vectors, {n: 1 for n in vectors}, deviating=True,
            node_config=lambda n: federation.node_config(n, clients[n]),
        )  # fmt: skip
    finally:
        VectorGrid.send_and_receive = original
    assert mean is None and any("client 1 appears as two nodes" in e for e in errors), errors
