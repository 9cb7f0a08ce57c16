"""Differential privacy (fedllm/privacy/) and FFA-LoRA: the clip bounds a hostile client, zero updates
release pure noise of the stated size, epsilon is dp-accounting's, a resumed run spends what an
uninterrupted one does, and FFA-LoRA's average of B is the exact average of the clients' updates."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, example_weights
from fedllm.config import ConfigError, load_config
from fedllm.factors import LoraFactors, init_factors
from fedllm.privacy import epsilon, noise_for_epsilon, noisy_mean, privatize_update
from tests.conftest import tiny_overrides

SHAPES = {"l0.q_proj": (48, 32), "l0.v_proj": (48, 32), "l1.q_proj": (48, 32)}


def moved(ref: dict, gen, size: float, scale: float = 2.0) -> dict:
    """Factors that moved from ``ref`` by about ``size``."""
    return {
        k: LoraFactors(
            f.A + size * torch.randn(f.A.shape, generator=gen),
            f.B + size * torch.randn(f.B.shape, generator=gen),
            scale,
        )
        for k, f in ref.items()
    }


def test_epsilon_is_dp_accountings():
    """The same parameters through dp-accounting directly: sampled without replacement, replace-one,
    noise multiplier sigma / 2 (sensitivity 2C); the plain Gaussian composition bounds it too."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    n, m, sigma, rounds, delta = 100, 10, 1.5, 20, 1e-3
    spent = []
    for ev in (
        dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(sigma / 2)),
        dp_accounting.GaussianDpEvent(sigma / 2),
    ):
        acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_accounting.SelfComposedDpEvent(ev, rounds))
        spent.append(acc.get_epsilon(delta))
    assert epsilon("central", n, m, sigma, rounds, delta) == pytest.approx(min(spent), rel=1e-12)
    assert epsilon("local", n, m, sigma, rounds, delta) == pytest.approx(spent[1], rel=1e-12)
    assert epsilon("central", n, m, sigma, 0, delta) == 0.0
    sigma4 = noise_for_epsilon(4.0, "central", n, m, rounds, delta)
    assert epsilon("central", n, m, sigma4, rounds, delta) == pytest.approx(4.0, rel=1e-3)


def test_a_hostile_update_contributes_at_most_the_clip():
    """A client whose change is 1e4 times an honest one's moves the noiseless mean by at most C / m."""
    gen = torch.Generator().manual_seed(0)
    base = {k: f.folded() for k, f in init_factors(SHAPES, 8, 1.0, seed=3).items()}
    ref = {k: LoraFactors(f.A, f.B / 2.0, 2.0) for k, f in base.items()}  # rank 8 at scale 2
    hostile = ClientUpdate(0, 10, moved(ref, gen, 1e4))
    for m in (1, 4):
        state, info = noisy_mean(GlobalState(), [hostile], [ref], m, 0.5, 0.0, gen, base)
        change = torch.cat(
            [
                torch.cat(
                    [(state.factors[k].A - base[k].A).flatten(), (state.factors[k].B - base[k].B).flatten()]
                )
                for k in base
            ]
        )
        assert float(change.norm()) <= 0.5 / m * (1 + 1e-5) and float(change.norm()) > 0.4 / m
        assert info["dp_clipped"] == 1
    # a site that clipped its own change (as every fedllm client does) is not counted as re-clipped
    clipped, _, norm = privatize_update(hostile.factors, {}, ref, {}, 0.5, 0.0, gen)
    assert norm > 0.5
    _, info = noisy_mean(GlobalState(), [ClientUpdate(0, 10, clipped)], [ref], 1, 0.5, 0.0, gen, base)
    assert info["dp_clipped"] == 0


