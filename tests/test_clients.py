"""Client algorithms on hand-checkable problems: FedProx, SCAFFOLD, Per-FedAvg."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fedllm.client import ALGORITHMS, LocalWork
from fedllm.client.fedprox import FedProx
from fedllm.client.perfedavg import PerFedAvg
from fedllm.client.scaffold import Scaffold, ScaffoldServer
from fedllm.client.sft import SFT
from fedllm.config import ConfigError, load_config
from fedllm.protocol import AlgorithmServer


class LeastSquares(nn.Module):
    """loss = 1/(2n) ||X theta - y||^2 (or a quadratic 1/2 t'Ht - b't with H, b batches)."""

    def __init__(self, dim: int):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(dim, dtype=torch.float64))

    def forward(self, X=None, y=None, H=None, b=None):
        if H is not None:
            return SimpleNamespace(loss=0.5 * self.theta @ H @ self.theta - b @ self.theta)
        r = X @ self.theta - y
        return SimpleNamespace(loss=0.5 * (r @ r) / len(y))


def work(steps, lr, seed=0, scheduler="constant", clip=0.0, grad_accum=1):
    """A client's local work whose AdamW and SGD learning rates are both ``lr``."""
    return LocalWork(
        round=1,
        client_id=0,
        steps=steps,
        seed=seed,
        lr=lr,
        sgd_lr=lr,
        batch_size=1,
        scheduler=scheduler,
        max_grad_norm=clip,
        grad_accum=grad_accum,
    )


def test_fedprox_mu_zero_equals_sft():
    torch.manual_seed(0)
    X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    results = []
    for algo in (SFT(), FedProx(mu=0.0)):
        model = LeastSquares(3)
        with torch.no_grad():
            model.theta.copy_(torch.tensor([0.3, -0.2, 0.1]))
        algo.train(
            model, {"theta": model.theta}, itertools.repeat({"X": X, "y": y}), work(15, 0.05), None, {}
        )
        results.append(model.theta.detach().clone())
    assert torch.equal(results[0], results[1])


def test_fedprox_gradient_hand_made():
    model = LeastSquares(2)
    X, y = torch.eye(2, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)
    algo = FedProx(mu=0.5)
    params = {"theta": model.theta}
    algo.begin(params, {}, {})  # anchor = (0, 0)
    with torch.no_grad():
        model.theta.copy_(torch.tensor([2.0, -1.0]))
    algo.local_step(model, params, itertools.repeat({"X": X, "y": y}), work(1, 0.1), None)
    # grad f = (X theta - y) / n = ((2-1)/2, (-1-2)/2); prox = 0.5 * (theta - 0)
    expected = torch.tensor([0.5, -1.5]) + 0.5 * torch.tensor([2.0, -1.0])
    assert_close(model.theta.grad, expected.double())


def heterogeneous_problem(sizes=(30, 30, 30, 30), dim=3, seed=0):
    """Clients with different curvature and optima; returns their data and the optimum of sum_k p_k f_k."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for i, n in enumerate(sizes):
        X = torch.randn(n, dim, generator=gen, dtype=torch.float64) * (1 + i)  # different curvature
        opt_i = torch.randn(dim, generator=gen, dtype=torch.float64) * 3  # different client optima
        data.append((X, X @ opt_i))
    p = [n / sum(sizes) for n in sizes]
    H = sum(pk * X.T @ X / len(y) for pk, (X, y) in zip(p, data, strict=True))
    b = sum(pk * X.T @ y / len(y) for pk, (X, y) in zip(p, data, strict=True))
    H_uniform = sum(X.T @ X / len(y) for X, y in data)
    b_uniform = sum(X.T @ y / len(y) for X, y in data)
    return data, torch.linalg.solve(H, b), torch.linalg.solve(H_uniform, b_uniform)


def federate(algo, data, rounds, local_steps, lr, **work_kw):
    """FedAvg of the clients' parameters around ``algo``, weighted by example counts (p_k = n_k / n)."""
    theta = torch.zeros(data[0][0].shape[1], dtype=torch.float64)
    states = [{} for _ in data]
    server = algo.server_half()  # the algorithm's server half (SCAFFOLD: the control variate)
    server.bind({"theta": theta.shape})
    n = sum(len(y) for _, y in data)
    for r in range(rounds):
        new, updates = [], []
        for k, (X, y) in enumerate(data):
            model = LeastSquares(len(theta))
            with torch.no_grad():
                model.theta.copy_(theta)
            res = algo.train(
                model,
                {"theta": model.theta},
                itertools.repeat({"X": X, "y": y}),
                work(local_steps, lr, seed=r, **work_kw),
                None,
                states[k],
                server.download(1),
            )
            new.append(model.theta.detach().clone())
            updates.append(SimpleNamespace(client_id=k, extras=res.extras, num_examples=len(y)))
        theta = sum(len(y) / n * t for (_, y), t in zip(data, new, strict=True))
        server.update(updates, {k: len(y) / n for k, (_, y) in enumerate(data)})
    return theta


