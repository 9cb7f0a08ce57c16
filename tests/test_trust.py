"""The server believes nothing a client says: every hostile or broken update is refused or made harmless at
``finish_round``, the round goes on, later rounds are normal, and nothing a client sends raises."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, GlobalState
from fedllm.checks import cap_weights
from fedllm.client.scaffold import ScaffoldServer
from fedllm.factors import LoraFactors
from fedllm.protocol import ClientInfo, ClientUpdate
from fedllm.server import Server, ServerPolicy

MODULES = {"l0.q_proj": (6, 5), "l0.v_proj": (6, 5)}
RANKS, COUNTS, SCALE = (4, 4, 8, 8), (10, 20, 30, 40), 2.0


def make_server(strategy="fedit", algorithm=None, ranks=RANKS, **policy) -> Server:
    policy.setdefault("clip_norm_ratio", 2.0)
    strat = STRATEGIES[strategy]() if isinstance(strategy, str) else strategy
    return Server(
        strategy=strat,
        clients=[ClientInfo(k, r, SCALE, n) for k, (r, n) in enumerate(zip(ranks, COUNTS, strict=True))],
        modules=MODULES,
        algorithm=algorithm,
        dense={"model.embed_tokens.weight": torch.zeros(7, 3)},
        policy=ServerPolicy(**policy),
    )


def honest(server: Server, plan, k: int, size: float = 0.01, seed: int = 0) -> ClientUpdate:
    """What a well-behaved client sends: its reference plus a small change, the registered count."""
    gen = torch.Generator().manual_seed(seed * 100 + k * 7 + plan.round)
    ref = server.reference(plan.round, k, plan.starts[k])
    factors = {
        key: LoraFactors(
            f.A + size * torch.randn(f.A.shape, generator=gen),
            f.B + size * torch.randn(f.B.shape, generator=gen),
            f.scale,
        )
        for key, f in ref.items()
    }
    dense = {n: t + size * torch.randn(t.shape, generator=gen) for n, t in plan.starts[k].dense.items()}
    metrics = {"loss_first": 2.0, "loss_last": 1.0, "loss_mean": 1.5, "train_s": 0.1, "steps": 3}
    return ClientUpdate(
        k, server.clients[k].num_examples, factors, dense, {}, metrics, round=plan.round, token=plan.token
    )


def round_with(server: Server, r: int, bad: dict[int, object]):
    plan = server.plan_round(r)
    results = {k: bad[k] if k in bad else honest(server, plan, k) for k in plan.active}
    return plan, server.finish_round(
        plan, {k: v(server, plan, k) if callable(v) else v for k, v in results.items()}
    )


def edited(**change):
    """A hostile client: an honest update with ``change`` applied (field values or functions of them)."""

    def make(server, plan, k):
        u = honest(server, plan, k)
        for field, value in change.items():
            setattr(u, field, value(getattr(u, field)) if callable(value) else value)
        return u

    return make


def expect_refused(report, client: int, reason: str):
    row = report.row
    assert str(client) in row["failed"], row["failed"]
    assert reason in row["failed"][str(client)], row["failed"][str(client)]
    assert row["n_updates"] == 3 and not row["skipped"]


@pytest.mark.parametrize("count", [10**12, -5, 0, float("nan"), 11, "10"])
def test_a_claimed_example_count_is_refused_and_weights_come_from_the_server(count):
    server = make_server()
    plan, report = round_with(server, 1, {0: edited(num_examples=count)})
    expect_refused(report, 0, "examples; 10 are registered")
    # the global adapter is the honest three's, weighted by the server's counts 20, 30, 40
    honest_ups = [server.accept(honest(server, plan, k), server.expected(k)) for k in (1, 2, 3)]
    want = STRATEGIES["fedit"]().aggregate(honest_ups, GlobalState(), [20 / 90, 30 / 90, 40 / 90])
    for key, f in want.state.factors.items():
        assert_close(server.state.factors[key].delta(), f.delta())
    _, later = round_with(server, 2, {})
    assert later.row["n_updates"] == 4 and not later.row["failed"]  # the next round is normal


@pytest.mark.parametrize("scale", [1e6, float("nan"), -2.0, "big"])
def test_a_claimed_scale_is_refused(scale):
    def lie(factors):
        return {k: LoraFactors(f.A, f.B, scale) for k, f in factors.items()}

    _, report = round_with(make_server(), 1, {2: edited(factors=lie)})
    expect_refused(report, 2, "scale")


def test_clipping_measures_the_change_from_what_the_server_sent():
    """A 1e4x change is clipped to ratio x the median change, measured from the server's own reference."""
    server = make_server(clip_norm_ratio=2.0)
    plan = server.plan_round(1)
    ups = {k: honest(server, plan, k) for k in plan.active}
    ref = server.reference(1, 3, plan.starts[3])
    ups[3].factors = {
        k: LoraFactors(ref[k].A + 1e4 * (f.A - ref[k].A), ref[k].B + 1e4 * (f.B - ref[k].B), f.scale)
        for k, f in ups[3].factors.items()
    }
    changes = {k: server.change(plan, server.accept(u, server.expected(k))) for k, u in ups.items()}
    norms = {k: math.sqrt(sum(float((v - r).pow(2).sum()) for v, r in c)) for k, c in changes.items()}
    report = server.finish_round(plan, ups)
    assert report.row["agg_clipped"] == 1 and not report.row["failed"]
    median = float(torch.tensor(list(norms.values())).median())
    assert report.row["agg_update_norm_median"] == pytest.approx(median, rel=1e-6)
    # the clipped update moved the average no more than ratio x median from the reference
    honest_only = {k: u for k, u in ups.items() if k != 3}
    assert norms[3] > 1e3 * median and max(norms[k] for k in honest_only) < 2 * median


