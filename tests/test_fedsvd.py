"""FedSVD (Lee et al., NeurIPS 2025): the exact average of B on the common A, re-factored by SVD into
orthonormal A and B = U S; under central DP the SVD runs on the noised sum; what travels; the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, RoundContext, example_weights
from fedllm.aggregation.fedsvd import ROUNDS
from fedllm.config import ConfigError, load_config
from fedllm.factors import LoraFactors, truncate_rank
from fedllm.privacy.strategy import DPStrategy

OUT, IN, RMAX = 12, 10, 8
KEY = "m.q_proj"


def _round(gen, state, ranks=(8, 4, 2), counts=(10, 30, 60)):
    """Clients of ``ranks`` training B against the leading rows of the global A (at mixed layer scales)."""
    A = state.factors[KEY].A
    ups = []
    for k, (r, n) in enumerate(zip(ranks, counts, strict=True)):
        scale = 16.0 / r if k % 2 else 2.0
        B = torch.randn(OUT, r, generator=gen, dtype=torch.float64)
        ups.append(ClientUpdate(k, n, {KEY: LoraFactors(A[:r].clone(), B, scale)}))
    return ups


def _start(strategy):
    st = GlobalState(strategy.initial_factors({KEY: (OUT, IN)}, RMAX, seed=5))
    f = st.factors[KEY]
    st.factors[KEY] = LoraFactors(f.A.double(), f.B.double(), 1.0)
    return st


def mean_change(g: LoraFactors, ups: list[ClientUpdate]) -> torch.Tensor:
    """The dense reference of a round that aggregates changes: the old global product plus the weighted mean
    of each client's product minus the part of the global it held (its leading ``r_k`` components)."""
    old = g.delta()
    return old + sum(
        p * (u.factors[KEY].delta() - truncate_rank(g, u.factors[KEY].rank).delta())
        for p, u in zip(example_weights(ups), ups, strict=True)
    )


def test_the_product_is_the_exact_weighted_average_and_a_has_orthonormal_rows(gen):
    fedsvd = STRATEGIES["fedsvd"]()
    state = _start(fedsvd)
    for _ in range(3):  # rounds: from round 2 on the clients train against the re-factored A
        ups = _round(gen, state)
        dense = mean_change(state.factors[KEY], ups)
        state = fedsvd.aggregate(ups, state).state
        g = state.factors[KEY]
        assert g.rank == RMAX
        assert_close(g.delta(), dense, rtol=1e-6, atol=1e-9)  # the dense reference
        assert_close(g.A @ g.A.T, torch.eye(RMAX, dtype=g.A.dtype), rtol=0, atol=1e-9)  # A = V^T
        norms = g.B.norm(dim=0)  # B = U S: orthogonal columns, descending norms (the singular values)
        assert torch.all(norms[:-1] >= norms[1:] - 1e-9)
        gram = g.B.T @ g.B
        assert_close(gram, torch.diag(torch.diagonal(gram)), rtol=0, atol=1e-8)
    assert state.extras[ROUNDS] == 3


@pytest.mark.parametrize("name", ["fedsvd", "rolora"])
@pytest.mark.parametrize("ranks", [(6, 4, 2), (2, 2, 2)], ids=["6-4-2", "all-rank-2"])
def test_a_round_in_which_no_client_changes_anything_leaves_the_product(gen, name, ranks):
    """Mixed ranks of a rank-6 federation, after a full-rank round made every component non-zero: each client
    returns exactly what it downloaded. The product does not move (zero-padded, FedSVD moved it by 13 % and
    RoLoRA by 4.7 % at 6/4/2; by 62 % and 88.5 % with rank-2 clients only)."""
    strategy = STRATEGIES[name]()
    rmax = max(ranks) if ranks[0] == 6 else 6
    state = GlobalState(strategy.initial_factors({KEY: (OUT, IN)}, rmax, seed=5))
    f = state.factors[KEY]
    state.factors[KEY] = LoraFactors(
        f.A.double(), torch.randn(OUT, rmax, generator=gen, dtype=torch.float64), 1.0
    )
    for t in (1, 2):  # RoLoRA: a B round and an A round
        before = state.factors[KEY].delta()
        ups = []
        for k, r in enumerate(ranks):
            scale = 16.0 / r if k % 2 else 2.0
            start = strategy.client_factors(state, r, scale, k)[KEY]
            A = state.factors[KEY].A[:r].clone() if start.A.shape[0] == 0 else start.A
            ups.append(ClientUpdate(k, 10 * (k + 1), {KEY: LoraFactors(A.clone(), start.B.clone(), scale)}))
        ctx = RoundContext(t, len(ranks), [{}] * len(ranks), rmax, lambda: {})
        state = strategy.aggregate(ups, state, None, ctx).state
        after = state.factors[KEY].delta()
        assert (after - before).norm() <= 1e-9 * before.norm(), (
            t,
            float((after - before).norm() / before.norm()),
        )


