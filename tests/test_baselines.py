"""The newer baselines against dense references: FedEx-LoRA (exact via a merged remainder) and HetLoRA
(zero-padded, norm-weighted)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, example_weights
from fedllm.factors import LoraFactors, concat, pad_rank
from tests.conftest import random_factors

OUT, IN = 40, 24
KEY = "m.q_proj"


def updates(gen, ranks, counts):
    return [
        ClientUpdate(k, n, {KEY: random_factors(r, OUT, IN, 2.0 / (k + 1), gen)})
        for k, (r, n) in enumerate(zip(ranks, counts, strict=True))
    ]


def test_fedex_is_exact_with_unequal_sizes_and_mixed_ranks(gen):
    """The global model (base + merged remainder + averaged factors) is exactly sum_k p_k s_k B_k A_k, with
    the same p_k in both terms; the factors are FedIT's; the remainder is kept in its smallest exact form."""
    ups = updates(gen, [8, 4, 8, 2], [1000, 3, 40, 7])  # very unequal sizes
    p = example_weights(ups)
    res = STRATEGIES["fedex"]().aggregate(ups, GlobalState())
    dense = sum(w * u.factors[KEY].delta() for w, u in zip(p, ups, strict=True))
    total = res.merged[KEY].delta() + res.state.factors[KEY].delta()
    assert_close(total, dense, rtol=1e-9, atol=1e-9)
    fedit = STRATEGIES["fedit"]().aggregate(ups, GlobalState())
    assert_close(res.state.factors[KEY].A, fedit.state.factors[KEY].A)
    assert_close(res.state.factors[KEY].B, fedit.state.factors[KEY].B)
    # factors of rank <= sum r_k + r, or the dense matrix where that is smaller (here: rank 30 on 40 x 24)
    assert res.merged[KEY].numel() <= min((8 + 4 + 8 + 2 + 8) * (OUT + IN), OUT * IN)
    # the remainder is what FedIT loses: FedIT's own model is off by exactly that much
    assert_close(fedit.state.factors[KEY].delta() + res.merged[KEY].delta(), dense, rtol=1e-9, atol=1e-9)
    assert float(res.merged[KEY].delta().norm()) > 1e-3 * float(dense.norm())  # FedIT really is inexact here
    # subtracting the unweighted mean(B) @ mean(A), as one public implementation does, is not exact
    padded = [pad_rank(u.factors[KEY].folded(), 8) for u in ups]
    wrong = sum(w * u.factors[KEY].delta() for w, u in zip(p, ups, strict=True)) - torch.stack(
        [f.B for f in padded]
    ).mean(0) @ torch.stack([f.A for f in padded]).mean(0)
    assert float((wrong + res.state.factors[KEY].delta() - dense).norm()) > 1e-3 * float(dense.norm())


def test_fedex_stays_exact_over_rounds(gen):
    """Two rounds where the clients start from the global factors: the cumulative model equals the running
    weighted average of the clients' models, and the residual holds every remainder."""
    strategy = STRATEGIES["fedex"]()
    state, base = GlobalState(), torch.zeros(OUT, IN, dtype=torch.float64)
    for _ in range(3):
        ups = updates(gen, [4, 4, 4], [10, 20, 70])
        if state.factors:  # clients trained from the global factors: their final factors are what they send
            for u in ups:
                start = state.factors[KEY]
                u.factors[KEY] = LoraFactors(
                    start.A + u.factors[KEY].A * 0.1, start.B + u.factors[KEY].B * 0.1
                )
        target = base + sum(
            w * u.factors[KEY].delta() for w, u in zip(example_weights(ups), ups, strict=True)
        )
        res = strategy.aggregate(ups, state)
        base = base + res.merged[KEY].delta()
        state = res.state
        assert_close(base + state.factors[KEY].delta(), target, rtol=1e-8, atol=1e-8)
        assert_close(state.residual[KEY].delta(), base, rtol=1e-8, atol=1e-8)
    exported = concat(state.factors, state.residual)  # what save_global_adapter writes
    assert_close(exported[KEY].delta(), base + state.factors[KEY].delta(), rtol=1e-8, atol=1e-8)