def bad_shapes(edit):
    def change(factors):
        key = next(iter(factors))
        return {**factors, key: edit(factors[key])}

    return change


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(factors=bad_shapes(lambda f: LoraFactors(f.A[:, :-1], f.B, f.scale))), "shape"),  # input dim
        (dict(factors=bad_shapes(lambda f: LoraFactors(f.A, f.B[:, :-1], f.scale))), "shape"),  # B's rank
        (dict(factors=bad_shapes(lambda f: LoraFactors(f.A[:-1], f.B[:, :-1], f.scale))), "shape"),  # both
        (dict(factors=lambda fs: dict(list(fs.items())[:1])), "modules differ"),  # a missing module
        (
            dict(factors=lambda fs: {**fs, "l9.o_proj": next(iter(fs.values()))}),
            "modules differ",
        ),  # an extra one
        (dict(factors={}), "modules differ"),  # no module at all (the lowest id erased the adapter before)
        (dict(factors=None), "not a mapping"),
        (dict(dense=lambda d: {k: torch.zeros(8, 3) for k in d}), "shape"),  # a dense module of another shape
        (dict(dense={}), "dense modules"),
        (dict(factors=bad_shapes(lambda f: LoraFactors(f.A.long(), f.B, f.scale))), "dtype"),  # int64
        (dict(factors=bad_shapes(lambda f: LoraFactors(f.A, f.B * float("inf"), f.scale))), "non-finite"),
        (dict(factors=bad_shapes(lambda f: LoraFactors(f.A.double() * 1e300, f.B, f.scale))), "non-finite"),
        (dict(extras={"steal": torch.ones(3)}), "unexpected extra"),
        (dict(client_id=3), "claims to be client 3"),
    ],
)
def test_a_malformed_update_is_that_clients_failure_only(change, reason):
    server = make_server()
    _, report = round_with(server, 1, {0: edited(**change)})
    expect_refused(report, 0, reason)
    assert set(server.state.factors) == set(MODULES)  # the global adapter keeps every module
    for f in server.state.factors.values():
        assert f.A.dtype == torch.float32 and torch.isfinite(f.A).all() and torch.isfinite(f.B).all()
    _, later = round_with(server, 2, {})
    assert later.row["n_updates"] == 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_precisions_are_taken_as_float32(dtype):
    server = make_server()
    _, report = round_with(
        server,
        1,
        {
            1: edited(
                factors=lambda fs: {
                    k: LoraFactors(f.A.to(dtype), f.B.to(dtype), f.scale) for k, f in fs.items()
                }
            )
        },
    )
    assert not report.row["failed"] and report.row["n_updates"] == 4
    assert all(
        f.A.dtype == torch.float32 and f.B.dtype == torch.float32 for f in server.state.factors.values()
    )


