"""Exactness of every strategy against dense references, and shared invariants."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, example_weights
from fedllm.aggregation.fedit import FedIT
from fedllm.aggregation.flexlora import FlexLoRA
from fedllm.aggregation.flora import FLoRA
from fedllm.aggregation.florist import FLoRIST
from fedllm.factors import LoraFactors, concat, energy_rank, low_rank_svd, pad_rank, stack, svd_factors
from tests.conftest import random_factors

RANKS = [64, 32, 16, 16, 8, 8, 4, 4, 4, 4]
COUNTS = [120, 30, 75, 10, 55, 200, 5, 90, 40, 17]
OUT, IN = 96, 80  # not square, smaller than the sum of ranks


def make_updates(gen, ranks=RANKS, counts=COUNTS, modules=("m.q_proj", "m.down_proj"), alpha_ratio=2.0):
    updates = []
    for k, (r, n) in enumerate(zip(ranks, counts, strict=True)):
        scale = (alpha_ratio * r) / r if k % 2 else 16.0 / r  # mixed alpha/r conventions
        factors = {m: random_factors(r, OUT, IN, scale, gen) for m in modules}
        updates.append(ClientUpdate(k, n, factors))
    return updates


def dense_sum(updates, key):
    w = example_weights(updates)
    return sum(p * u.factors[key].delta() for p, u in zip(w, updates, strict=True))


def test_weights_follow_example_counts(gen):
    updates = make_updates(gen)
    w = example_weights(updates)
    assert_close(torch.tensor(w), torch.tensor(COUNTS, dtype=torch.float64) / sum(COUNTS), check_dtype=False)


def test_stack_identity(gen):
    fs = [random_factors(r, OUT, IN, 0.5 * (i + 1), gen) for i, r in enumerate([4, 8, 2])]
    w = [0.2, 0.5, 0.3]
    s = stack(fs, w)
    assert s.rank == 14
    assert_close(s.delta(), sum(p * f.delta() for p, f in zip(w, fs, strict=True)))


def test_pad_rank_keeps_product(gen):
    f = random_factors(3, 5, 4, 2.0, gen)
    g = pad_rank(f, 7)
    assert g.rank == 7 and torch.all(g.A[3:] == 0) and torch.all(g.B[:, 3:] == 0)
    assert_close(g.delta(), f.delta())


def test_low_rank_svd_matches_dense(gen):
    f = stack([random_factors(r, OUT, IN, 1.0, gen) for r in (16, 8, 4)], [0.5, 0.3, 0.2])
    u, s, vh = low_rank_svd(f)
    dense_s = torch.linalg.svdvals(f.delta())
    assert_close(s, dense_s[: s.numel()])
    assert_close(svd_factors(u, s, vh, s.numel()).delta(), f.delta())


def test_energy_rank_hand_computed():
    s = torch.tensor([3.0, 2.0, 1.0, 0.0])  # energies 9, 4, 1 -> fractions 9/14, 13/14, 1
    assert energy_rank(s, 0.5) == 1
    assert energy_rank(s, 9 / 14) == 1
    assert energy_rank(s, 0.7) == 2
    assert energy_rank(s, 0.95) == 3
    assert energy_rank(s, 1.0) == 3


def test_fedit_hand_computed():
    a1, b1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0]])
    a2 = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    b2 = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    u1 = ClientUpdate(0, 1, {"m": LoraFactors(a1, b1, 2.0)})  # folded B = [[2],[0]]
    u2 = ClientUpdate(1, 3, {"m": LoraFactors(a2, b2, 1.0)})
    res = FedIT().aggregate([u1, u2], GlobalState())
    g = res.state.factors["m"]
    # p = (1/4, 3/4); A1 padded [[1,2],[0,0]], B1 folded+padded [[2,0],[0,0]]
    assert_close(g.A, torch.tensor([[0.25 * 1 + 0.75 * 3, 0.25 * 2], [0.0, 0.75]]))
    assert_close(g.B, torch.tensor([[0.25 * 2, 0.75 * 2], [0.75, 0.75]]))
    assert g.scale == 1.0
    # Each client gets back its leading rows/columns at its own scale.
    start = FedIT().client_factors(res.state, 1, 2.0, 0)["m"]
    assert start.rank == 1 and start.scale == 2.0
    assert_close(start.A, g.A[:1])
    assert_close(start.B * 2.0, g.B[:, :1])


def test_fedit_zero_padding_round_trips_every_rank(gen):
    updates = make_updates(gen)
    res = FedIT().aggregate(updates, GlobalState())
    for u in updates:
        for key, f in u.factors.items():
            start = FedIT().client_factors(res.state, f.rank, f.scale, 0)[key]
            assert start.A.shape == f.A.shape and start.B.shape == f.B.shape and start.scale == f.scale
    # Identical clients: the average is that client.
    same = [ClientUpdate(k, n, updates[0].factors) for k, n in enumerate(COUNTS[:3])]
    g = FedIT().aggregate(same, GlobalState()).state.factors
    for key, f in updates[0].factors.items():
        assert_close(g[key].delta(), f.delta())


def test_flora_exact_weighted_sum(gen):
    updates = make_updates(gen)
    res = FLoRA().aggregate(updates, GlobalState())
    assert not res.state.factors  # clients start fresh
    for key in updates[0].factors:
        merged = res.merged[key]
        assert merged.rank == sum(RANKS)
        assert_close(merged.delta(), dense_sum(updates, key))
    assert FLoRA().client_factors(res.state, 8, 2.0, 0) is None  # the merge goes into the base instead
    # The residual accumulates exactly over rounds.
    res2 = FLoRA().aggregate(make_updates(gen), res.state)
    key = "m.q_proj"
    assert_close(res2.state.residual[key].delta(), res.merged[key].delta() + res2.merged[key].delta())


def test_flexlora_matches_dense_truncated_svd(gen):
    # Factors with a clear spectral gap at every client rank: build the sum from
    # orthogonal directions with well separated singular values.
    updates = make_updates(gen, modules=("m.q_proj",))
    res = FlexLoRA().aggregate(updates, GlobalState())
    key = "m.q_proj"
    dense = dense_sum(updates, key)
    assert_close(res.state.factors[key].delta(), dense)  # the global update is exact
    u, s, vh = torch.linalg.svd(dense, full_matrices=False)
    for r in sorted(set(RANKS)):
        gap = (s[r - 1] - s[r]) / s[r - 1]
        start = FlexLoRA().client_factors(res.state, r, 3.0, 0)[key]
        assert start.rank == r and start.scale == 3.0
        ref = (u[:, :r] * s[:r]) @ vh[:r]
        if gap > 0.01:
            assert_close(start.delta(), ref, rtol=1e-6, atol=1e-8)
        # subspace-insensitive: the error of the truncation equals the dropped energy
        err = torch.linalg.norm(start.delta() - dense)
        assert_close(err, torch.linalg.norm(s[r:]))


def test_flexlora_never_forms_dense(gen, monkeypatch):
    # Layers larger than the sum of ranks (as in real models): no product may
    # have the out x in shape of the dense update.
    big_out, big_in = 300, 260
    updates = [
        ClientUpdate(k, n, {"m.q_proj": random_factors(r, big_out, big_in, 2.0, gen)})
        for k, (r, n) in enumerate(zip(RANKS, COUNTS, strict=True))
    ]
    seen = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a, b):
        out = real_matmul(a, b)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    FlexLoRA().aggregate(updates, GlobalState())
    FLoRIST(tau=0.9).aggregate(updates, GlobalState())
    assert seen and (big_out, big_in) not in seen


def test_florist_tau_one_is_exact_and_tau_threshold(gen):
    updates = make_updates(gen, modules=("m.q_proj",))
    key = "m.q_proj"
    dense = dense_sum(updates, key)
    exact = FLoRIST(tau=1.0).aggregate(updates, GlobalState()).merged[key]
    assert_close(exact.delta(), dense)
    s = torch.linalg.svdvals(dense)
    energy = torch.cumsum(s**2, 0) / (s**2).sum()
    for tau in (0.5, 0.8, 0.9, 0.99):
        res = FLoRIST(tau=tau).aggregate(updates, GlobalState())
        p = res.merged[key].rank
        assert energy[p - 1] >= tau - 1e-12
        assert p == 1 or energy[p - 2] < tau
        err = torch.linalg.norm(res.merged[key].delta() - dense)
        assert_close(err, torch.linalg.norm(s[p:]))
        ranks = [u.factors[key].A.shape[0] for u in updates]  # what the paper compares the kept rank with
        assert res.info["kept_rank"] == {key: p}
        assert (res.info["client_rank_max"], res.info["client_rank_sum"]) == (max(ranks), sum(ranks))
    fixed = FLoRIST(fixed_rank=5).aggregate(updates, GlobalState()).merged[key]
    assert fixed.rank == 5
    assert_close(torch.linalg.norm(fixed.delta() - dense), torch.linalg.norm(s[5:]))


@pytest.mark.parametrize("bad", [{"tau": 0.0}, {"tau": 1.5}, {"tau": -1}, {"fixed_rank": -2}])
def test_florist_rejects_bad_options(bad):
    with pytest.raises(ValueError, match="tau|fixed_rank"):
        FLoRIST(**bad)


# Options under which a strategy keeps the whole update (FLoRIST truncates by design when tau < 1).
EXACT_OPTIONS = {"florist": {"tau": 1.0}}


def effective_update(name, res, state_before):
    """The global update a strategy's round produced (adapter + what it merged); FedSA-LoRA has no global
    update (B stays on the clients): its shared A, as a product with an identity B."""
    strategy = STRATEGIES[name](**EXACT_OPTIONS.get(name, {}))
    if name == "fedsa":
        return {
            k: LoraFactors(f.A, torch.eye(f.A.shape[0], dtype=f.A.dtype))
            for k, f in res.state.factors.items()
        }
    return concat(strategy.global_adapter(res.state), res.merged)


@pytest.mark.parametrize("name", sorted(n for n in STRATEGIES if n != "floral"))
def test_shared_invariants(name, gen):
    base = make_updates(gen, ranks=[8, 4, 8], counts=[10, 30, 60], modules=("m.v_proj",))
    strategy = STRATEGIES[name](**EXACT_OPTIONS.get(name, {}))
    key = "m.v_proj"
    st = GlobalState()
    if STRATEGIES[name].hook().for_round(1).frozen == ("A",):  # clients train B on the leading rows of one A
        out_f, in_f = base[0].factors[key].B.shape[0], base[0].factors[key].A.shape[1]
        st = GlobalState(strategy.initial_factors({key: (out_f, in_f)}, 8, seed=5))
        A = st.factors[key].A.to(base[0].factors[key].A.dtype)
        st.factors[key] = LoraFactors(A, st.factors[key].B.to(A.dtype), 1.0)
        base = [
            ClientUpdate(u.client_id, u.num_examples, {key: LoraFactors(A[: f.rank], f.B, f.scale)})
            for u in base
            for f in [u.factors[key]]
        ]
    if name == "fedsb":  # clients train an 8 x 8 R between shared bases (orthonormal B columns, A rows)
        st, base = _fedsb_case(gen, base, key)
    # 1. identical clients give back that client's update
    same = [ClientUpdate(k, n, base[0].factors, extras=base[0].extras) for k, n in enumerate([5, 7, 11])]
    res = strategy.aggregate(same, st)
    own = base[0].factors[key]
    if name == "fedsa":
        own = LoraFactors(own.A, torch.eye(own.rank, dtype=own.A.dtype))
    if name == "fedsb":
        own = LoraFactors(st.factors[key].A, st.factors[key].B @ base[0].extras[f"fedsb_R.{key}"])
    assert_close(
        effective_update(name, res, st)[key].delta(),
        own.delta(),
        rtol=1e-6,
        atol=1e-9,
    )
    # 2. reordering clients changes nothing
    a = effective_update(name, strategy.aggregate(base, st), st)[key].delta()
    for perm in itertools.permutations(base):
        b = effective_update(name, strategy.aggregate(list(perm), st), st)[key].delta()
        assert_close(a, b, rtol=1e-6, atol=1e-9)
    # 3. weights follow example counts: doubling a client's count equals listing it twice (HetLoRA weighs
    # by update norms instead: tested in test_baselines.py)
    if name == "hetlora":
        return
    doubled = [ClientUpdate(0, 20, base[0].factors, extras=base[0].extras), base[1], base[2]]
    twice = [base[0], ClientUpdate(3, 10, base[0].factors, extras=base[0].extras), base[1], base[2]]
    x = effective_update(name, strategy.aggregate(doubled, st), st)[key].delta()
    y = effective_update(name, strategy.aggregate(twice, st), st)[key].delta()
    assert_close(x, y, rtol=1e-6, atol=1e-9)


def _fedsb_case(gen, base, key):
    """Fed-SB's round on ``base``'s clients: shared bases of rank 8 and each client's whole 8 x 8 R (its
    block put into the downloaded R, as the server's acceptance does)."""
    from fedllm.aggregation.fedsb import CORE, RANK

    f = base[0].factors[key]
    out_f, in_f = f.B.shape[0], f.A.shape[1]
    qb, _ = torch.linalg.qr(torch.randn(out_f, 8, generator=gen, dtype=torch.float64))
    qa, _ = torch.linalg.qr(torch.randn(in_f, 8, generator=gen, dtype=torch.float64))
    st = GlobalState({key: LoraFactors(qa.T.contiguous(), qb, 1.0)}, extras={RANK: 8})
    R0 = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    ups = []
    for u in base:
        r = u.factors[key].rank
        R = R0.clone()
        R[:r, :r] = torch.randn(r, r, generator=gen, dtype=torch.float64)
        lead = LoraFactors(qa.T[:r].contiguous(), qb[:, :r], u.factors[key].scale)
        ups.append(ClientUpdate(u.client_id, u.num_examples, {key: lead}, extras={f"{CORE}{key}": R}))
    return st, ups


