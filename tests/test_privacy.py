"""Differential privacy (fedllm/privacy/) and FFA-LoRA: the clip bounds a hostile client, zero updates
release pure noise of the stated size, epsilon is dp-accounting's, a resumed run spends what an
uninterrupted one does, and FFA-LoRA's average of B is the exact average of the clients' updates."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, RoundContext, example_weights
from fedllm.config import ConfigError, load_config
from fedllm.factors import LoraFactors, init_factors
from fedllm.privacy import epsilon, noise_for_epsilon
from fedllm.privacy.strategy import DPStrategy
from fedllm.privacy.transform import ClipAndNoise
from fedllm.protocol import ClientStart, UploadContext
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


def central(clip: float, sigma: float) -> DPStrategy:
    """FedIT wrapped for central DP (reproducible noise, the clip statistics reported)."""
    return DPStrategy(
        STRATEGIES["fedit"](),
        mode="central",
        clip_norm=clip,
        noise_multiplier=sigma,
        noise_seed=0,
        epsilon_after=lambda rounds: 0.0,
        summary=lambda rounds: {},
        report_clip_stats=True,
    )


def round1(m: int, refs: list) -> RoundContext:
    """Round 1 of clients of rank 8 that started from the shared initialization (seed 3)."""
    return RoundContext(1, m, refs, 8, lambda: init_factors(SHAPES, 8, 1.0, seed=3))


def released_change(state: GlobalState, base: dict) -> torch.Tensor:
    return torch.cat(
        [
            torch.cat(
                [(state.factors[k].A - base[k].A).flatten(), (state.factors[k].B - base[k].B).flatten()]
            )
            for k in base
        ]
    )


def clip_on_site(update: ClientUpdate, ref: dict, clip: float, std: float = 0.0) -> ClientUpdate:
    """What a site's upload transform makes of ``update`` (it started round 1 from ``ref``)."""
    ctx = UploadContext(ClientStart(round=1), ref, {})
    return ClipAndNoise(clip, std, noise_seed=0).apply(update, ctx)


def test_a_hostile_update_contributes_at_most_the_clip():
    """A client whose change is 1e4 times an honest one's moves the noiseless mean by at most C / m."""
    gen = torch.Generator().manual_seed(0)
    base = {k: f.folded() for k, f in init_factors(SHAPES, 8, 1.0, seed=3).items()}
    ref = {k: LoraFactors(f.A, f.B / 2.0, 2.0) for k, f in base.items()}  # rank 8 at scale 2
    hostile = ClientUpdate(0, 10, moved(ref, gen, 1e4))
    for m in (1, 4):
        result = central(0.5, 0.0).aggregate([hostile], GlobalState(), None, round1(m, [ref]))
        change = released_change(result.state, base)
        assert float(change.norm()) <= 0.5 / m * (1 + 1e-5) and float(change.norm()) > 0.4 / m
        assert result.info["dp_clipped"] == 1
    # a site that clipped its own change (as every fedllm client does) is not counted as re-clipped
    clipped = clip_on_site(ClientUpdate(0, 10, moved(ref, gen, 1e4)), ref, 0.5)
    result = central(0.5, 0.0).aggregate([clipped], GlobalState(), None, round1(1, [ref]))
    assert result.info["dp_clipped"] == 0


def test_zero_changes_release_pure_noise_of_the_stated_size():
    """All clients send back what they were given: the global change is Gaussian noise with standard
    deviation noise_multiplier * C / m on every coordinate (a fixed-seed statistical check)."""
    base = {k: f.folded() for k, f in init_factors(SHAPES, 8, 1.0, seed=3).items()}
    ref = {k: LoraFactors(f.A, f.B / 2.0, 2.0) for k, f in base.items()}
    ups = [
        ClientUpdate(k, 10, {m: LoraFactors(f.A.clone(), f.B.clone(), 2.0) for m, f in ref.items()})
        for k in range(5)
    ]
    sigma, clip, m = 1.3, 0.7, 5
    result = central(clip, sigma).aggregate(ups, GlobalState(), None, round1(m, [ref] * 5))
    noise = released_change(result.state, base)
    assert noise.numel() > 1500
    assert float(noise.std()) == pytest.approx(sigma * clip / m, rel=0.05)
    assert abs(float(noise.mean())) < 4 * sigma * clip / m / math.sqrt(noise.numel())