def test_not_an_update_at_all_and_bad_metrics_never_raise():
    server = make_server()
    _, report = round_with(
        server,
        1,
        {
            0: {"factors": "everything"},  # not a ClientUpdate
            1: edited(metrics={"loss_mean": "low", "loss_first": float("nan"), "train_s": [1]}),
            2: edited(metrics=None),
        },
    )
    assert "not a client update" in report.row["failed"]["0"]
    assert report.row["n_updates"] == 3 and report.row["train_loss"] == pytest.approx(1.5)  # client 3's only
    assert report.row["client_loss"]["1"] == [None, None]  # its NaN and its string were dropped


def test_an_aggregate_that_fails_skips_the_round_and_keeps_the_state(monkeypatch):
    server = make_server()
    round_with(server, 1, {})
    before = {k: f.delta().clone() for k, f in server.state.factors.items()}

    def broken(*args, **kwargs):
        raise RuntimeError("linalg.svd: the algorithm failed to converge")

    monkeypatch.setattr(server.strategy, "aggregate", broken)
    _, report = round_with(server, 2, {})
    assert report.row["skipped"] and "failed to converge" in report.row["agg_error"]
    for k, d in before.items():
        assert torch.equal(server.state.factors[k].delta(), d)
    assert server.last_aggregated == {0: 1, 1: 1, 2: 1, 3: 1}  # nobody's round-2 update was taken


def test_weights_examples_uniform_and_capped():
    server = make_server()
    ups = [ClientUpdate(k, COUNTS[k], {}) for k in range(4)]
    assert server.weights(ups) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    server.policy.weighting = "uniform"
    assert server.weights(ups) == pytest.approx([0.25] * 4)
    server.policy.weighting, server.policy.max_client_weight = "examples", 0.3
    # 0.4 -> 0.3; then 0.3 * 0.7 / 0.6 = 0.35 -> 0.3; the last 0.4 goes to 0.1 and 0.2 in proportion
    assert server.weights(ups) == pytest.approx([0.4 / 3, 0.8 / 3, 0.3, 0.3])
    assert cap_weights([0.9, 0.05, 0.05], 0.5) == pytest.approx([0.5, 0.25, 0.25])
    assert cap_weights([0.7, 0.2, 0.1], 0.2) == pytest.approx([1 / 3] * 3)  # no share can meet 0.2: uniform


@pytest.mark.parametrize(("rule", "want"), [("median", 2.0), ("trimmed_mean", 2.5)])
def test_robust_aggregates_hand_computed(rule, want):
    strategy = STRATEGIES["fedit"](robust=rule, trim_fraction=0.25)
    values = [1.0, 2.0, 3.0, 1e6]  # one client sends an extreme value
    ups = [
        ClientUpdate(k, 10, {"m": LoraFactors(torch.full((1, 2), v), torch.full((2, 1), v), 1.0)})
        for k, v in enumerate(values)
    ]
    g = strategy.aggregate(ups, GlobalState()).state.factors["m"]
    assert_close(g.A, torch.full((1, 2), want)) and assert_close(g.B, torch.full((2, 1), want))


def test_scaffold_extras_are_checked_and_bounded_like_the_model_update():
    server = make_server(algorithm=ScaffoldServer())
    plan = server.plan_round(1)
    shapes = server.expected(0).param_shapes()

    def with_dc(k, scale=1e-3, shape_of=None):
        u = honest(server, plan, k)
        shapes_k = server.expected(k).param_shapes()
        u.extras = {f"dc.{n}": scale * torch.ones(shape_of or s) for n, s in shapes_k.items()}
        return u

    ups = {0: with_dc(0, 1e30), 1: with_dc(1), 2: with_dc(2), 3: with_dc(3)}
    bad = with_dc(1)
    bad.extras["dc.l0.q_proj.A"] = torch.ones(3, 3)
    report = server.finish_round(plan, {**ups, 1: bad})
    assert "dc.l0.q_proj.A has shape" in report.row["failed"]["1"]
    assert report.row["agg_algo_clipped"] == 1
    assert all(torch.isfinite(t).all() and t.abs().max() < 1 for t in server.algorithm.c.values())
    assert set(server.algorithm.c) == set(shapes) and server.algorithm.c["l0.q_proj.A"].shape == (8, 5)