def test_hetlora_weighs_each_module_by_its_update_norm(gen):
    """Hand-computed: zero-pad to the largest rank, shares ||s_k B_k A_k||_F / sum_j, per module; example
    counts play no part; a low-rank client gets the leading components."""
    ups = updates(gen, [8, 2, 4], [5, 500, 50])
    norms = [float(torch.linalg.matrix_norm(u.factors[KEY].delta())) for u in ups]
    shares = [n / sum(norms) for n in norms]
    padded = [pad_rank(u.factors[KEY].folded(), 8) for u in ups]
    res = STRATEGIES["hetlora"]().aggregate(ups, GlobalState())
    g = res.state.factors[KEY]
    assert_close(g.A, sum(s * f.A for s, f in zip(shares, padded, strict=True)), rtol=1e-9, atol=1e-12)
    assert_close(g.B, sum(s * f.B for s, f in zip(shares, padded, strict=True)), rtol=1e-9, atol=1e-12)
    assert not res.merged  # nothing merged into the base
    assert_close(res.info["norm_share_max"], max(shares))
    # listing a client twice doubles its share; changing its example count does not
    twice = STRATEGIES["hetlora"]().aggregate([*ups, ClientUpdate(3, 1, ups[0].factors)], GlobalState())
    recount = STRATEGIES["hetlora"]().aggregate(
        [ClientUpdate(0, 10_000, ups[0].factors), *ups[1:]], GlobalState()
    )
    assert_close(recount.state.factors[KEY].A, g.A)
    assert not torch.allclose(twice.state.factors[KEY].A, g.A)
    start = STRATEGIES["hetlora"]().client_factors(res.state, 2, 0.5, 1)
    assert_close(start[KEY].A, g.A[:2]) and assert_close(start[KEY].B * 0.5, g.B[:, :2])


def test_hetlora_share_of_a_hostile_update_is_bounded_by_the_servers_clip():
    """Norm-weighted shares would hand a 1e4x update the whole model; the server clips updates to
    clip_norm_ratio x the round's median change before the strategy sees them, which bounds its share."""
    from fedllm.protocol import ClientInfo
    from fedllm.server import RoundPlan, Server, ServerPolicy
    from tests.test_trust import honest

    server = Server(
        strategy=STRATEGIES["hetlora"](),
        clients=[ClientInfo(k, 4, 2.0, 20) for k in range(4)],
        modules={KEY: (OUT, IN)},
        policy=ServerPolicy(clip_norm_ratio=2.0),
    )
    plan = RoundPlan(1, [0, 1, 2, 3], [], {k: server.client_start(1, k) for k in range(4)})
    results = {k: honest(server, plan, k, size=0.1, seed=k) for k in range(4)}
    hostile = results[3]
    f = hostile.factors[KEY]
    hostile.factors[KEY] = LoraFactors(f.A * 100, f.B * 100, f.scale)  # 1e4 x the product
    row = server.finish_round(plan, results).row
    assert row["n_updates"] == 4 and row["agg_clipped"] == 1
    print(row["agg_norm_share_max"])
    assert row["agg_norm_share_max"] < 0.75  # unclipped it would be about 1 - 1e-4


def a_only(gen, ranks, counts, share: bool = False):
    """FedSA-LoRA uploads: A, an empty out x 0 B, and (on sharing rounds) the client's B as an extra."""
    out = []
    for u in updates(gen, ranks, counts):
        f = u.factors[KEY]
        extras = {f"B_shared.{KEY}": f.B} if share else {}
        out.append(
            ClientUpdate(
                u.client_id, u.num_examples, {KEY: LoraFactors(f.A, f.B[:, :0], f.scale)}, extras=extras
            )
        )
    return out, [u.factors[KEY] for u in updates(torch.Generator().manual_seed(0), ranks, counts)]


def test_fedsa_averages_a_only_and_b_only_when_shared(gen):
    from fedllm.aggregation.fedsa import FedSALoRA

    ups, _ = a_only(gen, [8, 4, 8], [10, 30, 60])
    p = example_weights(ups)
    res = FedSALoRA().aggregate(ups, GlobalState())
    g = res.state.factors[KEY]
    expect_a = sum(
        w * pad_rank(LoraFactors(u.factors[KEY].A, torch.zeros(OUT, u.factors[KEY].A.shape[0])), 8).A
        for w, u in zip(p, ups, strict=True)
    )
    assert_close(g.A, expect_a) and assert_close(g.B, torch.zeros(OUT, 8, dtype=g.B.dtype))
    start = FedSALoRA().client_factors(res.state, 4, 0.5, 1)[KEY]
    assert_close(start.A, g.A[:4]) and start.B.shape == (OUT, 0)  # only A travels down as well
    # with sharing: B is the example-weighted mean of the sharers' folded B's
    shared, _ = a_only(gen, [8, 4, 8], [10, 30, 60], share=True)
    res = FedSALoRA(share_b_every=1).aggregate(shared, GlobalState())
    folded = [
        pad_rank(
            LoraFactors(
                torch.zeros(u.factors[KEY].A.shape), u.extras[f"B_shared.{KEY}"] * u.factors[KEY].scale
            ),
            8,
        ).B
        for u in shared
    ]
    assert_close(res.state.factors[KEY].B, sum(w * b for w, b in zip(p, folded, strict=True)))
    extras = FedSALoRA(share_b_every=2).client_extras(res.state, 0)
    assert int(extras["share_b"]) == 1 and f"B_mean.{KEY}" in extras  # round 2 shares (every 2nd round)