def _official_fedsvd_round(orig: dict, diffs: list[dict], ratio: list[float]) -> dict:
    """What seanie12/fed-svd's server does in a round, restated from reading it (fedmm/fedavg/server.py,
    ``Server.aggregate`` for ``model == 'fedavg'``, then ``misc/utils.py``'s ``reinit_lora``): every LoRA
    tensor becomes ``orig + sum_j ratio_j diff_j`` (A's diffs are zero: it is frozen), then the product
    ``B A = V S Uh`` is re-factored as ``A = Uh[:r]``, ``B = V[:, :r] diag(S[:r])``."""
    new = {k: orig[k] + sum(r * d[k] for r, d in zip(ratio, diffs, strict=True)) for k in orig}
    A, B = new["lora_A.default.weight"], new["lora_B.default.weight"]
    V, S, Uh = torch.linalg.svd(B @ A, full_matrices=False)
    r = A.size(0)
    return {"lora_A.default.weight": Uh[:r], "lora_B.default.weight": V[:, :r] @ torch.diag(S[:r])}


def test_equals_the_official_aggregation_on_the_same_arrays(gen):
    """One rank (the official code's setting) at scale 1 with FedAvg's example ratios: the same product, the
    same singular values (B's column norms) and the same row space of A; each singular vector's sign is
    the SVD's free choice (the official code's and ours may differ by a sign per direction)."""
    fedsvd = STRATEGIES["fedsvd"]()
    state = _start(fedsvd)
    state = fedsvd.aggregate(_round(gen, state, ranks=(8, 8, 8)), state).state  # a re-factored A
    g = state.factors[KEY]
    counts = (10, 30, 60)
    Bs = [torch.randn(OUT, RMAX, generator=gen, dtype=torch.float64) for _ in counts]
    ups = [
        ClientUpdate(k, n, {KEY: LoraFactors(g.A.clone(), B, 1.0)})
        for k, (n, B) in enumerate(zip(counts, Bs, strict=True))
    ]
    ours = fedsvd.aggregate(ups, state).state.factors[KEY]
    orig = {"lora_A.default.weight": g.A, "lora_B.default.weight": g.B}
    diffs = [{"lora_A.default.weight": torch.zeros_like(g.A), "lora_B.default.weight": B - g.B} for B in Bs]
    theirs = _official_fedsvd_round(orig, diffs, [n / sum(counts) for n in counts])
    tA, tB = theirs["lora_A.default.weight"], theirs["lora_B.default.weight"]
    assert_close(ours.delta(), tB @ tA, rtol=1e-6, atol=1e-9)
    assert_close(ours.B.norm(dim=0), tB.norm(dim=0), rtol=1e-6, atol=1e-9)
    assert_close(ours.A.T @ ours.A, tA.T @ tA, rtol=1e-6, atol=1e-9)
    signs = torch.sign((ours.A * tA).sum(1))  # per direction: +1 or -1, nothing else
    assert_close(ours.A, signs[:, None] * tA, rtol=1e-6, atol=1e-9)
    assert_close(ours.B, tB * signs[None, :], rtol=1e-6, atol=1e-9)


def test_the_svd_runs_on_the_noised_sum_under_central_dp(gen):
    """DP(FedSVD)'s product is exactly DP(FFA-LoRA)'s noised average of B on the same A (same noise seed):
    the noise goes on the sum of the uploads, and the SVD, after it, is post-processing."""

    def dp(name, sigma=1.0):
        return DPStrategy(
            STRATEGIES[name](),
            mode="central",
            clip_norm=5.0,
            noise_multiplier=sigma,
            noise_seed=3,
            epsilon_after=lambda r: 0.0,
            summary=lambda r: {},
        )

    fedsvd = STRATEGIES["fedsvd"]()
    state = _start(fedsvd)
    state = fedsvd.aggregate(_round(gen, state), state).state  # a re-factored A, as from round 2 on
    state = GlobalState({KEY: LoraFactors(state.factors[KEY].A.float(), state.factors[KEY].B.float(), 1.0)})
    ups = [
        ClientUpdate(u.client_id, u.num_examples, {KEY: LoraFactors(f.A.float(), f.B.float(), f.scale)})
        for u in _round(gen, state)
        for f in [u.factors[KEY]]
    ]
    g = state.factors[KEY]  # what each client started from: the leading components at its rank and scale
    ref = [{KEY: truncate_rank(g, u.factors[KEY].rank).with_scale(u.factors[KEY].scale)} for u in ups]
    ctx = RoundContext(2, 4, ref, RMAX, lambda: {})  # 4 sampled, 3 answered
    a = dp("fedsvd").aggregate(ups, state, None, ctx).state.factors[KEY]
    b = dp("ffa").aggregate(ups, state, None, ctx).state.factors[KEY]
    assert_close(a.delta(), b.delta(), rtol=1e-5, atol=1e-6)
    assert_close(a.A @ a.A.T, torch.eye(RMAX), rtol=0, atol=1e-5)
    assert not torch.allclose(b.A, a.A)  # FFA-LoRA keeps its A; FedSVD re-oriented it
    quiet = dp("fedsvd", sigma=0.0).aggregate(ups, state, None, ctx).state.factors[KEY]
    assert (a.delta() - quiet.delta()).norm() > 1e-3 * quiet.delta().norm()  # the noise is there


