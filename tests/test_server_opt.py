"""Server optimizers (aggregation.server_opt): Flower's own strategies on the same arrays, what each strategy
lets them step, the refusals, the wrapper's delegation, and a resumed run that continues exactly."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from fedllm.aggregation import STRATEGIES, GlobalState, RoundContext, Strategy
from fedllm.aggregation.base import StrategyWrapper
from fedllm.aggregation.server_opt import (
    PREFIX,
    SERVER_OPTIMIZERS,
    FedAdamOptions,
    FedAvgMOptions,
    FedYogiOptions,
    with_server_opt,
)
from fedllm.config import ConfigError, load_config
from fedllm.factors import LoraFactors
from fedllm.protocol import ClientUpdate

MODULES = {"q": (6, 5), "v": (4, 7)}  # key -> (out, in)
RANK = 3


def _flower(method: str, **kw):
    from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi

    cls = {"fedavgm": FedAvgM, "fedadagrad": FedAdagrad, "fedyogi": FedYogi, "fedadam": FedAdam}[method]
    return cls(fraction_train=1.0, min_train_nodes=3, min_available_nodes=3, **kw)


# the same hyperparameters for both sides, none of them a default (a swapped beta would show)
CASES = {
    "fedavgm": ({"server_learning_rate": 0.7, "server_momentum": 0.6}, {"eta": 0.7, "momentum": 0.6}),
    "fedadagrad": ({"eta": 0.05, "tau": 0.01}, {"eta": 0.05, "tau": 0.01}),
    "fedyogi": (
        {"eta": 0.03, "beta_1": 0.8, "beta_2": 0.95, "tau": 0.02},
        {"eta": 0.03, "beta_1": 0.8, "beta_2": 0.95, "tau": 0.02},
    ),
    "fedadam": (
        {"eta": 0.04, "beta_1": 0.85, "beta_2": 0.97, "tau": 0.005},
        {"eta": 0.04, "beta_1": 0.85, "beta_2": 0.97, "tau": 0.005},
    ),
}


class _Grid:
    def get_node_ids(self):
        return [11, 12, 13]


def _fresh() -> dict[str, LoraFactors]:
    g = torch.Generator().manual_seed(7)
    return {
        k: LoraFactors(torch.randn(RANK, i, generator=g) * 0.1, torch.zeros(o, RANK), 1.0)
        for k, (o, i) in MODULES.items()
    }


def _arrays(factors: dict[str, LoraFactors], dense: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out = {}
    for k, f in factors.items():
        out[f"{k}.A"], out[f"{k}.B"] = f.A.numpy(), (f.B * f.scale).numpy()
    out.update({f"dense.{k}": t.numpy() for k, t in dense.items()})
    return out


@pytest.mark.parametrize("method", sorted(CASES))
def test_each_server_optimizer_equals_flowers_strategy_on_the_same_arrays(method, monkeypatch):
    """Five rounds of three clients' changes (each client starting from the global point, weighted by its
    examples): fedllm's FedIT wrapped in the optimizer and Flower 1.42's strategy of the same name give the
    same new global arrays every round (float32 tolerance)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, attr, 1)
    flower_kw, ours_kw = CASES[method]
    flower = _flower(method, **flower_kw)
    ours = SERVER_OPTIMIZERS[method](STRATEGIES["fedit"](), SERVER_OPTIMIZERS[method].options(**ours_kw))
    fresh = _fresh()
    dense0 = {"norm": torch.ones(5)}
    state = GlobalState(dense=dict(dense0))
    flower_arrays = _arrays(fresh, dense0)  # round 1's clients start from the shared fresh init
    g = torch.Generator().manual_seed(3)
    counts = [5, 9, 2]
    for t in range(1, 6):
        start = state.factors or fresh
        start_dense = state.dense
        updates = []
        for cid, n in enumerate(counts):
            factors = {
                k: LoraFactors(
                    f.A + 0.05 * torch.randn(f.A.shape, generator=g),
                    f.B + 0.05 * torch.randn(f.B.shape, generator=g),
                    1.0,
                )
                for k, f in start.items()
            }
            dense = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in start_dense.items()}
            updates.append(ClientUpdate(cid, n, factors, dense))
        context = RoundContext(t, 3, [start] * 3, RANK, _fresh)
        state = ours.aggregate(updates, state, [n / sum(counts) for n in counts], context).state

        instructions = list(
            flower.configure_train(
                t,
                ArrayRecord({k: Array(v) for k, v in flower_arrays.items()}),
                ConfigRecord({}),
                _Grid(),
            )
        )
        replies = [
            Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({k: Array(v) for k, v in _arrays(u.factors, u.dense).items()}),
                        "metrics": MetricRecord({"num-examples": u.num_examples}),
                    }
                ),
                reply_to=m,
            )
            for u, m in zip(updates, instructions, strict=True)
        ]
        record, _ = flower.aggregate_train(t, replies)
        flower_arrays = {k: a.numpy() for k, a in record.items()}
        mine = _arrays(state.factors, state.dense)
        assert mine.keys() == flower_arrays.keys()
        for k, v in mine.items():
            np.testing.assert_allclose(v, flower_arrays[k], rtol=1e-5, atol=1e-6, err_msg=f"{method} {t} {k}")
    moved = max(float(np.abs(flower_arrays[k] - _arrays(fresh, dense0)[k]).max()) for k in flower_arrays)
    assert moved > 1e-3  # the optimizer stepped at all