@pytest.mark.parametrize("probs", [[1e9, 1e9], [1.5, -0.5], [0.5, float("nan")], [1.0]])
def test_floral_router_probabilities_must_be_on_the_simplex(probs):
    server = make_server("floral", ranks=(4, 4, 4, 4))
    plan = server.plan_round(1)
    ups = {}
    for k in plan.active:
        u = honest(server, plan, k)
        u.extras = {f"router_probs.{m}": torch.tensor([0.5, 0.5]) for m in MODULES}
        ups[k] = u
    ups[2].extras = {f"router_probs.{m}": torch.tensor(probs) for m in MODULES}
    report = server.finish_round(plan, ups)
    expect_refused(report, 2, "router_probs")


def tiny_run(tmp_path, name, fault=None, *extra):
    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import faulty, tiny_overrides

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / name,
            "client.local_steps=8",
            "federation.rounds=3",
            "eval.personalized=false",
            "data.eval_size=40",
            *extra,
        ),
    )
    sim = faulty(Simulation)(cfg, tmp_path / name, fault=fault)
    sim.setup()
    summary = sim.run()
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return sim, summary, rows


def hostile_30x(r, k, u):
    if k == 0:  # 30 x its honest change, measured from what it downloaded
        u.factors = {key: LoraFactors(30 * f.A, 30 * f.B, f.scale) for key, f in u.factors.items()}
        u.dense = {n: 30 * t for n, t in u.dense.items()}
    return u


def lying(field, value):
    def fault(r, k, u):
        if k == 0:
            setattr(u, field, value) if field != "scale" else setattr(
                u, "factors", {key: LoraFactors(f.A, f.B, value) for key, f in u.factors.items()}
            )
        return u

    return fault


def crashed(r, k, u):
    if k == 0:
        raise RuntimeError("gone")
    return u


@pytest.mark.slow
def test_a_hostile_client_end_to_end_is_contained(tmp_path, builtin_base):
    """One of four clients lies (a 1e12 count, a NaN scale) or sends 30x its honest update: the run finishes
    normally; the liar is left out every round (the run equals one without it), and, under the clip a
    federation of other organizations gets, the 30x client is clipped to the honest clients' size (the model
    stays within noise of the honest run, unlike without clipping)."""
    _, honest_summary, _ = tiny_run(tmp_path, "honest")
    _, without, _ = tiny_run(tmp_path, "without", crashed)
    for name, fault in [("count", lying("num_examples", 10**12)), ("scale", lying("scale", float("nan")))]:
        _, summary, rows = tiny_run(tmp_path, name, fault)
        assert all("0" in r["failed"] and r["n_updates"] == 3 for r in rows[1:])
        assert summary["loss_after"] == pytest.approx(without["loss_after"], rel=1e-5)
    # the clip a Flower federation settles on (aggregation.clip_norm_ratio=auto across organizations)
    _, clipped, rows = tiny_run(tmp_path, "clipped", hostile_30x, "aggregation.clip_norm_ratio=2")
    assert all(r["agg_clipped"] == 1 for r in rows[1:])
    _, unclipped, _ = tiny_run(tmp_path, "unclipped", hostile_30x, "aggregation.clip_norm_ratio=0")
    base = honest_summary["loss_after"]  # 0.78 on one machine; clipped 0.73, unclipped about 1000
    assert abs(clipped["loss_after"] - base) < 0.1 * base
    assert unclipped["loss_after"] > 10 * base


