"""Multi-seed comparisons: statistics by hand, and a small comparison end to end."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from fedllm.run.compare import describe, format_summary, paired, parse_variant, summarize, t_quantile
from tests.conftest import tiny_overrides


def test_statistics_hand_computed():
    d = describe([0.5, 0.7, 0.6])
    assert d["mean"] == pytest.approx(0.6) and d["std"] == pytest.approx(0.1) and d["n"] == 3
    # differences 0.19, 0.21, 0.20: mean 0.2, sd 0.01, half width t(2) * 0.01 / sqrt(3) = 4.303 * 0.00577
    p = paired([0.69, 0.71, 0.7], [0.5, 0.5, 0.5])
    half = 4.303 * 0.01 / math.sqrt(3)
    assert p["diff"] == pytest.approx(0.2) and p["low"] == pytest.approx(0.2 - half)
    assert p["high"] == pytest.approx(0.2 + half) and p["excludes_zero"]
    noisy = paired([0.6, 0.4, 0.55], [0.5, 0.5, 0.5])  # mean +0.017, sd 0.104: the interval holds 0
    assert not noisy["excludes_zero"] and noisy["low"] < 0 < noisy["high"]
    assert t_quantile(1) == pytest.approx(12.706) and t_quantile(30) == pytest.approx(2.042)
    assert t_quantile(500) == 1.96


def test_summary_names_no_winner_when_the_interval_holds_zero():
    results = {
        "a": {0: {"accuracy": 0.5}, 1: {"accuracy": 0.6}, 2: {"accuracy": 0.55}},
        "b": {0: {"accuracy": 0.6}, 1: {"accuracy": 0.4}, 2: {"accuracy": 0.6}},
    }
    for r in results.values():
        for m in r.values():
            m.update(
                {
                    k: None
                    for k in (
                        "accuracy_gain",
                        "heldout_loss",
                        "heldout_loss_drop",
                        "client_acc_global",
                        "client_acc_personal",
                        "up_params",
                        "down_params",
                        "wall_s",
                    )
                }
            )
    s = summarize(results)
    assert s["baseline"] == "a" and s["seeds"] == [0, 1, 2] and list(s["metrics"]) == ["accuracy"]
    text = format_summary(s)
    assert "interval holds 0: no difference shown" in text and "diff -1.7 points [" in text


def test_variant_syntax_errors_name_the_variant():
    assert parse_variant("flora:aggregation.name=flora,lora.dropout=0.1").overrides == [
        "aggregation.name=flora",
        "lora.dropout=0.1",
    ]
    assert parse_variant("base").overrides == []
    with pytest.raises(ValueError, match="'x-y:a=b': the name before ':' must be an identifier"):
        parse_variant("x-y:a=b")
    with pytest.raises(ValueError, match="'v:nokey': 'nokey' is not key=value"):
        parse_variant("v:nokey")


@pytest.mark.slow
def test_compare_runs_every_variant_on_the_same_partitions(tmp_path, builtin_base, capsys):
    from fedllm.cli import main

    common = [
        o
        for o in tiny_overrides(tmp_path, "federation.rounds=1", "eval.personalized=false")
        if not o.startswith("output.dir")
    ]
    assert (
        main(
            [
                "compare",
                "--variant",
                "fedit:aggregation.name=fedit",
                "--variant",
                "flora:aggregation.name=flora",
                "--seeds",
                "2",
                "--jobs",
                "2",
                "--output-dir",
                str(tmp_path / "cmp"),
                *common,
            ]
        )
        == 0
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # last line: one JSON object
    assert last["seeds"] == [0, 1] and last["baseline"] == "fedit"
    assert (
        set(last["metrics"]["accuracy"]) == {"fedit", "flora"}
        and "vs_fedit" in last["metrics"]["accuracy"]["flora"]
    )
    part = {
        (v, s): (tmp_path / "cmp" / v / f"seed-{s}" / "partition.json").read_text()
        for v in ("fedit", "flora")
        for s in (0, 1)
    }
    assert part[("fedit", 0)] == part[("flora", 0)] and part[("fedit", 1)] == part[("flora", 1)]
    assert part[("fedit", 0)] != part[("fedit", 1)]  # another seed, another partition
    acc = last["per_seed"]["flora"]["1"]["accuracy"]
    assert (
        acc
        == json.loads((tmp_path / "cmp" / "flora" / "seed-1" / "summary.json").read_text())["accuracy_after"]
    )


@pytest.mark.slow
def test_compare_never_reuses_a_run_of_other_settings(tmp_path, builtin_base, capsys):
    """The same command reuses its runs; a changed shared override is refused naming the key (no run
    starts), and with --rerun runs again and changes the numbers."""
    from fedllm.cli import main

    common = [
        o
        for o in tiny_overrides(tmp_path, "federation.rounds=1", "eval.personalized=false")
        if not o.startswith("output.dir")
    ]
    argv = ["compare", "--variant", "fedit:aggregation.name=fedit", "--seeds", "1"]
    argv += ["--output-dir", str(tmp_path / "cmp"), *common]

    def last_json() -> dict:
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert main(argv) == 0
    first = last_json()
    assert first["config_digests"]["fedit"] and first["common_overrides"] == common
    assert (tmp_path / "cmp" / "fedit" / "seed-0.log").read_text()  # the run's log, kept beside it
    assert main(argv) == 0
    again = capsys.readouterr()
    assert "reused (same settings)" in again.err
    assert json.loads(again.out.strip().splitlines()[-1])["per_seed"] == first["per_seed"]
    changed = [*argv, "client.lr=0.03"]
    with pytest.raises(SystemExit) as e:
        main(changed)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "client.lr: 0.003 there, 0.03 asked" in err and "--rerun" in err
    assert main([*changed, "--rerun"]) == 0
    rerun = last_json()
    assert rerun["config_digests"]["fedit"] != first["config_digests"]["fedit"]
    assert rerun["per_seed"]["fedit"]["0"]["heldout_loss"] != first["per_seed"]["fedit"]["0"]["heldout_loss"]
    cfg = (tmp_path / "cmp" / "fedit" / "seed-0" / "config.yaml").read_text()
    assert "lr: 0.03" in cfg


def test_an_infinite_epsilon_is_summarized_not_a_crash():
    """A DP run without noise spends epsilon = inf: the table says so instead of failing at the end of a
    long comparison (it did, in statistics.stdev)."""
    results = {
        "dp": {s: {"accuracy": 0.5 + s / 100, "epsilon": 4.0} for s in range(3)},
        "clip_only": {s: {"accuracy": 0.52 + s / 100, "epsilon": math.inf} for s in range(3)},
    }
    s = summarize(results)
    eps = s["metrics"]["epsilon"]
    assert eps["dp"]["std"] == 0.0 and eps["clip_only"]["mean"] == math.inf
    assert math.isnan(eps["clip_only"]["std"]) and math.isnan(eps["clip_only"]["vs_dp"]["low"])
    assert s["metrics"]["accuracy"]["clip_only"]["vs_dp"]["diff"] == pytest.approx(0.02)
    format_summary(s)
    json.dumps(s)


def test_a_within_run_gain_gets_its_own_interval_over_the_seeds():
    """A gain (after minus before, in each run) is paired by construction: its 95% t interval says whether
    the runs changed the metric at all, for the baseline as for every variant."""
    gains = {0: 0.068, 1: 0.057, 2: 0.061}
    results = {"only": {s: {"rouge_l_gain": g} for s, g in gains.items()}}
    s = summarize(results)
    own = s["metrics"]["rouge_l_gain"]["only"]["vs_before"]
    mean = sum(gains.values()) / 3
    half = 4.303 * statistics.stdev(gains.values()) / 3**0.5  # t(0.975, 2 df)
    assert own["diff"] == pytest.approx(mean) and own["low"] == pytest.approx(mean - half, rel=1e-3)
    assert own["excludes_zero"]
    assert "95% interval [" in format_summary(s) and "(holds 0)" not in format_summary(s)
    mixed = summarize(
        {"only": {0: {"rouge_l_gain": 0.05}, 1: {"rouge_l_gain": -0.04}, 2: {"rouge_l_gain": 0.01}}}
    )
    assert "(holds 0)" in format_summary(mixed)
    assert (
        "vs_before"
        not in summarize({"only": {0: {"accuracy": 0.5}, 1: {"accuracy": 0.6}}})["metrics"]["accuracy"][
            "only"
        ]
    )


def _script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_method_table_reads_one_identity_the_shared_seeds_and_the_clips(tmp_path, monkeypatch, capsys):
    """scripts/method_table.py, the reader of a table that spans sittings: a run made by other code is named
    and left out (and so is its seed, for every row); an unfinished run does not count; the rows are compared
    over the seeds every row has; the clipped updates are counted per run; the pre-registered contrast is
    the paired difference over the shared seeds; --figure draws the corrected families."""
    table = _script("method_table")
    ident = {"source": {"digest": "aaa", "commit": "111"}, "tokens": 7, "model": "m", "precision": "float32"}
    loss = {
        "fedit": [1.70, 1.69, 1.71, 1.7],
        "flexlora": [1.66, 1.65, 1.68, 1.6],
        "clip": [1.67, 1.66, 1.70, 1.6],
    }

    def make(variant: str, seed: int, identity: dict, clipped: list[int], finished: bool = True) -> None:
        run = tmp_path / variant / f"seed-{seed}"
        run.mkdir(parents=True)
        (run / "run_info.json").write_text(json.dumps({"fedllm_version": "0.1.0", "identity": identity}))
        rows = [{"round": r + 1, "agg_clipped": c} for r, c in enumerate(clipped)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if finished:
            (run / "summary.json").write_text(json.dumps({"loss_after": loss[variant][seed]}))

    for v in loss:
        for seed in range(3):
            make(v, seed, ident, [1, 0, 2] if v == "clip" else [0, 0, 0])
    other = {**ident, "source": {"digest": "bbb", "commit": "222"}}
    make("flexlora", 3, other, [0, 0, 0])  # made by other code: left out
    make("fedit", 3, ident, [0, 0, 0])
    make("clip", 3, ident, [1, 0, 2])  # seed 3 in every row but for the run of other code: not shared
    (tmp_path / "flexlora" / "seed-2" / "summary.json").unlink()  # unfinished: seed 2 is not every row's
    figure = tmp_path / "table.png"
    monkeypatch.setattr(
        "sys.argv",
        ["method_table.py", str(tmp_path), "--reference", "clip", "--contrast", "clip:flexlora",
         "--metrics", "heldout_loss", "--figure", str(figure)],
    )  # fmt: skip
    table.main()
    out, err = capsys.readouterr()
    assert "flexlora/seed-3" in err and "made by other code" in err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["seeds"] == [0, 1]
    assert result["identity"]["source"]["digest"] == "aaa"
    assert result["clipped"] == {"fedit": [0, 0, 0, 0], "clip": [3, 3, 3, 3], "flexlora": [0, 0]}
    c = result["contrasts"]["clip:flexlora heldout_loss"]
    assert c["diff"] == pytest.approx(0.01) and c["n"] == 2
    fam = result["summary"]["corrected"]["heldout_loss"]["vs_baseline"]
    assert fam["m"] == 2 and {x["name"] for x in fam["comparisons"]} == {"flexlora", "clip"}
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_keep_runs_copies_finished_runs_without_their_checkpoints(tmp_path):
    """scripts/keep_runs.py, what a table that spans sittings commits: a finished run's small files byte for
    byte and its log beside it, never its checkpoints; an unfinished run left out (the comparison runs it
    again); the comparison's own table files."""
    keep = _script("keep_runs")
    src, dest = tmp_path / "runs", tmp_path / "kept"
    done, cut = src / "fedit" / "seed-0", src / "fedit" / "seed-1"
    for run in (done, cut):
        (run / "checkpoints" / "round-1").mkdir(parents=True)
        (run / "checkpoints" / "round-1" / "adapter.safetensors").write_bytes(b"\0" * 64)
        (run / "config.yaml").write_text("seed: x\n")
        (run / "metrics.jsonl").write_text('{"round": 1}\n')
    (done / "summary.json").write_text('{"loss_after": 1.5}')
    (src / "fedit" / "seed-0.log").write_text("log\n")
    (src / "compare.png").write_bytes(b"\x89PNG")
    tuned = src / "tuning" / "fedit" / "client.lr=0.001" / "seed-1000"  # a tuned comparison's grid run
    tuned.mkdir(parents=True)
    (tuned / "summary.json").write_text('{"loss_after": 1.4}')
    (src / "tuning" / "tuning.json").write_text("{}")
    old = src / ".superseded" / "fedit-seed-0-20261207" / "seed-0"  # a run of other code: not kept
    old.mkdir(parents=True)
    (old / "summary.json").write_text("{}")
    out = keep.keep(src, dest)
    assert out["kept"] == ["fedit/seed-0", "tuning/fedit/client.lr=0.001/seed-1000"]
    assert out["unfinished"] == ["fedit/seed-1"]
    assert (dest / "tuning" / "tuning.json").exists() and not (dest / ".superseded").exists()
    kept = dest / "fedit" / "seed-0"
    assert sorted(p.name for p in kept.iterdir()) == ["config.yaml", "metrics.jsonl", "summary.json"]
    assert (kept / "summary.json").read_bytes() == (done / "summary.json").read_bytes()
    assert (dest / "fedit" / "seed-0.log").read_text() == "log\n" and (dest / "compare.png").exists()
    assert not (dest / "fedit" / "seed-1").exists()