def test_fedadam_without_bias_correction_is_the_papers_algorithm_2():
    """Reddi et al.'s Algorithm 2 by hand on one tensor: m, v and x_{t+1} = x_t + eta m / (sqrt(v) + tau)."""
    opts = FedAdamOptions(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, bias_correction=False)
    ours = SERVER_OPTIMIZERS["fedadam"](STRATEGIES["fedit"](), opts)
    x = {"q": LoraFactors(torch.full((1, 2), 0.5), torch.full((2, 1), 0.2), 1.0)}
    state = GlobalState(factors=x)
    m = v = torch.zeros(2, 1)
    xb = x["q"].B.clone()
    for t, target in enumerate([0.3, 0.1, 0.4], start=1):
        u = ClientUpdate(0, 1, {"q": LoraFactors(x["q"].A.clone(), torch.full((2, 1), target), 1.0)}, {})
        state = ours.aggregate([u], state, [1.0], RoundContext(t, 1, [state.factors], 1, lambda: {})).state
        d = target - xb
        m = 0.9 * m + 0.1 * d
        v = 0.99 * v + 0.01 * d * d
        xb = xb + 0.1 * m / (v.sqrt() + 1e-3)
        torch.testing.assert_close(state.factors["q"].B, xb)
        torch.testing.assert_close(state.factors["q"].A, x["q"].A)  # A's change was zero: no step
        # the uploaded B moved the state towards the target, not to it: the optimizer's step, not the average
        assert not torch.allclose(state.factors["q"].B, torch.full((2, 1), target))
    assert f"{PREFIX}m.q.B" in state.extras and f"{PREFIX}v.q.B" in state.extras


def test_fedavgm_with_no_momentum_and_unit_lr_is_the_inner_strategy():
    inner = STRATEGIES["fedit"]()
    ours = SERVER_OPTIMIZERS["fedavgm"](inner, FedAvgMOptions(eta=1.0, momentum=0.0))
    g = torch.Generator().manual_seed(0)
    start = _fresh()
    ups = [
        ClientUpdate(
            c,
            3 + c,
            {
                k: LoraFactors(torch.randn(f.A.shape, generator=g), torch.randn(f.B.shape, generator=g), 0.5)
                for k, f in start.items()
            },
            {},
        )
        for c in range(3)
    ]
    ctx = RoundContext(1, 3, [start] * 3, RANK, _fresh)
    a = ours.aggregate(ups, GlobalState(), None, ctx).state
    b = inner.aggregate(ups, GlobalState(), None, ctx).state
    for k in a.factors:
        torch.testing.assert_close(a.factors[k].A, b.factors[k].A)
        torch.testing.assert_close(a.factors[k].B, b.factors[k].B)