def test_scaffold_state_stays_in_step_with_the_server(tmp_path, builtin_base):
    """A client's new c_k counts only once the server took its update: after a skipped round (and at any
    time) the server's c equals sum_k p_k c_k over every client's committed c_k."""
    from fedllm.client.runtime import settle_pending

    def outage(r, k, u):
        if r == 2 and k != 0:  # only client 0 reports in round 2: below min_clients, the round is skipped
            raise RuntimeError("outage")
        return u

    sim, _, rows = tiny_run(
        tmp_path, "scaffold", outage, "client.algorithm=scaffold", "federation.min_clients=2"
    )
    assert rows[2]["skipped"] and sim.server.last_aggregated[0] == 3
    c = sim.server.algorithm.c
    p = sim.server.population_weights()
    for name, c_name in c.items():
        total = torch.zeros_like(c_name)
        for client in sim.clients:
            sim.store.load(client)
            state = settle_pending(client.state, sim.server.last_aggregated[client.client_id])
            ck = state.get(f"algo.{name}")
            if ck is not None:
                region = tuple(slice(0, s) for s in ck.shape)
                total[region] += p[client.client_id] * ck
        assert_close(total, c_name, rtol=1e-5, atol=1e-7)


# ---- the review's probes (corners of the boundary that did not hold) ----------------------------------


def test_a_shared_b_nobody_asked_for_is_refused_and_an_asked_one_is_clipped():
    """FedSA-LoRA with B never shared (the paper's protocol): a client sending a shared B of 1e6 is left out.
    On a sharing round the B travels, and a huge one is clipped with the update it came with."""
    from fedllm.aggregation.fedsa import B_SHARED

    def with_b(server, plan, k, value):
        u = honest(server, plan, k)
        rank = server.expected(k).rank
        u.factors = {m: LoraFactors(f.A, f.B[:, :0], f.scale) for m, f in u.factors.items()}
        u.extras = {f"{B_SHARED}{m}": torch.full((out_f, rank), value) for m, (out_f, _) in MODULES.items()}
        return u

    never = make_server(STRATEGIES["fedsa"](share_b_every=0))
    plan = never.plan_round(1)
    ups = {k: honest(never, plan, k) for k in plan.active}
    for k in ups:
        ups[k].factors = {m: LoraFactors(f.A, f.B[:, :0], f.scale) for m, f in ups[k].factors.items()}
    ups[1] = with_b(never, plan, 1, 1e6)
    report = never.finish_round(plan, ups)
    expect_refused(report, 1, "a shared B in a round that asked for none")
    every = make_server(STRATEGIES["fedsa"](share_b_every=1))
    plan = every.plan_round(1)
    ups = {k: with_b(every, plan, k, 0.01) for k in plan.active}
    ups[1] = with_b(every, plan, 1, 1e6)
    report = every.finish_round(plan, ups)
    assert report.row["agg_clipped"] == 1 and report.row["agg_b_sharers"] == 4
    assert float(every.state.factors["l0.q_proj"].B.abs().max()) < 1.0


def test_hetlora_norm_shares_obey_the_servers_cap():
    """With federation.max_client_weight 0.3, a 1e4x client (clipped to twice the median) weighs at most
    0.3 in HetLoRA's norm-proportional average."""
    server = make_server("hetlora", max_client_weight=0.3)
    report = round_with(
        server,
        1,
        {2: edited(factors=lambda f: {m: LoraFactors(x.A * 100, x.B * 100, x.scale) for m, x in f.items()})},
    )[1]
    assert report.row["agg_clipped"] == 1
    assert report.row["agg_norm_share_max"] <= 0.3 + 1e-9


def test_a_control_variate_that_would_overflow_skips_the_round_and_keeps_c_finite():
    """SCAFFOLD with clip_norm_ratio 0 (allowed): a client sending 3e38 control-variate changes four rounds
    in a row would make c infinite; the server refuses such a server state and keeps the last finite one."""
    server = make_server(algorithm=ScaffoldServer(), clip_norm_ratio=0)

    def flood(server, plan, k):
        u = honest(server, plan, k)
        u.extras = {f"dc.{n}": torch.full(s, 3e38) for n, s in server.expected(k).param_shapes().items()}
        return u

    skipped = []
    for r in range(1, 5):
        _, report = round_with(server, r, {0: flood, 1: flood, 2: flood, 3: flood})
        skipped.append(report.row["skipped"])
        assert all(torch.isfinite(t).all() for t in server.algorithm.c.values())
        assert all(torch.isfinite(t).all() for t in server.algorithm.download(8).values())
    assert any(skipped)