def test_rank_energy_reads_the_spectrum_of_factors_and_merged_residual_exactly(tmp_path):
    """The top-k energy shares of scripts/rank_energy.py equal those of the dense update's own singular
    values, whether the checkpoint keeps a module as factors (any split of the singular values, a scale),
    as a dense residual or as both; a module with no update is left out of the mean."""
    import torch

    from fedllm.factors import DenseDelta, LoraFactors

    energy = _script("rank_energy")
    g = torch.Generator().manual_seed(0)
    s = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    u, _ = torch.linalg.qr(torch.randn(40, 6, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 6, generator=g, dtype=torch.float64))
    # B = U S^0.3, A = S^0.7 V^T at scale 2: delta = 2 U S V^T
    f = LoraFactors((s**0.7)[:, None] * v.T, u * s**0.3, 2.0)
    e = (2 * s) ** 2
    want = {k: float(e[:k].sum() / e.sum()) for k in (1, 2, 4, 8)}
    got = energy.energy_shares(energy.spectrum(f), (1, 2, 4, 8))
    assert got == pytest.approx(want, rel=1e-9)
    assert got[8] == pytest.approx(1.0)  # past the rank
    # energies 100, 36, 16, 4, 1, 0.25: the top 2 hold 0.865, the top 3 0.967
    assert energy.energy_rank(energy.spectrum(f), 0.9) == 3
    assert energy.energy_rank(energy.spectrum(f), 0.86) == 2
    dense = DenseDelta(f.delta())
    assert energy.energy_shares(energy.spectrum(dense), (1, 2)) == pytest.approx(
        {1: want[1], 2: want[2]}, rel=1e-9
    )
    zero = LoraFactors(torch.zeros(2, 30, dtype=torch.float64), torch.zeros(40, 2, dtype=torch.float64))
    out = energy.round_energy({"a": f, "b": dense, "z": zero}, (1, 2))
    assert out["modules"] == 2 and out["top_k"]["1"] == pytest.approx(want[1])
    assert out["top_k_std"]["1"] == pytest.approx(0.0, abs=1e-9) and out["rank90"] == 3

    # through a real checkpoint read as the run's strategy reads it: the top 2 directions in the global
    # adapter (scale 2), the rest merged into the base (the residual) at scale 0.5 with B 4x: only their sum,
    # scales applied, has the spectrum above (the global adapter alone: top-1 share 100/136; the residual's
    # scale ignored: 16 x its energy)
    from fedllm.config import Config, save_config
    from fedllm.factors import adapter_tensors
    from fedllm.run.checkpoint import save_checkpoint

    top = LoraFactors(f.A[:2], f.B[:, :2], 2.0)
    rest = LoraFactors(f.A[2:], 4 * f.B[:, 2:], 0.5)
    tensors_g, scales_g = adapter_tensors({"m": top}, "global.")
    tensors_r, scales_r = adapter_tensors({"m": rest}, "residual.")
    run = tmp_path / "run"
    cfg = Config()
    cfg.aggregation.name = "flexlora"
    cfg.aggregation.clip_norm_ratio = 0.0
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run, 2, {**tensors_g, **tensors_r}, {"round": 2, "scales": {**scales_g, **scales_r}})
    by_round = energy.run_energy(run, (1, 2, 3))
    assert list(by_round) == [2]
    three = float(e[:3].sum() / e.sum())
    assert by_round[2]["top_k"] == pytest.approx({"1": want[1], "2": want[2], "3": three})
    with pytest.raises(SystemExit, match="no round-"):
        energy.run_energy(tmp_path, (1,))