def test_ffa_steps_b_only_and_keeps_its_frozen_a():
    ffa = STRATEGIES["ffa"]()
    ours = SERVER_OPTIMIZERS["fedyogi"](ffa, FedYogiOptions(eta=0.05))
    state = GlobalState(ffa.initial_factors(MODULES, RANK, 0))
    g = torch.Generator().manual_seed(1)
    for t in (1, 2):
        ups = [
            ClientUpdate(
                c,
                4,
                {
                    k: LoraFactors(f.A, f.B + torch.randn(f.B.shape, generator=g), 1.0)
                    for k, f in state.factors.items()
                },
                {},
            )
            for c in range(2)
        ]
        new = ours.aggregate(ups, state, None, RoundContext(t, 2, [state.factors] * 2, RANK, _fresh)).state
        for k in MODULES:
            assert torch.equal(new.factors[k].A, state.factors[k].A)
            assert not torch.equal(new.factors[k].B, state.factors[k].B)
        assert not any(n.endswith(".A") for n in new.extras if n.startswith(PREFIX))
        state = new


def test_the_moments_never_travel_to_a_client():
    ours = SERVER_OPTIMIZERS["fedadam"](STRATEGIES["fedit"]())
    start = _fresh()
    ups = [ClientUpdate(0, 1, {k: LoraFactors(f.A + 0.1, f.B + 0.1, 1.0) for k, f in start.items()}, {})]
    state = ours.aggregate(ups, GlobalState(), None, RoundContext(1, 1, [start], RANK, _fresh)).state
    assert any(k.startswith(PREFIX) for k in state.extras)
    assert not any(k.startswith(PREFIX) for k in ours.client_extras(state, 0))
    assert ours.client_factors(state, RANK, 1.0, 0).keys() == MODULES.keys()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_config_refuses_a_server_optimizer_where_the_global_state_is_no_parameters(name):
    over = ["aggregation.server_opt=fedadam", f"aggregation.name={name}"]
    if name == "floral":
        over += ["lora.ranks=[4]"]
    if STRATEGIES[name].global_state == "parameters":
        assert load_config(None, over).aggregation.server_opt == "fedadam"
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, over)
    msg = str(e.value)
    assert "aggregation.server_opt = fedadam" in msg and f"aggregation.name = {name}" in msg
    assert "use it with fedit, fedsa, fedsb, ffa, hetlora, rolora" in msg and "\n" not in msg


def test_the_parameters_strategies_are_the_issues_list():
    assert sorted(n for n, c in STRATEGIES.items() if c.global_state == "parameters") == [
        "fedit",
        "fedsa",
        "fedsb",
        "ffa",
        "hetlora",
        "rolora",
    ]


def test_an_unknown_optimizer_and_a_bad_option_are_refused_by_name():
    with pytest.raises(ConfigError, match="aggregation.server_opt = 'adam' is unknown; valid choices: "):
        load_config(None, ["aggregation.server_opt=adam"])
    with pytest.raises(ConfigError, match=r"fedyogi.beta_2 = 1.0 is invalid: expected in \[0, 1\)"):
        load_config(None, ["aggregation.server_opt=fedyogi", "aggregation.fedyogi.beta_2=1.0"])


def test_the_wrapper_is_a_strategy_and_delegates_every_method_explicitly():
    """A method added to Strategy without a delegate in StrategyWrapper would silently run the base's
    default around an inner strategy that overrides it: every public method and capability is defined on the
    wrapper itself."""
    public = {n for n, _ in inspect.getmembers(Strategy) if not n.startswith("_") and n != "from_options"}
    missing = {n for n in public if n not in vars(StrategyWrapper)}
    assert not missing, missing
    cfg = load_config(None, ["aggregation.server_opt=fedadam", "aggregation.name=hetlora"])
    wrapped = with_server_opt(STRATEGIES["hetlora"](), cfg.aggregation)
    assert isinstance(wrapped, Strategy) and wrapped.name == "hetlora"
    assert wrapped.hook is STRATEGIES["hetlora"].hook