@pytest.mark.slow  # 30 s on 2 cores; SCAFFOLD's exactness tests stay in the default run
def test_scaffold_removes_heterogeneity_bias():
    data, optimum, _ = heterogeneous_problem()
    lr, local_steps, rounds = 0.01, 50, 150
    plain = federate(SFT(optimizer="sgd"), data, rounds, local_steps, lr)
    scaffold = federate(Scaffold(), data, rounds, local_steps, lr)
    d_plain = torch.linalg.norm(plain - optimum).item()
    d_scaffold = torch.linalg.norm(scaffold - optimum).item()
    assert d_scaffold < 1e-6, d_scaffold
    assert d_plain > 1e-2, d_plain  # plain local training stops at a biased point
    assert d_plain > 1e4 * d_scaffold


def _gradient(X, y, theta):
    model = LeastSquares(len(theta))
    with torch.no_grad():
        model.theta.copy_(theta)
    model(X, y).loss.backward()
    return model.theta.grad


@pytest.mark.slow
def test_scaffold_with_unequal_sizes_and_cosine_finds_the_weighted_optimum():
    """Control variate and models weighted alike: the minimizer of sum_k p_k f_k, not of (1/N) sum_k f_k."""
    data, weighted, uniform = heterogeneous_problem(sizes=(10, 20, 40, 130))
    assert torch.linalg.norm(weighted - uniform) > 1.0  # the two objectives really differ here
    theta = federate(Scaffold(), data, 200, 50, 0.01, scheduler="cosine")
    assert torch.linalg.norm(theta - weighted).item() < 1e-6
    assert torch.linalg.norm(theta - uniform).item() > 0.5


@pytest.mark.slow
def test_scaffold_clips_the_raw_gradient_and_stops_where_the_clipped_gradients_balance():
    """The clip bounds each client's own gradient, never the correction (c - c_k) added after it: the fixed
    point is where sum_k p_k clip(g_k) = 0 (the optimum itself wherever no client's gradient there is
    clipped), since c_k converges to client k's clipped gradient."""
    data, weighted, _ = heterogeneous_problem(sizes=(10, 20, 40, 130))
    n = sum(len(y) for _, y in data)
    clip = 1.0
    clipped = [min(1.0, clip / float(torch.linalg.norm(_gradient(X, y, weighted)))) for X, y in data]
    assert min(clipped) < 1.0  # the clip is active at the weighted optimum for some client
    theta = federate(Scaffold(), data, 200, 50, 0.01, scheduler="cosine", clip=clip)

    def balance(t):
        grads = [_gradient(X, y, t) for X, y in data]
        return sum(
            len(y) / n * g * min(1.0, clip / float(torch.linalg.norm(g)))
            for (_, y), g in zip(data, grads, strict=True)
        )

    assert torch.linalg.norm(balance(theta)).item() < 1e-6
    assert torch.linalg.norm(theta - weighted).item() > 1e-3  # ... which is not the optimum here


def test_scaffold_control_variate_averages_with_example_weights():
    """Server step by hand: c += sum_k (n_k / n) dc_k with n over all clients (sampled or not)."""
    server = ScaffoldServer()
    server.bind({"w": torch.Size([2])})
    ups = [
        SimpleNamespace(client_id=0, extras={"dc.w": torch.tensor([1.0, 0.0])}),
        SimpleNamespace(client_id=1, extras={"dc.w": torch.tensor([0.0, 4.0])}),
    ]
    server.update(ups, {0: 10 / 80, 1: 30 / 80, 2: 40 / 80})  # client 2 holds 40 examples, not sampled
    assert_close(server.state_dict()["w"], torch.tensor([10 / 80, 30 / 80 * 4]))