def test_florist_report_means_kept_ranks_per_module_type_and_counts_a_catch_up_once(tmp_path):
    """A round's kept rank by module type is the mean over its layers; down_bytes already holds the
    catch-ups (down_catchup_bytes says how much of it), so adding both would count them twice."""
    import json

    report = _script("florist_report")
    kept = {
        "model.layers.0.self_attn.q_proj": 4,
        "model.layers.1.self_attn.q_proj": 8,
        "model.layers.0.self_attn.v_proj": 2,
        "model.layers.0.mlp.up_proj": 30,
    }
    rows = [
        {"round": 0, "eval_loss": 2.0},
        {"round": 1, "agg_kept_rank": kept, "agg_kept_rank_mean": 11.0, "agg_client_rank_sum": 48,
         "agg_client_rank_max": 32, "down_bytes": 0, "up_bytes": 100},
        {"round": 2, "agg_kept_rank": kept, "agg_kept_rank_mean": 11.0, "agg_client_rank_sum": 48,
         "agg_client_rank_max": 32, "down_bytes": 3_000_000, "down_catchup_bytes": 1_000_000,
         "up_bytes": 100, "eval_loss": 1.5, "general_agreement": 70.0},
    ]  # fmt: skip
    metrics = tmp_path / "florist" / "seed-0" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = report.variant_report(metrics)
    assert got["rounds"][0]["kept_by_type"] == {"q_proj": 6.0, "v_proj": 2.0, "up_proj": 30.0}
    assert got["down_mb"] == 3.0 and (got["loss_before"], got["loss_after"]) == (2.0, 1.5)