def test_a_replayed_update_is_refused():
    """An update recorded in round 1 and sent again in round 2 names round 1's plan: refused."""
    server = make_server()
    plan1 = server.plan_round(1)
    old = honest(server, plan1, 2)
    server.finish_round(plan1, {k: honest(server, plan1, k) for k in plan1.active})
    plan2 = server.plan_round(2)
    ups = {k: honest(server, plan2, k) for k in plan2.active}
    report = server.finish_round(plan2, {**ups, 2: old})
    expect_refused(report, 2, "answers round 1")


def test_reasons_are_one_line_and_the_run_folder_is_standard_json(tmp_path, builtin_base):
    """A sparse tensor is refused with a short reason (not PyTorch's dispatcher dump); a metric of 1e308
    is dropped (its mean would overflow); metrics.jsonl parses as standard JSON (no Infinity or NaN)."""
    server = make_server()
    plan = server.plan_round(1)
    ups = {k: honest(server, plan, k) for k in plan.active}
    f = ups[1].factors["l0.q_proj"]
    ups[1].factors["l0.q_proj"] = LoraFactors(f.A.to_sparse(), f.B, f.scale)
    ups[0].metrics = {**ups[0].metrics, "loss_mean": 1e308}
    ups[3].metrics = {**ups[3].metrics, "loss_mean": 1e308}
    report = server.finish_round(plan, ups)
    reason = report.row["failed"]["1"]
    assert "sparse" in reason and "\n" not in reason and len(reason) < 400
    assert math.isfinite(report.row["train_loss"])

    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")

    tiny_run(tmp_path, "json", lambda r, k, u: setattr(u, "metrics", {"loss_mean": 1e308}) or u)
    text = (tmp_path / "json" / "metrics.jsonl").read_text()
    assert all(json.loads(line, parse_constant=no_constants) for line in text.splitlines())


def test_local_dp_still_bounds_a_client_on_the_server(tmp_path, builtin_base):
    """Local DP noises each site's own update; the server's median-relative clip stays on, so a 1e4x update
    is scaled to a few honest (noised) ones' size instead of being taken whole."""

    def huge(r, k, u):
        if k == 1:
            u.factors = {m: LoraFactors(f.A * 100, f.B * 100, f.scale) for m, f in u.factors.items()}
        return u

    extra = (
        "privacy.mode=local",
        "privacy.clip_norm=0.5",
        "privacy.noise_multiplier=0.01",
        "privacy.noise_seed=0",
        "lora.trainable_modules=[]",
        "aggregation.clip_norm_ratio=2",  # the clip a federation of organizations gets (auto on Flower)
    )
    _, _, rows = tiny_run(tmp_path, "local", huge, *extra)
    assert all(r["agg_clipped"] >= 1 for r in rows[1:])