def test_zero_changes_release_pure_noise_of_the_stated_size():
    """All clients send back what they were given: the global change is Gaussian noise with standard
    deviation noise_multiplier * C / m on every coordinate (a fixed-seed statistical check)."""
    gen = torch.Generator().manual_seed(1)
    base = {k: f.folded() for k, f in init_factors(SHAPES, 8, 1.0, seed=3).items()}
    ref = {k: LoraFactors(f.A, f.B / 2.0, 2.0) for k, f in base.items()}
    ups = [
        ClientUpdate(k, 10, {m: LoraFactors(f.A.clone(), f.B.clone(), 2.0) for m, f in ref.items()})
        for k in range(5)
    ]
    sigma, clip, m = 1.3, 0.7, 5
    state, _ = noisy_mean(GlobalState(), ups, [ref] * 5, m, clip, sigma * clip, gen, base)
    noise = torch.cat(
        [
            torch.cat(
                [(state.factors[k].A - base[k].A).flatten(), (state.factors[k].B - base[k].B).flatten()]
            )
            for k in base
        ]
    )
    assert noise.numel() > 1500
    assert float(noise.std()) == pytest.approx(sigma * clip / m, rel=0.05)
    assert abs(float(noise.mean())) < 4 * sigma * clip / m / math.sqrt(noise.numel())


def test_a_client_clips_its_change_and_in_local_mode_noises_it():
    gen = torch.Generator().manual_seed(2)
    start = init_factors(SHAPES, 4, 2.0, seed=5)
    trained = moved(start, gen, 0.5)
    dense0 = {"embed": torch.zeros(10, 4)}
    dense1 = {"embed": torch.ones(10, 4)}
    f, d, norm = privatize_update(trained, dense1, start, dense0, 0.3, 0.0, gen)
    change = [f[k].A - start[k].A for k in f] + [(f[k].B - start[k].B) * 2.0 for k in f] + [d["embed"]]
    assert norm > 0.3 and math.sqrt(sum(float(c.pow(2).sum()) for c in change)) == pytest.approx(
        0.3, rel=1e-5
    )
    f2, _, _ = privatize_update(trained, dense1, start, dense0, 0.3, 0.1, gen)
    noise = torch.cat([(f2[k].A - f[k].A).flatten() for k in f])
    assert float(noise.std()) == pytest.approx(0.1, rel=0.1)


def test_ffa_average_of_b_is_the_exact_average_of_the_updates(gen):
    """Clients of ranks 8/4/2 train B against the leading rows of one frozen A: averaging B (padded) is
    exactly sum_k p_k s_k B_k A_k; A never changes."""
    strategy = STRATEGIES["ffa"]()
    shapes = {"m.q_proj": (40, 24)}
    state = GlobalState(strategy.initial_factors(shapes, 8, seed=11))
    A = state.factors["m.q_proj"].A
    ups = [
        ClientUpdate(
            k,
            n,
            {
                "m.q_proj": LoraFactors(
                    A[:r].clone(), torch.randn(40, r, generator=gen, dtype=A.dtype), 16.0 / r
                )
            },
        )
        for k, (r, n) in enumerate([(8, 10), (4, 30), (2, 60)])
    ]
    res = strategy.aggregate(ups, state)
    p = example_weights(ups)
    dense = sum(w * u.factors["m.q_proj"].delta() for w, u in zip(p, ups, strict=True))
    assert_close(res.state.factors["m.q_proj"].delta(), dense, rtol=1e-5, atol=1e-6)
    assert torch.equal(res.state.factors["m.q_proj"].A, A)


def dp_overrides(run_dir, *extra: str) -> list[str]:
    return tiny_overrides(
        run_dir,
        "federation.num_clients=8",
        "federation.clients_per_round=4",
        "privacy.mode=central",
        "privacy.clip_norm=0.5",
        "privacy.noise_multiplier=1.2",
        "privacy.noise_seed=0",
        "lora.trainable_modules=[]",
        *extra,
    )