def test_lm_eval_phase_is_read_at_minutes_and_at_hours():
    """tqdm writes MM:SS under an hour and H:MM:SS from one on; both must be read, or a long whole-subject
    phase would be reported as missing."""
    lm = _script("compare_lm_eval")
    assert lm.harness_phase_s("Running loglikelihood requests: 100%|##| 1488/1488 [07:19<00:00]") == 439
    assert lm.harness_phase_s("100%|##| 9000/9000 [1:02:03<00:00, 2.4it/s]") == 3723
    assert lm.harness_phase_s("no bar here") is None


def test_a_resumed_comparison_reruns_a_run_made_by_other_code(tmp_path, builtin_base):
    """Every run records the identity of what made it (fedllm's source digest, the token cache, model and
    data files, precision, libraries). A comparison run again after a source file changed does not reuse
    the run: it says in one line that the source differs, keeps the old run aside and runs it again; with
    nothing changed it reuses it. The comparison's JSON names the identity every row shares. (The package
    is copied, so the edit touches the copy only: both the comparison and its runs import the copy.)"""
    import os
    import shutil
    import subprocess
    import sys

    from fedllm.run.reader import RunFolder

    repo = Path(__file__).resolve().parent.parent
    code = tmp_path / "code"
    for pkg in ("fedllm", "data_prep", "eval"):
        shutil.copytree(repo / pkg, code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(code), "FEDLLM_CACHE": os.environ["FEDLLM_CACHE"]}
    common = [
        o
        for o in tiny_overrides(
            tmp_path, "federation.rounds=1", "eval.personalized=false", "eval.benchmark=none"
        )
        if not o.startswith("output.dir")
    ]
    out = tmp_path / "cmp"
    argv = [sys.executable, "-m", "fedllm.cli", "compare", "--variant", "fedit:aggregation.name=fedit"]
    argv += ["--seeds", "1", "--output-dir", str(out), *common]

    def compare() -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    compare()
    run = RunFolder(out / "fedit" / "seed-0")
    first = run.identity()
    assert first is not None and first["source"]["digest"] and first["tokens"] and first["libraries"]["torch"]
    assert json.loads((out / "compare.json").read_text())["identity"] == first
    again = compare()
    assert "reused (same settings)" in again.stderr and "made by other code" not in again.stderr
    with open(code / "fedllm" / "aggregation" / "fedit.py", "a") as f:
        f.write("\n# an edit between two comparisons\n")
    third = compare()
    said = [line for line in third.stderr.splitlines() if "made by other code or data" in line]
    assert len(said) == 1 and "source " + first["source"]["digest"] in said[0]
    assert "reused (same settings)" not in third.stderr
    now = RunFolder(out / "fedit" / "seed-0").identity()
    assert now is not None and now["source"]["digest"] != first["source"]["digest"]
    kept = list((out / ".superseded").iterdir())
    assert any(RunFolder(p).identity() == first for p in kept if p.is_dir())