@pytest.mark.parametrize(
    "over", [[], pytest.param(["privacy.mode=central", "lora.trainable_modules=[]"], marks=pytest.mark.slow)]
)
def test_each_updates_reference_is_derived_once(tmp_path, builtin_base, monkeypatch, over):
    """The acceptance, the median clip, the strategy's context (and central DP's clip) all read what the
    client started from; the server derives it once per update and round."""
    from conftest import tiny_overrides

    from fedllm.cli import main

    calls: list[tuple[int, int]] = []
    derive = Server.derive_reference

    def counted(self, round_idx, client_id, start):
        calls.append((round_idx, client_id))
        return derive(self, round_idx, client_id, start)

    monkeypatch.setattr(Server, "derive_reference", counted)
    assert main(["run", *tiny_overrides(tmp_path / "run", *over)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(calls) == len(set(calls)) == sum(r["n_updates"] for r in rows) > 0


def test_fedsb_steps_and_r_are_checked_and_clipped():
    """Fed-SB's initialization round: a 1e6 dense step is clipped to twice the median, a step of the wrong
    shape is refused; from round 2: an R block of 1e6 is clipped, one at another rank's size refused, and
    the bases (which never travel up) stay what the server made."""
    from fedllm.aggregation.fedsb import CORE, STEP

    server = make_server("fedsb")

    def step(value, shape=None):
        def make(server, plan, k):
            u = honest(server, plan, k)
            u.extras = {
                f"{STEP}{m}": torch.full(shape or (out_f, in_f), value) * (1 + 0.1 * k)
                for m, (out_f, in_f) in MODULES.items()
            }
            return u

        return make

    _, report = round_with(server, 1, {k: step(0.01) for k in range(4)} | {2: step(1e6)})
    assert report.row["n_updates"] == 4 and report.row["agg_clipped"] == 1
    bases = {m: (f.A.clone(), f.B.clone()) for m, f in server.state.factors.items()}
    assert max(float(server.state.extras[f"{CORE}{m}"].abs().max()) for m in MODULES) < 1.0
    fresh = make_server("fedsb")
    _, report = round_with(fresh, 1, {k: step(0.01) for k in range(4)} | {1: step(0.01, (3, 3))})
    expect_refused(report, 1, "shape (3, 3), expected (6, 5)")

    def core(value, size=None):
        def make(server, plan, k):
            u = honest(server, plan, k)
            r = size or server.expected(k).rank
            R = plan.starts[k].extras
            u.extras = {f"{CORE}{m}": R[f"{CORE}{m}"][:r, :r] + value * (1 + 0.1 * k) for m in MODULES}
            return u

        return make

    _, report = round_with(server, 2, {k: core(0.01) for k in range(4)} | {3: core(1e6)} | {0: core(0.01, 8)})
    expect_refused(report, 0, "shape (8, 8), expected (4, 4)")
    assert report.row["agg_clipped"] == 1
    assert max(float(server.state.extras[f"{CORE}{m}"].abs().max()) for m in MODULES) < 1.0
    for m, (A, B) in bases.items():
        assert torch.equal(server.state.factors[m].A, A) and torch.equal(server.state.factors[m].B, B)


def test_each_clients_last_aggregated_round_survives_a_checkpoint_of_either_name():
    """The server keeps the last round whose aggregate used each client's update (what a client's pending
    state settles against); a checkpoint written before it was renamed from ``accepted`` still restores it."""
    server = make_server()
    plan = server.plan_round(1)
    server.finish_round(plan, {k: honest(server, plan, k, size=0.1, seed=k) for k in plan.active})
    assert server.last_aggregated == {k: 1 for k in server.clients}
    tensors, meta = server.state_dict()
    for name in ("last_aggregated", "accepted"):
        old = {**{k: v for k, v in meta.items() if k != "last_aggregated"}, name: meta["last_aggregated"]}
        fresh = make_server()
        fresh.load_state_dict(tensors, old)
        assert fresh.last_aggregated == {k: 1 for k in server.clients}
        assert fresh.client_start(2, 0).last_aggregated == 1


def test_the_clip_is_off_within_one_job_and_on_across_organizations(tmp_path, builtin_base):
    """aggregation.clip_norm_ratio=auto: a simulation (every client this job's own) clips nothing, so each
    strategy is its paper's; Flower's server (sites of other organizations) clips at 2x the median; either
    way the run's config.yaml records the ratio used, and an explicit value is kept as given."""
    from fedllm.config import CLIP_ACROSS_ORGANIZATIONS, load_config, settle_clip
    from fedllm.flower.server_app import FlowerDriver
    from fedllm.run.reader import RunFolder
    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    assert not Simulation.clients_are_organizations and FlowerDriver.clients_are_organizations
    assert load_config(None, []).aggregation.clip_norm_ratio == "auto"
    cfg = load_config(None, [])
    assert settle_clip(cfg, organizations=True) == CLIP_ACROSS_ORGANIZATIONS == 2.0
    assert cfg.aggregation.clip_norm_ratio == 2.0
    cfg = load_config(None, ["aggregation.clip_norm_ratio=1.5"])
    assert settle_clip(cfg, organizations=False) == 1.5
    cfg = load_config(None, tiny_overrides(tmp_path / "r", "federation.rounds=1", "eval.personalized=false"))
    sim = Simulation(cfg, tmp_path / "r")
    sim.setup()
    assert sim.server.policy.clip_norm_ratio == 0.0
    rows = (
        [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        if sim.run()
        else []
    )
    assert all(r.get("agg_clipped", 0) == 0 for r in rows)
    assert RunFolder(tmp_path / "r").config().aggregation.clip_norm_ratio == 0.0
    with pytest.raises(Exception, match="clip_norm_ratio"):
        load_config(None, ["aggregation.clip_norm_ratio=0.5"])