def test_a_client_clips_its_change_and_in_local_mode_noises_it():
    start = init_factors(SHAPES, 4, 2.0, seed=5)
    dense0 = {"embed": torch.zeros(10, 4)}
    ctx = UploadContext(ClientStart(round=1, dense=dense0), start, {})

    def upload():
        g = torch.Generator().manual_seed(7)
        return ClientUpdate(0, 10, moved(start, g, 0.5), {"embed": torch.ones(10, 4)})

    f = ClipAndNoise(0.3, 0.0, noise_seed=0).apply(upload(), ctx)
    change = [f.factors[k].A - start[k].A for k in start] + [
        (f.factors[k].B - start[k].B) * 2.0 for k in start
    ]
    change.append(f.dense["embed"])
    assert math.sqrt(sum(float(c.pow(2).sum()) for c in change)) == pytest.approx(0.3, rel=1e-5)
    f2 = ClipAndNoise(0.3, 0.1, noise_seed=0).apply(upload(), ctx)
    noise = torch.cat([(f2.factors[k].A - f.factors[k].A).flatten() for k in start])
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
        "privacy.delta=1e-5",
        "lora.trainable_modules=[]",
        *extra,
    )


@pytest.mark.parametrize("strategy", ["fedit", pytest.param("ffa", marks=pytest.mark.slow)])
def test_a_dp_run_reports_epsilon_and_a_resumed_run_spends_the_same(tmp_path, builtin_base, strategy, capsys):
    from fedllm.cli import main

    assert main(["run", *dp_overrides(tmp_path / "a", f"aggregation.name={strategy}")]) == 0
    assert main(["run", "--resume", str(tmp_path / "a"), "federation.rounds=3"]) == 0
    assert (
        main(["run", *dp_overrides(tmp_path / "b", f"aggregation.name={strategy}", "federation.rounds=3")])
        == 0
    )
    out = capsys.readouterr().out
    assert "-DP at the user level after 3 rounds, central" in out
    resumed = json.loads((tmp_path / "a" / "summary.json").read_text())["privacy"]
    straight = json.loads((tmp_path / "b" / "summary.json").read_text())["privacy"]
    assert resumed["epsilon"] == straight["epsilon"] == epsilon("central", 8, 4, 1.2, 3, 1e-5)
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()][1:]
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[-1] == straight["epsilon"]
    card_dir = tmp_path / "card"
    assert main(["export", str(tmp_path / "b"), "--output", str(card_dir)]) == 0
    assert "| guarantee | (" in (card_dir / "README.md").read_text()


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
        (["aggregation.fedit.robust=median"], "aggregation.fedit.robust is data-dependent"),
        (
            ["comm.upload=int8"],
            "comm.upload = int8 with comm.error_feedback = true: each client keeps state between rounds, .*"
            "privacy.sampling = secret: the accountant's amplification assumes the sample hidden",
        ),
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