def test_scaffold_control_variate_keeps_every_rank_whichever_clients_a_round_samples():
    """c stays at the largest rank: a round of rank-2 clients only leaves the rank-4 rows of c intact."""
    server = ScaffoldServer()
    server.bind({"m.A": torch.Size([4, 3]), "m.B": torch.Size([2, 4])})
    wide = SimpleNamespace(client_id=0, extras={"dc.m.A": torch.ones(4, 3), "dc.m.B": torch.ones(2, 4)})
    server.update([wide], {0: 0.5, 1: 0.5})
    narrow = SimpleNamespace(client_id=1, extras={"dc.m.A": torch.ones(2, 3), "dc.m.B": torch.ones(2, 2)})
    server.update([narrow], {0: 0.5, 1: 0.5})
    got = server.download(4)
    assert_close(got["m.A"][:2], torch.ones(2, 3)) and assert_close(got["m.A"][2:], torch.full((2, 3), 0.5))
    assert_close(got["m.B"][:, 2:], torch.full((2, 2), 0.5))  # rows 2-3 of A / columns of B kept, not cut


def test_scaffold_download_is_fitted_to_the_client_rank():
    server = ScaffoldServer()
    server.load_state_dict(
        {
            "m.A": torch.arange(12.0).reshape(4, 3),
            "m.B": torch.arange(8.0).reshape(2, 4),
            "lm_head.weight": torch.ones(5, 2),
        }
    )
    got = server.download(2)
    assert_close(got["m.A"], torch.arange(6.0).reshape(2, 3))  # the leading rows of A, columns of B
    assert_close(got["m.B"], torch.tensor([[0.0, 1.0], [4.0, 5.0]]))
    assert got["lm_head.weight"].shape == (5, 2)


def quadratic_batches(dim=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        M = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
        out.append(
            {
                "H": M @ M.T + torch.eye(dim, dtype=torch.float64),
                "b": torch.randn(dim, generator=gen, dtype=torch.float64),
            }
        )
    return out


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_update_hand_computed(variant):
    d1, d2, d3 = quadratic_batches()
    alpha, beta = 0.05, 0.1
    theta0 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    model = LeastSquares(3)
    with torch.no_grad():
        model.theta.copy_(theta0)
    algo = PerFedAvg(alpha=alpha, variant=variant)
    algo.train(
        model, {"theta": model.theta}, iter([d1, d2, d3]), work(1, beta), None, {}
    )  # beta = client.sgd_lr
    inner = theta0 - alpha * (d1["H"] @ theta0 - d1["b"])
    g = d2["H"] @ inner - d2["b"]
    if variant == "hf":
        g = g - alpha * d3["H"] @ g
    assert_close(model.theta.detach(), theta0 - beta * g, rtol=1e-7, atol=1e-8)


def test_perfedavg_clips_nothing_by_default_and_personalizes_with_the_trained_step():
    """Gradients far above client.max_grad_norm = 1: Per-FedAvg's meta step and its personalization step
    are the paper's unclipped ones (the meta-gradient is clipped only with clip_meta); SFT clips both."""
    d1, d2, d3 = quadratic_batches()
    theta0 = torch.tensor([50.0, -40.0, 30.0], dtype=torch.float64)  # far from the optimum: big gradients
    alpha, beta = 0.01, 0.02
    inner = theta0 - alpha * (d1["H"] @ theta0 - d1["b"])
    meta = d2["H"] @ inner - d2["b"]
    assert meta.norm() > 10
    for clip_meta, want in ((False, theta0 - beta * meta), (True, theta0 - beta * meta / meta.norm())):
        model = LeastSquares(3)
        with torch.no_grad():
            model.theta.copy_(theta0)
        PerFedAvg(alpha=alpha, clip_meta=clip_meta).train(
            model, {"theta": model.theta}, iter([d1, d2, d3]), work(1, beta, clip=1.0), None, {}
        )
        assert_close(model.theta.detach(), want, rtol=1e-7, atol=1e-8)
    for algo, want in (
        (PerFedAvg(alpha=alpha), theta0 - alpha * (d1["H"] @ theta0 - d1["b"])),
        (SFT(), None),
    ):
        model = LeastSquares(3)
        with torch.no_grad():
            model.theta.copy_(theta0)
        p = work(1, alpha, clip=1.0)
        algo.personalize(model, {"theta": model.theta}, itertools.repeat(d1), 1, p, None)
        step = model.theta.detach() - theta0
        if want is not None:  # the alpha step, unclipped
            assert_close(model.theta.detach(), want, rtol=1e-7, atol=1e-8)
        else:  # clipped to norm 1 before the step of size alpha
            assert float(step.norm()) == pytest.approx(alpha, rel=1e-6)


class DropoutSquares(nn.Module):
    """1/(2n) ||dropout(X) theta - y||^2: a quadratic whose Hessian depends on the dropout mask."""

    def __init__(self, dim: int):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(dim, dtype=torch.float64))
        self.drop = nn.Dropout(0.5)

    def forward(self, X, y):
        r = self.drop(X) @ self.theta - y
        return SimpleNamespace(loss=0.5 * (r @ r) / len(y))