def test_registry_rejects_bad_names():
    from fedllm.aggregation.base import Strategy

    with pytest.raises(TypeError, match="registered twice"):
        type("Again", (FedIT,), {"name": "fedit"})
    with pytest.raises(TypeError, match="identifier"):
        type("Bad", (Strategy,), {"name": "not-valid"})


@pytest.mark.parametrize("split", ["us", "sqrt"])
def test_flexlora_client_factors_follow_the_split(gen, split):
    """'us' (the reference's default): B = U S, A = V^T with orthonormal rows; 'sqrt': balanced. Same
    product.
    """
    updates = make_updates(gen, ranks=[8, 4, 8], counts=[10, 30, 60], modules=("m.q_proj",))
    strategy = FlexLoRA(split=split)
    res = strategy.aggregate(updates, GlobalState())
    start = strategy.client_factors(res.state, 4, 1.0, 0)["m.q_proj"]
    u, s, vh = torch.linalg.svd(dense_sum(updates, "m.q_proj"), full_matrices=False)
    assert_close(
        start.delta(), (u[:, :4] * s[:4]) @ vh[:4], rtol=1e-6, atol=1e-8
    )  # the truncated SVD either way
    gram_a = start.A @ start.A.T
    if split == "us":
        assert_close(gram_a, torch.eye(4, dtype=gram_a.dtype), rtol=1e-8, atol=1e-8)
        assert_close(torch.linalg.norm(start.B, dim=0), s[:4], rtol=1e-6, atol=1e-8)
    else:
        assert_close(torch.linalg.norm(start.A, dim=1), s[:4].sqrt(), rtol=1e-6, atol=1e-8)
        assert_close(torch.linalg.norm(start.B, dim=0), s[:4].sqrt(), rtol=1e-6, atol=1e-8)


def test_flexlora_default_split_is_the_reference():
    from fedllm.aggregation import strategy_from_config
    from fedllm.config import load_config

    assert strategy_from_config(load_config(None, ["aggregation.name=flexlora"]).aggregation).split == "us"


def _bench_aggregation():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_aggregation.py"
    spec = importlib.util.spec_from_file_location("bench_aggregation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(n for n in STRATEGIES if n != "floral"))
def test_server_cost_benchmark_runs_each_strategy(name):
    """scripts/bench_aggregation.py's per-strategy step (aggregate + every client's download) on 1 layer."""
    row = _bench_aggregation().run_one(name, layers=1)
    assert row["strategy"] == name and row["seconds"] > 0


@pytest.mark.slow
def test_server_cost_benchmark_agrees_with_the_dense_reference():
    """The benchmark's dense-SVD reference on 1 TinyLlama-shaped layer: our factors within float
    error of it.
    """
    ref = _bench_aggregation().dense_reference(1)
    assert ref["max_rel_err_full"] < 1e-5 and ref["max_rel_err_truncated"] < 1e-4
    assert ref["truncations_checked"] > 0