def test_help_config_lists_the_optimizers_and_their_options(capsys):
    from fedllm.cli import main

    assert main(["run", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "aggregation.server_opt (default 'none'; one of none, fedadagrad, fedadam, fedavgm, fedyogi)" in (
        out
    )
    for method, cls in SERVER_OPTIMIZERS.items():
        for f in cls.options.__dataclass_fields__:
            assert f"aggregation.{method}.{f} (default" in out


@pytest.mark.parametrize("method", ["fedadam", pytest.param("fedavgm", marks=pytest.mark.slow)])
def test_a_resumed_run_continues_the_optimizer_exactly(tmp_path, builtin_base, method):
    """Two rounds, then a resume to three, against three straight: the same global adapter, which needs the
    moments from the checkpoint (fresh moments in round 3 would step differently)."""
    from conftest import assert_resume_matches_straight

    from fedllm.run.checkpoint import load_checkpoint

    assert_resume_matches_straight(tmp_path, f"aggregation.server_opt={method}", "lora.trainable_modules=[]")
    ckpts = sorted((tmp_path / "b" / "checkpoints").iterdir())
    tensors, _ = load_checkpoint(ckpts[-1])
    assert any(PREFIX in k for k in tensors)


def test_half_a_step_lands_halfway_between_the_start_and_the_aggregate():
    """FedAvgM without momentum at eta 0.5: x + 0.5 (aggregate - x), which pins the start point x."""
    inner = STRATEGIES["fedit"]()
    ours = SERVER_OPTIMIZERS["fedavgm"](inner, FedAvgMOptions(eta=0.5, momentum=0.0))
    g = torch.Generator().manual_seed(4)
    x = {
        k: LoraFactors(torch.randn(RANK, i, generator=g), torch.randn(o, RANK, generator=g), 1.0)
        for k, (o, i) in MODULES.items()
    }
    ups = [
        ClientUpdate(
            c,
            2 + c,
            {k: LoraFactors(f.A + torch.randn(f.A.shape, generator=g), f.B, 1.0) for k, f in x.items()},
            {},
        )
        for c in range(3)
    ]
    ctx = RoundContext(2, 3, [x] * 3, RANK, _fresh)
    got = ours.aggregate(ups, GlobalState(dict(x)), None, ctx).state.factors
    agg = inner.aggregate(ups, GlobalState(dict(x)), None, ctx).state.factors
    for k in MODULES:
        torch.testing.assert_close(got[k].A, 0.5 * (x[k].A + agg[k].A))


def test_components_no_client_of_the_round_had_are_not_stepped():
    """Ranks 2 and 1 this round under a global adapter of rank 3: FedIT's aggregate is zero-padded at the
    third component, which is nobody's change; the optimizer leaves it where it was."""
    ours = SERVER_OPTIMIZERS["fedadam"](STRATEGIES["fedit"]())
    g = torch.Generator().manual_seed(5)
    x = {
        k: LoraFactors(torch.randn(RANK, i, generator=g), torch.randn(o, RANK, generator=g), 1.0)
        for k, (o, i) in MODULES.items()
    }
    ups = [
        ClientUpdate(c, 4, {k: LoraFactors(f.A[:r] + 0.1, f.B[:, :r] + 0.1, 1.0) for k, f in x.items()}, {})
        for c, r in enumerate([2, 1])
    ]
    new = ours.aggregate(ups, GlobalState(dict(x)), None, RoundContext(2, 2, [x] * 2, RANK, _fresh)).state
    for k in MODULES:
        assert torch.equal(new.factors[k].A[2:], x[k].A[2:]) and torch.equal(
            new.factors[k].B[:, 2:], x[k].B[:, 2:]
        )
        assert not torch.allclose(new.factors[k].A[:2], x[k].A[:2])
    assert all(
        torch.count_nonzero(v[..., 2:] if v.dim() == 2 and v.shape[-1] == RANK else v[2:]) == 0
        for n, v in new.extras.items()
        if n.startswith(f"{PREFIX}m.")
    )


def test_with_rolora_only_the_rounds_factor_is_stepped():
    rolora = STRATEGIES["rolora"]()
    ours = SERVER_OPTIMIZERS["fedyogi"](rolora, FedYogiOptions(eta=0.05))
    state = GlobalState(rolora.initial_factors(MODULES, RANK, 0))
    g = torch.Generator().manual_seed(6)
    for t in (1, 2):
        hook = rolora.client_hook().for_round(t)
        ups = [
            ClientUpdate(
                c,
                3,
                hook.incoming(
                    hook.outgoing(
                        {
                            k: LoraFactors(
                                f.A + torch.randn(f.A.shape, generator=g),
                                f.B + torch.randn(f.B.shape, generator=g),
                                1.0,
                            )
                            for k, f in state.factors.items()
                        }
                    ),
                    state.factors,
                ),
                {},
            )
            for c in range(2)
        ]
        new = ours.aggregate(ups, state, None, RoundContext(t, 2, [state.factors] * 2, RANK, _fresh)).state
        for k in MODULES:
            frozen, trained = ("A", "B") if t == 1 else ("B", "A")
            assert torch.equal(getattr(new.factors[k], frozen), getattr(state.factors[k], frozen))
            assert not torch.equal(getattr(new.factors[k], trained), getattr(state.factors[k], trained))
        state = new
    assert {n.rsplit(".", 1)[-1] for n in state.extras if n.startswith(PREFIX)} == {"A", "B"}


def test_a_download_budget_is_refused_with_a_server_optimizer():
    with pytest.raises(ConfigError, match="set one of the two"):
        load_config(
            None,
            [
                "aggregation.server_opt=fedadam",
                "aggregation.fedit.download_budget_mb=1",
                "lora.trainable_modules=[]",
            ],
        )


@pytest.mark.parametrize("method", sorted(CASES))
@pytest.mark.parametrize("strategy", ["fedit", "ffa", "rolora"])
def test_what_no_client_of_a_round_trained_keeps_its_value_and_moments_at_a_later_step(method, strategy):
    """Ranks 4, 4, 8, 8: round 1 every client (non-zero moments everywhere), rounds 2 and 3 the rank-4 clients
    only. Components 4-7 of what the round's clients upload are not moved by the optimizer's second and
    third steps, nor are their moments (before, FedAvgM's momentum moved them by 0.1, and FFA-LoRA's and
    RoLoRA's padded aggregates let FedAdagrad step them); components 0-3 do move."""
    from tests.test_trust import honest, make_server

    server = make_server(strategy, clip_norm_ratio=0)
    server.strategy = with_server_opt(
        server.strategy,
        load_config(None, [f"aggregation.name={strategy}", f"aggregation.server_opt={method}"]).aggregation,
    )
    for r, finishing in ((1, (0, 1, 2, 3)), (2, (0, 1)), (3, (0, 1))):
        before = {k: LoraFactors(f.A.clone(), f.B.clone(), f.scale) for k, f in server.state.factors.items()}
        moments = {k: v.clone() for k, v in server.state.extras.items() if k.startswith(PREFIX)}
        plan = server.plan_round(r)
        updates = {k: honest(server, plan, k, size=0.05, seed=r) for k in finishing}
        report = server.finish_round(plan, {**{k: "no reply" for k in plan.active}, **updates})
        assert not report.row["skipped"]
        if r == 1:
            continue
        uploads = server.strategy.client_hook().for_round(r).uploads
        for key, f in server.state.factors.items():
            for name in uploads:
                new, old = getattr(f, name), getattr(before[key], name)
                tail = (slice(4, None),) if name == "A" else (slice(None), slice(4, None))
                head = (slice(None, 4),) if name == "A" else (slice(None), slice(None, 4))
                assert torch.equal(new[tail], old[tail]), (r, key, name)
                assert not torch.equal(new[head], old[head]), (r, key, name)
                for m, v in server.state.extras.items():
                    if m.endswith(f".{key}.{name}") and m in moments:
                        assert torch.equal(v[tail], moments[m][tail]), (r, m)
                        assert torch.count_nonzero(v[tail]) > 0 or (r == 2 and strategy == "rolora"), (r, m)


@pytest.mark.parametrize("public", [True, False], ids=["public-sample", "secret-sample"])
def test_the_trained_rank_is_told_only_where_the_sample_is_public(public):
    """Under a secret sample (DP) which ranks took part is secret too: a model whose components beyond the
    round's largest rank stayed exactly unchanged would tell whether a top-rank client was sampled, so the
    server tells the strategy no trained rank there (everything is stepped, as Flower's strategies do)."""
    from fedllm.server import Sampling
    from tests.test_trust import honest, make_server

    server = make_server("fedit", clip_norm_ratio=0)
    server.sampling = Sampling(seed=0, clients_per_round=0, public=public)
    seen = []
    aggregate = server.strategy.aggregate

    def spying(updates, state, weights=None, context=None):
        seen.append(context.trained_rank)
        return aggregate(updates, state, weights, context)

    server.strategy.aggregate = spying
    plan = server.plan_round(1)
    updates = {k: honest(server, plan, k) for k in (0, 1)}  # the rank-4 clients only
    server.finish_round(plan, {**{k: "no reply" for k in plan.active}, **updates})
    assert seen == ([4] if public else [None])