def test_perfedavg_hessian_vector_product_sees_one_dropout_mask():
    """With one mask on both sides the central difference of a quadratic's gradients is exact for any step d.

    With two masks the difference mostly measures the masks (it grows like 1/d): the step would
    then depend on perfedavg_fd_delta.
    """
    gen = torch.Generator().manual_seed(0)
    X, y = (
        torch.randn(40, 5, generator=gen, dtype=torch.float64),
        torch.randn(40, generator=gen, dtype=torch.float64),
    )
    results = []
    for delta in (1e-4, 1e-1):
        model = DropoutSquares(5)
        with torch.no_grad():
            model.theta.copy_(torch.linspace(-1, 1, 5, dtype=torch.float64))
        model.train()
        algo = PerFedAvg(alpha=0.05, variant="hf", fd_delta=delta)
        algo.train(
            model, {"theta": model.theta}, itertools.repeat({"X": X, "y": y}), work(1, 0.1, seed=3), None, {}
        )
        results.append(model.theta.detach().clone())
    assert_close(results[0], results[1], rtol=1e-8, atol=1e-10)


def test_perfedavg_gradients_average_the_accumulated_micro_batches():
    d = quadratic_batches(seed=1) * 3  # six batches: (inner, outer) x grad_accum 2, then the next step's
    theta0 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    model = LeastSquares(3)
    with torch.no_grad():
        model.theta.copy_(theta0)
    PerFedAvg(alpha=0.05, variant="fo").train(
        model, {"theta": model.theta}, iter(d), work(1, 0.1, grad_accum=2), None, {}
    )

    def grad(batch, t):
        return batch["H"] @ t - batch["b"]

    inner = theta0 - 0.05 * (grad(d[0], theta0) + grad(d[1], theta0)) / 2
    outer = (grad(d[2], inner) + grad(d[3], inner)) / 2
    assert_close(model.theta.detach(), theta0 - 0.1 * outer, rtol=1e-7, atol=1e-8)