def test_holm_and_bonferroni_match_hand_computed_numbers():
    """p-values 0.01, 0.04, 0.03 in a family of 3: Holm's adjusted 0.03, 0.06, 0.06 (step-down, monotone);
    the interval uses t at 1 - 0.05 / 6; the p-value is scipy's paired t-test."""
    from scipy import stats

    from fedllm.run.stats import Comparison, correct, paired_test

    fam = [Comparison(n, 1.0, 1.0, 5, p) for n, p in (("a", 0.01), ("b", 0.04), ("c", 0.03))]
    correct(fam)
    assert [c.p_holm for c in fam] == pytest.approx([0.03, 0.06, 0.06])
    half = stats.t.ppf(1 - 0.05 / 6, 4) * 1.0 / math.sqrt(5)
    assert (fam[0].low, fam[0].high) == pytest.approx((1 - half, 1 + half))
    v, r = [1.0, 2.5, 2.9, 4.2, 5.0], [0.5, 1.0, 2.4, 3.0, 4.9]
    c = paired_test("x", v, r)
    assert c.p == pytest.approx(stats.ttest_rel(v, r).pvalue) and c.diff == pytest.approx(
        statistics.fmean(v) - 2.36
    )


def test_the_detectable_difference_is_found_with_the_stated_power():
    """At the minimum detectable difference the family-level paired t-test rejects with probability 0.8
    (both tails of the noncentral t), also at 5 seeds, where the textbook approximation falls to 0.73."""
    from scipy import stats

    from fedllm.run.stats import detectable

    for n, m in ((5, 10), (8, 1), (20, 3)):
        mde = detectable(1.0, n, m)
        crit = stats.t.ppf(1 - 0.05 / (2 * m), n - 1)
        nc = mde * math.sqrt(n)
        power = stats.nct.sf(crit, n - 1, nc) + stats.nct.sf(crit, n - 1, -nc)
        assert power == pytest.approx(0.8, abs=1e-6)