@pytest.mark.slow
def test_privacy_helper_prints_the_noise_for_a_target(capsys):
    from fedllm.cli import main

    assert (
        main(["privacy", "--clients", "100", "--per-round", "10", "--rounds", "20", "--target-epsilon", "4"])
        == 0
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["epsilon"] == pytest.approx(4.0, rel=1e-3) and 1 < last["noise_multiplier"] < 3


# ---- the review's probes: the guarantee holds at its corners ----------------------------------------


def test_the_sample_is_secret_and_the_run_folder_never_names_it(tmp_path, builtin_base):
    """privacy.sampling=secret (the default): rows carry counts, not ids; the ledger keeps totals only; the
    reported epsilon is the amplified one. privacy.sampling=public: the seeded sample is written, and the
    epsilon is the unamplified Gaussian over the most-sampled client's rounds, replayed from the seed."""
    from fedllm.cli import main
    from fedllm.privacy.accountant import unamplified
    from fedllm.run import checkpoint as ckpt
    from fedllm.server import Sampling

    assert main(["run", *dp_overrides(tmp_path / "secret", "federation.rounds=3")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "secret" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all("sampled" not in r and "client_loss" not in r and r["n_sampled"] == 4 for r in rows)
    everything = "".join(p.read_text() for p in (tmp_path / "secret").rglob("*.json*"))
    assert '"sampled"' not in everything and '"client_loss"' not in everything
    summary = json.loads((tmp_path / "secret" / "summary.json").read_text())
    assert "per_client" not in summary["communication"]  # how often each client uploaded: not kept
    _, _, meta = ckpt.load_latest(tmp_path / "secret")
    assert set(meta["ledger"]["up"]) == {"-1"}
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilon("central", 8, 4, 1.2, 3, 1e-5))

    public = dp_overrides(tmp_path / "public", "federation.rounds=3", "privacy.sampling=public")
    assert main(["run", *public]) == 0
    rows = [json.loads(x) for x in (tmp_path / "public" / "metrics.jsonl").read_text().splitlines()][1:]
    sampling = Sampling(seed=0, clients_per_round=4)
    replay = [sampling.draw(r, list(range(8)))[0] for r in (1, 2, 3)]
    assert [r["sampled"] for r in rows] == replay  # the adversary's replay of federation.seed
    most = max(sum(k in s for s in replay) for k in range(8))
    eps = json.loads((tmp_path / "public" / "summary.json").read_text())["privacy"]["epsilon"]
    assert eps == pytest.approx(unamplified(1.2, most, 1e-5))


def test_under_local_dp_everything_that_leaves_a_site_is_clipped_and_noised(tmp_path, builtin_base):
    """FedSA-LoRA sharing B under local DP: the shared B travels clipped and noised like A, never raw."""
    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import faulty

    uploads = []
    cfg = load_config(
        None,
        dp_overrides(
            tmp_path / "r",
            "privacy.mode=local",
            "privacy.noise_multiplier=2.0",
            "aggregation.name=fedsa",
            "aggregation.fedsa.share_b_every=1",
            "eval.personalized=false",
        ),
    )
    sim = faulty(Simulation)(cfg, tmp_path / "r", fault=lambda r, k, u: uploads.append(u) or u)
    sim.setup()
    sim.run()
    shared = torch.cat(
        [t.flatten() for u in uploads for k, t in u.extras.items() if k.startswith("B_shared.")]
    )
    assert shared.numel() > 1000
    assert float(shared.std()) == pytest.approx(2.0 * 0.5, rel=0.15)  # noise of sigma C, not a raw B


def test_clip_statistics_stay_out_of_a_dp_run_unless_asked(tmp_path, builtin_base):
    from fedllm.cli import main

    assert main(["run", *dp_overrides(tmp_path / "a")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()][1:]
    assert not any(k.startswith("agg_dp_") for r in rows for k in r)
    assert main(["run", *dp_overrides(tmp_path / "b", "privacy.report_clip_stats=true")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all("agg_dp_update_norm_median" in r for r in rows)


@pytest.mark.slow
def test_the_printed_noise_multiplier_meets_its_target(capsys, tmp_path):
    """`fedllm privacy` rounds up: the printed value spends at most the target, and a config with it and
    privacy.target_epsilon set to that target loads."""
    from fedllm.cli import main

    args = ["privacy", "--clients", "1000", "--per-round", "100", "--rounds", "20", "--target-epsilon", "4"]
    assert main(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["epsilon"] <= 4.0 and f"{last['noise_multiplier']:.4f}" == f"{last['noise_multiplier']}"
    load_config(
        None,
        [
            "federation.num_clients=1000",
            "federation.clients_per_round=100",
            "federation.rounds=20",
            "privacy.mode=central",
            f"privacy.noise_multiplier={last['noise_multiplier']}",
            "privacy.target_epsilon=4",
            "eval.personalized=false",
        ],
    )


def test_privacy_settings_without_a_mode_are_refused():
    with pytest.raises(ConfigError, match=r"privacy.mode=none ignores privacy.clip_norm, privacy.noise_mult"):
        load_config(None, ["privacy.noise_multiplier=1.1", "privacy.clip_norm=0.5"])


def test_a_round_released_before_a_crash_is_never_noised_again(tmp_path, builtin_base):
    """The round's checkpoint is written before anything made from its result leaves the server: a run that
    stops after it (here: in the evaluation of round 2) resumes at round 3 with round 2's own noisy model
    and finishes round 2's row, instead of training round 2 again with fresh noise."""
    from fedllm.config import load_config
    from fedllm.run import checkpoint as ckpt
    from fedllm.simulation import Simulation

    overrides = dp_overrides(tmp_path / "r", "federation.rounds=3", "privacy.noise_seed=-1")
    sim = Simulation(load_config(None, overrides), tmp_path / "r")
    sim.setup()
    evaluate = sim.evaluate
    calls = []

    def crash_in_round_2(round_idx, *visit):
        calls.append(1)
        if len(calls) == 3:  # before round 1, after round 1, after round 2
            raise KeyboardInterrupt
        return evaluate(round_idx, *visit)

    sim.evaluate = crash_in_round_2
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    _, tensors, meta = ckpt.load_latest(tmp_path / "r")
    assert meta["round"] == 2
    resumed = Simulation(load_config(tmp_path / "r" / "config.yaml"), tmp_path / "r")
    resumed.setup()
    resumed.run(resume=True)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and "eval_loss" in rows[2]
    path = tmp_path / "r" / "checkpoints" / "round-0002"
    if path.exists():  # round 2's state is the one released before the crash, not a redrawn one
        again, _ = ckpt.load_checkpoint(path)
        assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def _per_client_rounds(obj, path="") -> list[str]:
    """Where a JSON object holds a map from client ids to integers (a round per client), by path."""
    found = []
    if isinstance(obj, dict):
        if (
            obj
            and all(isinstance(k, str) and k.isdigit() for k in obj)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in obj.values())
        ):
            found.append(path)
        for k, v in obj.items():
            found += _per_client_rounds(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _per_client_rounds(v, f"{path}[{i}]")
    return found


def test_a_secret_sample_run_writes_no_trace_of_who_was_sampled(tmp_path, builtin_base, caplog, capsys):
    """Under privacy.sampling=secret nothing the run writes names a round's clients: the log (a failing
    client included), every file name and text of the run folder (rows, summary, checkpoints' metadata,
    the pending row), the report. The sample is recorded by the test, from the server, and searched for."""
    import re

    from fedllm.cli import main
    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import faulty

    run_dir = tmp_path / "secret"
    cfg = load_config(None, dp_overrides(run_dir, "federation.rounds=3", "eval.personalized=true"))
    samples: dict[int, list[int]] = {}

    def fail_the_smallest(round_idx, client_id, update):
        if client_id == min(samples[round_idx]):
            raise RuntimeError(f"client {client_id} ran out of memory")  # a reason that names its client
        return update

    sim = faulty(Simulation)(cfg, run_dir, fault=fail_the_smallest)
    sim.setup()
    plan_round = sim.server.plan_round

    def recorded(round_idx):
        plan = plan_round(round_idx)
        samples[round_idx] = sorted(plan.sampled)
        return plan

    sim.server.plan_round = recorded
    with caplog.at_level("DEBUG", logger="fedllm"):
        sim.run()
    assert main(["report", str(run_dir), "--output", str(tmp_path / "report")]) == 0
    assert len(samples) == 3 and all(len(s) == 4 for s in samples.values())
    assert len({tuple(s) for s in samples.values()}) > 1  # the sample changes: there is something to find

    formatter = logging.Formatter()
    said = [
        r.getMessage() + (formatter.formatException(r.exc_info) if r.exc_info else "")
        for r in caplog.records
        if r.name != "fedllm.run.folder"  # the partition's lines: every client, before any round
    ]
    named = [m for m in said if re.search(r"clients? \[?\d", m)]
    assert not named, named[:3]  # the partition's lines (every client, before any round) are the only ones
    assert "round 2: a client left out: client # ran out of memory" in caplog.text  # reported, anonymously
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not [p for p in files if re.search(r"client-\d", p.name)]
    texts = {p: p.read_text() for p in files if p.suffix in (".json", ".jsonl", ".yaml", ".md", ".txt")}
    texts[tmp_path / "report.out"] = capsys.readouterr().out
    texts.update({p: p.read_text() for p in (tmp_path / "report").rglob("*") if p.suffix in (".md", ".json")})
    for path, text in texts.items():
        for line in text.splitlines():
            for r, s in samples.items():
                assert json.dumps(s) not in line.replace(" ", "").replace(",", ", "), (path, r, s)
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            assert not _per_client_rounds(obj), (path, _per_client_rounds(obj))
        if path.suffix == ".json":
            assert not _per_client_rounds(json.loads(text)), (path, _per_client_rounds(json.loads(text)))


@pytest.mark.parametrize("n, delta, guarantee", [(5, 0.0, False), (5, 1e-5, True), (1000, 0.0, True)])
def test_a_delta_above_one_in_a_thousand_is_never_printed_as_a_guarantee(tmp_path, n, delta, guarantee):
    """With 5 clients the default delta 1 / N^1.1 is 0.17: the config warns (naming privacy.delta) and the
    summary's line says there is no guarantee; an explicit small delta, or 1,000 clients' default (5e-4),
    is a guarantee line."""
    import warnings

    from fedllm.privacy import PRIVACY, DeltaWarning

    over = tiny_overrides(
        tmp_path, f"federation.num_clients={n}", "federation.clients_per_round=3", "privacy.mode=central"
    )
    over += [f"privacy.delta={delta}"] if delta else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, over)
    warned = [w for w in caught if issubclass(w.category, DeltaWarning)]
    assert bool(warned) == (not guarantee)
    assert not warned or "privacy.delta" in str(warned[0].message)
    (line,) = PRIVACY.summary(cfg, 2)["guarantees"]
    if guarantee:
        assert line.startswith("(") and "-DP at the user level" in line
    else:
        assert line.startswith("no differential-privacy guarantee: delta 0.17 > 0.001"), line