@pytest.mark.parametrize("strategy", ["fedit", "ffa"])
def test_a_dp_run_reports_epsilon_and_a_resumed_run_spends_the_same(tmp_path, builtin_base, strategy, capsys):
    from fedllm.cli import main
    from fedllm.privacy import default_delta

    assert main(["run", *dp_overrides(tmp_path / "a", f"aggregation.name={strategy}")]) == 0
    assert main(["run", "--resume", str(tmp_path / "a"), "federation.rounds=3"]) == 0
    assert (
        main(["run", *dp_overrides(tmp_path / "b", f"aggregation.name={strategy}", "federation.rounds=3")])
        == 0
    )
    out = capsys.readouterr().out
    assert "-DP after 3 rounds, central" in out
    resumed = json.loads((tmp_path / "a" / "summary.json").read_text())["privacy"]
    straight = json.loads((tmp_path / "b" / "summary.json").read_text())["privacy"]
    assert resumed["epsilon"] == straight["epsilon"] == epsilon("central", 8, 4, 1.2, 3, default_delta(8))
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()][1:]
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[-1] == straight["epsilon"]
    card_dir = tmp_path / "card"
    assert main(["export", str(tmp_path / "b"), "--output", str(card_dir)]) == 0
    assert "differential privacy (central, user level)" in (card_dir / "README.md").read_text()


def test_ffa_run_sends_b_only_and_never_changes_a(tmp_path, builtin_base):
    """End to end: every upload is B (the ledger counts no A), and the global A after the run is the
    initialization the server set before round 1."""
    from fedllm.simulation import Simulation

    cfg = load_config(
        None, tiny_overrides(tmp_path / "r", "aggregation.name=ffa", "lora.trainable_modules=[]")
    )
    sim = Simulation(cfg, tmp_path / "r")
    sim.setup()
    initial = {k: f.A.clone() for k, f in sim.server.state.factors.items()}
    sim.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    shapes = sim.runtime.module_shapes()
    b_numel = sum(c.rank * o for c in sim.clients for (o, _) in shapes.values())
    assert rows[1]["up_params"] == b_numel
    assert all(torch.equal(sim.server.state.factors[k].A, a) for k, a in initial.items())
    # A never travels: a later round's downloads are B alone, and a client derives the frozen A's
    # leading rows from the seed, exactly the server's (which the server also assumes it trained on)
    assert rows[1]["down_params"] == b_numel
    plan = sim.server.plan_round(3)
    for k, start in plan.starts.items():
        assert all(f.A.numel() == 0 for f in start.factors.values())
        _, trained_from = sim.runtime.switch_in(sim.clients[k], start)
        derived = sim.server.reference(3, k, start)
        for key, g in sim.server.state.factors.items():
            rank = derived[key].rank
            assert torch.equal(derived[key].A, g.A[:rank])
            assert torch.equal(trained_from[key].A, g.A[:rank])


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["aggregation.name=flora"],
            "privacy.mode=central needs a strategy whose aggregate is a weighted sum",
        ),
        (["client.algorithm=scaffold"], "scaffold uploads tensors beside the model update"),
        (["federation.dropout=0.1"], "federation.dropout > 0 changes the sampling"),
        (["aggregation.robust=median"], "aggregation.robust is data-dependent"),
        (
            ["privacy.target_epsilon=1"],
            "privacy.target_epsilon=1.0: 2 rounds at noise_multiplier=1.2 spend epsilon",
        ),
    ],
)
def test_what_would_weaken_the_guarantee_is_refused(extra, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(None, dp_overrides(tmp_path, *extra))
    load_config(None, dp_overrides(tmp_path, "privacy.mode=local", "aggregation.name=flora"))


def test_privacy_helper_prints_the_noise_for_a_target(capsys):
    from fedllm.cli import main

    assert (
        main(["privacy", "--clients", "100", "--per-round", "10", "--rounds", "20", "--target-epsilon", "4"])
        == 0
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["epsilon"] == pytest.approx(4.0, rel=1e-3) and 1 < last["noise_multiplier"] < 3