def test_sgd_steps_take_client_sgd_lr_and_personalization_its_own():
    """client.lr is AdamW's; every plain-SGD local step (SCAFFOLD, sft with sgd) takes client.sgd_lr; the
    personalization step takes client.personalize_lr (not sgd_lr: see docs/testbed.md).
    """
    X, y = torch.eye(2, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)
    for algo in (Scaffold(), SFT(optimizer="sgd")):
        model = LeastSquares(2)
        p = LocalWork(
            round=1,
            client_id=0,
            steps=1,
            seed=0,
            lr=1e-9,
            sgd_lr=0.5,
            batch_size=1,
            scheduler="constant",
            max_grad_norm=0.0,
        )
        algo.train(model, {"theta": model.theta}, itertools.repeat({"X": X, "y": y}), p, None, {})
        assert_close(model.theta.detach(), 0.5 * torch.tensor([0.5, 1.0], dtype=torch.float64))  # -0.5 * grad
    model = LeastSquares(2)
    p.personalize_lr = 0.25
    SFT().personalize(model, {"theta": model.theta}, itertools.repeat({"X": X, "y": y}), 1, p, None)
    assert_close(model.theta.detach(), 0.25 * torch.tensor([0.5, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_algorithms_needing_averaged_parameters_refuse_other_strategies(algorithm):
    from fedllm.aggregation import STRATEGIES

    assert {"sft", "fedprox", "scaffold", "perfedavg"} <= set(ALGORITHMS)
    for name, strategy in STRATEGIES.items():
        overrides = [f"client.algorithm={algorithm}", f"aggregation.name={name}", "lora.ranks=[4]"]
        needs = ALGORITHMS[algorithm].needs_parameter_averaging
        if needs and not strategy.averages_parameters:
            with pytest.raises(ConfigError, match=f"{name}: the algorithm needs a strategy that averages"):
                load_config(None, overrides)
        elif needs and not strategy.same_weights:
            with pytest.raises(ConfigError, match=f"{name}: the algorithm keeps its server state as sum_k"):
                load_config(None, overrides)
        elif (strategy.hook.frozen or strategy.hook.alternates) and ALGORITHMS[
            algorithm
        ].server_state_per_parameter:
            with pytest.raises(ConfigError, match=f"{name}: the algorithm keeps server state for every"):
                load_config(None, overrides)
        elif strategy.hook.sets_local_work and not ALGORITHMS[algorithm].plain_first_step:
            with pytest.raises(ConfigError, match=f"{name}: the strategy's clients take one plain optimizer"):
                load_config(None, overrides)
        elif not (strategy.hook.local_params and not ALGORITHMS[algorithm].trains_local_params):
            load_config(None, overrides)


def test_scaffold_refuses_rslora_with_mixed_ranks():
    load_config(None, ["client.algorithm=scaffold", "lora.use_rslora=true", "lora.ranks=[8]"])
    with pytest.raises(ConfigError, match="scaffold with lora.use_rslora and mixed ranks"):
        load_config(None, ["client.algorithm=scaffold", "lora.use_rslora=true", "lora.ranks=[4,8]"])


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_federated_run_with_each_algorithm(tmp_path, algorithm):
    import json

    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    extra = ["client.perfedavg.variant=hf"] if algorithm == "perfedavg" else []
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "r", f"client.algorithm={algorithm}", "data.client_test_fraction=0.3", *extra
        ),
    )
    fed = Simulation(cfg, tmp_path / "r")
    fed.setup()
    fed.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["n_updates"] == 4 and "personal_acc" in last and "global_client_acc" in last
    if type(fed.server.algorithm).state_dict is not AlgorithmServer.state_dict:  # a server half with state
        # its state travels (SCAFFOLD's control variate): round 2 downloads it, uploads carry the deltas
        assert rows[2]["down_params"] > rows[1]["down_params"]
        assert fed.server.algorithm.state_dict()
        assert set(fed.store.index) == {c.client_id for c in fed.clients}  # every client's c_k, on disk
        assert not any(c.state for c in fed.clients)  # and not in memory between rounds


def test_client_dropout_and_heterogeneous_steps(tmp_path):
    import json

    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    cfg = load_config(
        None, tiny_overrides(tmp_path / "r", "federation.dropout=0.5", "client.local_steps_per_client=[1,3]")
    )
    fed = Simulation(cfg, tmp_path / "r")
    fed.setup()
    fed.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        assert len(r["dropped"]) == 2 and r["n_updates"] == 2
    assert [fed.runtime.local_steps(c) for c in fed.clients] == [1, 3, 1, 3]


def test_a_clients_adamw_is_torchs_fused_kernel_except_under_deepspeed():
    """One fused call per step for all of a client's tensors (torch loops over them in Python on a CPU
    otherwise); DeepSpeed's engine steps the optimizer itself, so there the choice is left to torch."""
    from fedllm.client.sft import SFT
    from fedllm.model.parallel import Layout

    params = {"a": nn.Parameter(torch.randn(4, 3)), "b": nn.Parameter(torch.randn(3, 4))}
    work = LocalWork(round=1, client_id=0, steps=2, seed=0, lr=1e-2, batch_size=2)
    assert SFT().make_optimizer(params, work).defaults["fused"] is True
    work.layout = Layout("data", 0, 1, deepspeed=True)
    assert not SFT().make_optimizer(params, work).defaults["fused"]