def test_a_table_verdict_needs_the_corrected_interval_to_exclude_zero():
    """Two methods 0.034 apart with a seed spread that gives an uncorrected interval excluding 0 but not the
    family's: the uncorrected entry says "excludes", the corrected one does not; the best row is chosen
    among federated rows only (a reference row that scores better is never "the best")."""
    from fedllm.run.compare import summarize

    res = {
        "fedit": dict(enumerate([1.70, 1.69, 1.71, 1.70, 1.70])),
        "flora": dict(enumerate([1.66, 1.68, 1.64, 1.67, 1.66])),
        "other": dict(enumerate([1.70, 1.70, 1.70, 1.71, 1.69])),
        "centralized": dict(enumerate([1.50, 1.51, 1.49, 1.50, 1.50])),
    }
    results = {k: {s: {"heldout_loss": x} for s, x in v.items()} for k, v in res.items()}
    out = summarize(results, references=["centralized"])
    assert out["metrics"]["heldout_loss"]["flora"]["vs_fedit"]["excludes_zero"]
    fam = out["corrected"]["heldout_loss"]
    flora = next(c for c in fam["vs_baseline"]["comparisons"] if c["name"] == "flora")
    assert fam["vs_baseline"]["m"] == 3 and flora["low"] < 0 < flora["high"]
    assert fam["vs_best"]["reference"] == "flora"  # not centralized, whose loss is lower