def test_fedsa_run_keeps_b_on_the_clients_and_uploads_half(tmp_path, builtin_base):
    """End to end: only A travels up (the ledger counts it), each client's B is in its own state, and the
    headline personalized accuracy is reported; the global model without sharing is the base."""
    import json

    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "r",
            "aggregation.name=fedsa",
            "lora.trainable_modules=[]",
            "data.client_test_fraction=0.3",
        ),
    )
    sim = Simulation(cfg, tmp_path / "r")
    sim.setup()
    sim.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    shapes = sim.runtime.module_shapes()
    ranks = [c.rank for c in sim.clients]
    a_numel = sum(r * i for r in ranks for (_, i) in shapes.values())
    assert rows[1]["up_params"] == a_numel  # A only
    assert rows[2]["down_params"] == a_numel + 4  # A's leading rows (+ the share flag), no B
    for c in sim.clients:
        sim.store.load(c)
        assert {k for k in c.state if k.startswith("hook.B.")} == {f"hook.B.{m}" for m in shapes}
    assert "personal_acc" in rows[-1] and rows[-1]["personal_acc"] is not None
    assert rows[-1]["eval_loss"] == pytest.approx(rows[0]["eval_loss"], rel=1e-5)  # global model = base


def _lora_model(rank: int, seed: int = 0):
    """One 12 -> 10 linear layer with a peft LoRA of ``rank`` whose A and B are both random."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(12, 10))
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"]))
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    return model, layer


def test_hetlora_self_pruning_penalty_gradient_and_rank_rule():
    """The penalty's gradient (added by hooks) is autograd's of lambda ||s B_t A_t||_F on the tail; a tail
    whose norm fell is pruned to floor(gamma r) at once (zero in what is sent), and a later session masks
    the pruned components out of the forward pass."""
    from fedllm.aggregation.hetlora import RANK, TAIL, HetLoRAClient, tail_start

    gamma, lam, r = 0.5, 0.3, 8
    model, layer = _lora_model(r)
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, float(layer.scaling["default"])
    x = torch.randn(5, 12)
    lo = tail_start(r, gamma)
    assert lo == 4
    # reference: autograd of loss + penalty without hooks
    penalty = lam * torch.linalg.matrix_norm(s * b[:, lo:] @ a[lo:])
    ga, gb = torch.autograd.grad(model(x).sum() + penalty, [a, b])
    hook = HetLoRAClient(gamma, lam)
    session = hook.session(model, "default", {}, {}, "train")
    ha, hb = torch.autograd.grad(model(x).sum(), [a, b])
    assert_close(ha, ga)
    assert_close(hb, gb)
    state = session.state()  # first round: no earlier tail, so nothing is pruned
    assert int(state[RANK]) == r
    session.close()
    # next round: a tail smaller than last round's is pruned
    shrunk = {RANK: torch.tensor(r), TAIL: torch.tensor(float(state[TAIL]) * 10)}
    session = hook.session(model, "default", shrunk, {}, "train")
    state = session.state()
    assert int(state[RANK]) == 4
    session.close()
    assert torch.count_nonzero(a[4:]) == 0 and torch.count_nonzero(b[:, 4:]) == 0
    assert torch.count_nonzero(a[:4]) > 0
    # a tail that grew is kept
    session = hook.session(model, "default", {RANK: torch.tensor(4), TAIL: torch.tensor(0.0)}, {}, "train")
    assert int(session.state()[RANK]) == 4
    session.close()
    # the pruned client's own view masks components beyond its rank even if the weights hold them
    with torch.no_grad():
        a[4:].normal_()
        b[:, 4:].normal_()
    with torch.no_grad():
        masked = hook.session(model, "default", {RANK: torch.tensor(4)}, {}, "own")
        y = model(x)
        masked.close()
        a[4:].zero_()
        assert_close(y, model(x))
    assert hook.session(model, "default", {}, {}, "own") is None  # never pruned: nothing to hook


@pytest.mark.slow
def test_hetlora_self_pruning_run_shrinks_ranks(tmp_path, builtin_base):
    """End to end: with a strong penalty the clients prune (their state holds the smaller rank, the server
    counts fewer components in use) while the run still trains and aggregates every round."""
    import json

    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "r",
            "aggregation.name=hetlora",
            "aggregation.hetlora.prune_gamma=0.5",
            "aggregation.hetlora.prune_lambda=1.0",
            "federation.rounds=4",
            "lora.trainable_modules=[]",
        ),
    )
    sim = Simulation(cfg, tmp_path / "r")
    sim.setup()
    sim.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(not r.get("failed") for r in rows)
    ranks = [r["agg_effective_rank_mean"] for r in rows]
    configured = sum(c.rank for c in sim.clients) / len(sim.clients)
    assert ranks[0] == pytest.approx(configured)  # round 1 has nothing to compare against
    assert ranks[-1] < configured
    for c in sim.clients:
        sim.store.load(c)
        assert int(c.state["hook.rank"]) <= c.rank
    assert any(int(c.state["hook.rank"]) < c.rank for c in sim.clients)
