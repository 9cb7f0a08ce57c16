"""RoLoRA (Chen et al., NeurIPS 2025): rounds alternate between training B on the shared A and A on the
shared B; each round's average is the exact average of the clients' updates; one factor travels up."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, RoundContext, example_weights
from fedllm.config import ConfigError, load_config
from fedllm.factors import LoraFactors, truncate_rank
from fedllm.privacy.strategy import DPStrategy

OUT, IN, RMAX = 12, 10, 8
KEY = "m.q_proj"


def _start(strategy):
    st = GlobalState(strategy.initial_factors({KEY: (OUT, IN)}, RMAX, seed=5))
    f = st.factors[KEY]
    st.factors[KEY] = LoraFactors(f.A.double(), f.B.double(), 1.0)
    return st


def _clients(gen, strategy, state, round_idx, ranks=(8, 4, 2), counts=(10, 30, 60)):
    """Each client starts from its download and changes only the factor the round trains; the server's
    view (``incoming``) puts the frozen one back from the reference."""
    hook = strategy.client_hook().for_round(round_idx)
    ups = []
    for k, (r, n) in enumerate(zip(ranks, counts, strict=True)):
        scale = 16.0 / r if k % 2 else 2.0
        start = strategy.client_factors(state, r, scale, k)[KEY]
        A, B = start.A.clone(), start.B.clone()
        if "A" in hook.uploads:
            A += torch.randn(A.shape, generator=gen, dtype=A.dtype)
        else:
            B += torch.randn(B.shape, generator=gen, dtype=B.dtype)
        sent = hook.outgoing({KEY: LoraFactors(A, B, scale)})
        ups.append(ClientUpdate(k, n, hook.incoming(sent, {KEY: start})))
    return ups


def test_rounds_alternate_and_each_average_is_exact(gen):
    rolora = STRATEGIES["rolora"]()
    state = _start(rolora)
    for t in range(1, 5):
        hook = rolora.client_hook().for_round(t)
        assert hook.uploads == (("B",) if t % 2 else ("A",)) and hook.frozen == (("A",) if t % 2 else ("B",))
        ups = _clients(gen, rolora, state, t)
        before = state.factors[KEY]
        dense = before.delta() + sum(  # the old product plus the weighted mean of the clients' changes
            p * (u.factors[KEY].delta() - truncate_rank(before, u.factors[KEY].rank).delta())
            for p, u in zip(example_weights(ups), ups, strict=True)
        )
        ctx = RoundContext(t, 3, [{}] * 3, RMAX, lambda: {})
        state = rolora.aggregate(ups, state, None, ctx).state
        g = state.factors[KEY]
        assert_close(g.delta(), dense, rtol=1e-6, atol=1e-9)  # the dense reference
        frozen = g.A if t % 2 else g.B
        assert torch.equal(frozen, before.A if t % 2 else before.B)  # the other factor did not move
    # FedIT on the same kind of round (both factors changed) is not exact: the cross terms
    fedit = STRATEGIES["fedit"]()
    ups = _clients(gen, rolora, state, 1)
    mixed = [
        ClientUpdate(
            u.client_id,
            u.num_examples,
            {KEY: LoraFactors(u.factors[KEY].A + 0.5, u.factors[KEY].B, u.factors[KEY].scale)},
        )
        for u in ups
    ]
    dense = sum(p * u.factors[KEY].delta() for p, u in zip(example_weights(mixed), mixed, strict=True))
    assert not torch.allclose(fedit.aggregate(mixed, GlobalState()).state.factors[KEY].delta(), dense)


def test_one_factor_travels_up(gen):
    rolora = STRATEGIES["rolora"]()
    f = LoraFactors(torch.ones(4, IN), torch.ones(OUT, 4), 1.0)
    one = rolora.client_hook().for_round(1).outgoing({KEY: f})[KEY]
    two = rolora.client_hook().for_round(2).outgoing({KEY: f})[KEY]
    assert one.A.numel() == 0 and one.B.shape == (OUT, 4)
    assert two.B.numel() == 0 and two.A.shape == (4, IN)


def test_central_dp_noises_only_the_rounds_factor(gen):
    rolora = STRATEGIES["rolora"]()
    state = _start(rolora)
    state = rolora.aggregate(
        _clients(gen, rolora, state, 1), state, None, RoundContext(1, 3, [{}] * 3, RMAX, lambda: {})
    ).state
    state = GlobalState({KEY: LoraFactors(state.factors[KEY].A.float(), state.factors[KEY].B.float(), 1.0)})
    ups = [
        ClientUpdate(u.client_id, u.num_examples, {KEY: LoraFactors(f.A.float(), f.B.float(), f.scale)})
        for u in _clients(gen, rolora, state, 2)
        for f in [u.factors[KEY]]
    ]
    refs = [
        {KEY: truncate_rank(state.factors[KEY], u.factors[KEY].rank).with_scale(u.factors[KEY].scale)}
        for u in ups
    ]

    def dp(sigma):
        return DPStrategy(
            rolora,
            mode="central",
            clip_norm=1.0,
            noise_multiplier=sigma,
            noise_seed=0,
            epsilon_after=lambda r: 0.0,
            summary=lambda r: {},
        )

    ctx = RoundContext(2, 3, refs, RMAX, lambda: {})
    g = dp(1.0).aggregate(ups, state, None, ctx).state.factors[KEY]
    quiet = dp(0.0).aggregate(ups, state, None, ctx).state.factors[KEY]
    assert torch.equal(g.B, state.factors[KEY].B)  # B was frozen in round 2: no change, no noise
    noise = g.A - quiet.A  # the noise on the round's factor: std sigma C / m = 1/3 per coordinate
    assert 0.2 < float(noise.std()) < 0.5


@pytest.mark.parametrize(
    "over, refused",
    [
        (["client.algorithm=scaffold"], "A or B (a different one each round)"),
        (["aggregation.server_opt=fedadam"], None),
        (["privacy.mode=central", "lora.trainable_modules=[]"], None),
    ],
)
def test_what_rolora_refuses_and_accepts(over, refused):
    if refused is None:
        assert load_config(None, ["aggregation.name=rolora", *over]).aggregation.name == "rolora"
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_config(None, ["aggregation.name=rolora", *over])


def test_a_rolora_run_uploads_b_then_a(tmp_path, builtin_base):
    from conftest import tiny_overrides

    from fedllm.cli import main

    over = ["lora.trainable_modules=[]"]
    for name in ("rolora", "ffa", "fedit"):
        assert main(["run", *tiny_overrides(tmp_path / name, f"aggregation.name={name}", *over)]) == 0
    rows = {
        n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()][1:]
        for n in ("rolora", "ffa", "fedit")
    }
    assert all(r["n_updates"] == 4 for n in rows for r in rows[n])  # every client answered every round
    assert rows["rolora"][0]["up_bytes"] == rows["ffa"][0]["up_bytes"]  # round 1: B alone
    assert rows["rolora"][0]["up_bytes"] + rows["rolora"][1]["up_bytes"] == rows["fedit"][0]["up_bytes"]