def test_the_corrected_figure_draws_each_family_and_fills_only_the_intervals_that_exclude_zero(tmp_path):
    """The forest plot a reader checks the verdict on: one panel per metric asked for, in that order, one row
    per comparison, a filled marker exactly where the corrected interval excludes 0, references grey; no
    figure from a single seed; the comparison's own folder gets it as compare.png."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from fedllm.run.compare import corrected_figure, write_results

    res = {
        "fedit": [1.70, 1.69, 1.71, 1.70, 1.70],
        "flora": [1.66, 1.68, 1.64, 1.67, 1.66],  # -0.038: excluded uncorrected, not at m = 3
        "other": [1.60, 1.59, 1.61, 1.60, 1.60],  # -0.100 every seed, sd 0: excludes 0
        "centralized": [1.50, 1.51, 1.49, 1.50, 1.50],
    }
    results = {
        k: {s: {"heldout_loss": x, "rouge_l": 10 * x, "accuracy": x / 4} for s, x in enumerate(v)}
        for k, v in res.items()
    }
    summary = summarize(results, references=["centralized"])
    fig = corrected_figure(summary, ["rouge_l", "heldout_loss", "accuracy"], ["centralized"])
    assert fig is not None
    titles = [ax.get_title() for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == ["rouge_l", "heldout_loss", "accuracy (points)"]
    assert "m = 3" in titles[1]
    # accuracy is drawn in points, as the table prints it: "other" at -0.1 / 4 = -2.5 points
    acc = {round(line.get_ydata()[0]): line for line in fig.axes[2].lines if line.get_marker() == "o"}
    assert acc[1].get_xdata()[0] == pytest.approx(-2.5)
    ax = fig.axes[1]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["flora", "other", "centralized (ref.)"]
    markers = {round(line.get_ydata()[0]): line for line in ax.lines if line.get_marker() == "o"}
    # rows top to bottom: flora (y 2), other (y 1), centralized (y 0)
    assert to_rgba(markers[2].get_markerfacecolor()) == to_rgba("white")  # holds 0
    assert to_rgba(markers[1].get_markerfacecolor()) != to_rgba("white")  # excludes 0
    assert to_rgba(markers[0].get_color()) == to_rgba("0.55")  # the reference, grey
    assert to_rgba(markers[1].get_color()) != to_rgba("0.55")  # a method, not grey
    plt.close(fig)
    write_results(tmp_path, summary)
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one_seed = summarize({k: {0: v[0]} for k, v in results.items()})
    assert corrected_figure(one_seed) is None
    write_results(tmp_path, one_seed)  # no figure, and the older one is not left to be read as this one's
    assert not (tmp_path / "compare.png").exists()


def test_the_same_code_under_another_commit_is_the_same_identity_and_a_mixed_run_never_is():
    """Two runs whose source files are the same but whose checkouts sit at other commits (a docs-only commit
    between them) share one identity: the table names it, nothing is superseded. A run resumed with other
    code carries the mark, and differs from every identity, its own first one included."""
    from fedllm.run.identity import differences

    base = {"source": {"digest": "abc", "commit": "111", "uncommitted_changes": False}, "tokens": 7}
    other_commit = {**base, "source": {"digest": "abc", "commit": "222", "uncommitted_changes": True}}
    other_code = {**base, "source": {"digest": "def", "commit": "222"}}
    assert differences(other_commit, base) == [] and differences(base, other_commit) == []
    assert differences(other_code, base)
    mixed = {**base, "mixed": ["source abc (111) -> def (222)"]}
    assert differences(mixed, base) and "resumed with other code" in differences(mixed, base)[0]


def test_a_grid_over_the_data_checks_each_folder_against_its_own_datas_identity(tmp_path, monkeypatch):
    """One variant's runs on two data files (a grid over ``data.dataset``) have two identities: each kept
    folder is checked against the identity of its own data, so neither is taken for a run of other data,
    and a folder made from other data than its config names is still run again."""
    from fedllm import __version__
    from fedllm.config import load_config, save_config
    from fedllm.run.compare import runs as runs_mod
    from fedllm.run.compare.variants import Planned

    monkeypatch.setattr(runs_mod, "run_identity", lambda cfg: {"data": cfg.data.dataset})

    def folder(name: str, dataset: str, made_from: str) -> Planned:
        cfg = load_config(None, [f"data.dataset={dataset}", "model.mixed_precision=none"])
        run_dir = tmp_path / "fedit" / name
        run_dir.mkdir(parents=True)
        save_config(cfg, run_dir / "config.yaml")
        info = {"fedllm_version": __version__, "identity": {"data": made_from}}
        (run_dir / "run_info.json").write_text(json.dumps(info))
        return Planned("fedit", 0, run_dir, [], cfg)

    a, b = folder("a", "builtin", "builtin"), folder("b", "builtin_skills", "builtin_skills")
    wrong = folder("c", "builtin_skills", "builtin")  # its config says one file, it was made from another
    runs_mod.check_folders([a, b, wrong], tmp_path)
    assert a.run_dir.exists() and b.run_dir.exists() and not wrong.run_dir.exists()
    moved = [p.name for p in (tmp_path / ".superseded").iterdir()]
    assert len(moved) == 1 and moved[0].startswith("fedit-c-")