def test_round_one_sends_b_alone_then_a_travels(gen):
    fedsvd = STRATEGIES["fedsvd"]()
    state = _start(fedsvd)
    down = fedsvd.client_factors(state, 4, 0.5, 0)[KEY]
    assert down.A.shape == (0, IN) and down.B.shape == (OUT, 4)  # the client derives the seed's A
    state = fedsvd.aggregate(_round(gen, state), state).state
    down = fedsvd.client_factors(state, 4, 0.5, 0)[KEY]
    assert down.A.shape == (4, IN)
    assert_close(down.A, state.factors[KEY].A[:4])  # the 4 most energetic directions
    assert_close(0.5 * down.B, state.factors[KEY].B[:, :4])  # at the client's own scale
    hook = fedsvd.client_hook()
    fresh = {KEY: LoraFactors(torch.ones(4, IN), torch.zeros(OUT, 4), 0.5)}
    assert torch.equal(hook.start_factors({KEY: down}, fresh)[KEY].A, down.A)
    first = {KEY: LoraFactors(down.A[:0], down.B, 0.5)}
    assert torch.equal(hook.start_factors(first, fresh)[KEY].A, fresh[KEY].A)
    assert hook.outgoing({KEY: down})[KEY].A.numel() == 0  # uploads B only


@pytest.mark.parametrize(
    "over, words",
    [
        (["aggregation.server_opt=fedadam"], "re-factors the global product by SVD every round"),
        (["client.algorithm=scaffold"], "needs a strategy that averages parameters"),
    ],
)
def test_what_fedsvd_refuses(over, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["aggregation.name=fedsvd", *over])


def test_central_dp_is_accepted():
    cfg = load_config(None, ["aggregation.name=fedsvd", "privacy.mode=central", "lora.trainable_modules=[]"])
    assert cfg.aggregation.name == "fedsvd"


def test_a_fedsvd_run_is_ffa_until_its_a_moves_uploads_b_only_and_downloads_a_from_round_two(
    tmp_path, builtin_base
):
    """The same seeds: round 1's global model is FFA-LoRA's (the SVD does not change the product), from
    round 2 on the clients train against the re-oriented A, so the runs part."""
    from conftest import tiny_overrides

    from fedllm.cli import main

    over = ["lora.trainable_modules=[]", "federation.rounds=3"]
    for name in ("fedsvd", "ffa"):
        assert main(["run", *tiny_overrides(tmp_path / name, f"aggregation.name={name}", *over)]) == 0
    rows = {
        n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
        for n in ("fedsvd", "ffa")
    }
    for a, b in zip(rows["fedsvd"][1:], rows["ffa"][1:], strict=True):
        assert a["up_bytes"] == b["up_bytes"]  # B alone, as FFA-LoRA
    assert rows["fedsvd"][1]["down_bytes"] == rows["ffa"][1]["down_bytes"]  # round 1: B alone (zero B)
    assert rows["fedsvd"][2]["down_bytes"] > rows["ffa"][2]["down_bytes"]  # then A too
    svd, ffa = ([r["eval_loss"] for r in rows[n]] for n in ("fedsvd", "ffa"))
    assert svd[1] == pytest.approx(ffa[1], rel=1e-5) and svd[2] != pytest.approx(ffa[2], rel=1e-5)


@pytest.mark.parametrize(
    "over",
    [
        ["aggregation.name=fedsvd"],
        pytest.param(["aggregation.name=fedsa", "aggregation.fedsa.share_b_every=2"], marks=pytest.mark.slow),
        pytest.param(["aggregation.name=rolora"], marks=pytest.mark.slow),
    ],
)
def test_a_resumed_run_keeps_the_strategys_counters(tmp_path, builtin_base, over):
    """Two rounds, a resume to three, against three straight: the same global adapter. FedSVD's count of
    re-factorings decides whether A travels, FedSA-LoRA's whether B is shared: both are plain numbers of the
    strategy's state, which a checkpoint once dropped (a resumed FedSVD client trained on the seed's A)."""
    from conftest import assert_resume_matches_straight

    assert_resume_matches_straight(tmp_path, *over, "lora.trainable_modules=[]")
