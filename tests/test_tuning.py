"""Each variant at its own value: the validation split (never trained on, never the test set, moving no
example of a sampled table), the grid's choice and its extension past an edge, and the record recomputed
read-only from the kept runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from data_prep.schema import DataError
from fedllm.run.compare import tuning
from fedllm.run.compare.metrics import run_metrics
from fedllm.run.compare.tuning import Point, canonical, decide, grids, parse_tune, record_from_folders
from fedllm.run.compare.variants import Variant
from tests.test_sharegpt import chats_file


def partitions(path: Path, *extra: str):
    from fedllm.config import load_config
    from fedllm.federation_data import load_partitions

    over = [
        f"data.dataset={path}",
        "data.eval_size=16",
        "federation.num_clients=4",
        "data.client_test_fraction=0.2",
        "data.min_examples_per_client=2",
        *extra,
    ]
    return load_partitions(load_config(None, over))


def client_groups(parts) -> set:
    return {e.group for c in parts.clients for e in c}


def test_a_validation_split_beside_the_sample_moves_no_client_or_test_example(tmp_path):
    """Drawn from what data.max_examples' sample leaves out, of sources the sample does not touch: the
    clients and the held-out test set are the very examples of the run without it (the one-rate table's
    partitions stay as they were), and no validation chat has a part or a copy in either."""
    path, recs = chats_file(tmp_path, chats=150)
    without = partitions(path, "data.max_examples=150")
    test = partitions(path, "data.max_examples=150", "data.validation_size=24")
    val = partitions(path, "data.max_examples=150", "data.validation_size=24", "eval.split=validation")
    assert test.clients == without.clients == val.clients and test.test_sizes == without.test_sizes
    assert test.eval_examples == without.eval_examples and test.split == "test"
    assert val.split == "validation" and 0 < len(val.eval_examples) <= 24
    sampled = client_groups(without) | {e.group for e in without.eval_examples}
    assert not {e.group for e in val.eval_examples} & sampled  # no chat of the sample, not even one part
    by_group: dict = {}
    for e in val.eval_examples:
        by_group.setdefault(e.group, []).append(e.turns)
    everyone = [r for r in recs]  # whole sources: every record of a validation chat (and its copies) is in it
    from data_prep.sharegpt import conversations

    for e in conversations(everyone, "f"):
        if e.group in by_group:
            assert e.turns in by_group[e.group]
    # another seed draws another sample, and a validation set beside it
    other = partitions(path, "data.max_examples=150", "data.validation_size=24", "eval.split=validation",
                       "federation.seed=1")  # fmt: skip
    assert {e.group for e in other.eval_examples} != {e.group for e in val.eval_examples}


def test_without_a_sample_the_validation_split_is_taken_before_the_partition(tmp_path):
    """With no sample to draw beside, whole sources after the test set: disjoint from the clients and the
    test set, and every record in exactly one of the three."""
    path, recs = chats_file(tmp_path)
    test = partitions(path, "data.validation_size=20")
    val = partitions(path, "data.validation_size=20", "eval.split=validation")
    assert test.clients == val.clients
    held, valid = {e.group for e in test.eval_examples}, {e.group for e in val.eval_examples}
    assert valid and not valid & held and not valid & client_groups(test) and not held & client_groups(test)
    total = sum(map(len, test.clients)) + len(test.eval_examples) + len(val.eval_examples)
    assert total == len(recs) and len(val.eval_examples) <= 20


def test_a_validation_run_reads_no_test_example_and_an_empty_validation_set_is_refused(tmp_path):
    path, _ = chats_file(tmp_path)
    test = partitions(path, "data.validation_size=20", "eval.generate_size=4")
    val = partitions(path, "data.validation_size=20", "eval.split=validation", "eval.generate_size=4")
    test_turns = {e.turns for e in test.eval_examples}
    assert not {e.turns for e in val.eval_examples} & test_turns
    assert {r.example.turns for r in val.generation} <= {e.turns for e in val.eval_examples}
    with pytest.raises(DataError, match=r"eval.split = validation: the validation set is empty \(set "
                       r"data.validation_size"):  # fmt: skip
        partitions(path, "eval.split=validation")


def fake_run(run_dir: Path, split: str, loss: float, agreement: float | None = None) -> None:
    """The two files a comparison reads of a finished run: its config and its summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("{}\n")
    summary = {"eval_split": split, "loss_before": 2.0, "loss_after": loss}
    if agreement is not None:
        summary["general_agreement_after"] = agreement
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_a_metric_is_read_only_from_a_run_of_its_held_out_set(tmp_path):
    """A validation run gives a validation loss and no held-out (test) loss, and a test run the reverse:
    a table cannot be fed a validation number, nor a choice a test number."""
    fake_run(tmp_path / "v", "validation", 1.5, 60.0)
    fake_run(tmp_path / "t", "test", 1.4)
    v, t = run_metrics(tmp_path / "v"), run_metrics(tmp_path / "t")
    assert v["validation_loss"] == 1.5 and v["heldout_loss"] is None and v["heldout_loss_drop"] is None
    assert t["heldout_loss"] == 1.4 and t["validation_loss"] is None and v["general_agreement"] == 60.0
    old = tmp_path / "old"  # a run made before validation sets existed evaluated the test set
    fake_run(old, "test", 1.3)
    summary = json.loads((old / "summary.json").read_text())
    del summary["eval_split"]
    (old / "summary.json").write_text(json.dumps(summary))
    assert run_metrics(old)["heldout_loss"] == 1.3 and run_metrics(old)["validation_loss"] is None


def test_grid_syntax_and_one_spelling_per_value():
    assert canonical("5e-4") == canonical("0.0005") == "0.0005" and canonical("8") == "8"
    assert canonical("sgd") == "sgd"
    assert parse_tune("client.lr=1e-3, 2e-3") == (None, "client.lr", ["0.001", "0.002"])
    assert parse_tune("floral:aggregation.floral.router_lr=0.1") == ("floral", "aggregation.floral.router_lr",
                                                                      ["0.1"])  # fmt: skip
    for bad, why in [
        ("client.lr", "expected KEY=V1,V2"),
        ("client.lr=1e-3,0.001", "a value is given twice"),
        ("x-y:client.lr=1", "'x-y' before ':' is not a variant name"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_tune(bad)
    vs = [Variant("fedit"), Variant("floral")]
    g = grids(vs, ["client.lr=1e-3,2e-3", "floral:client.lr=4e-3", "floral:aggregation.floral.router_lr=0.1"])
    assert g == {
        "fedit": {"client.lr": ["0.001", "0.002"]},
        "floral": {"client.lr": ["0.004"], "aggregation.floral.router_lr": ["0.1"]},
    }
    with pytest.raises(ValueError, match="'local' is not a --variant of this comparison"):
        grids(vs, ["local:client.lr=1"])


def pts(key: str, *values: str) -> list[Point]:
    return [Point(((key, v),)) for v in values]


def test_the_choice_is_the_best_mean_and_an_edge_is_extended_once_then_said():
    grid = pts("client.lr", "0.001", "0.002", "0.004")
    scores = {"client.lr=0.001": [2.0, 2.2], "client.lr=0.002": [1.9, 1.7], "client.lr=0.004": [1.8, 1.9]}
    best, add, edges = decide(grid, scores, -1, 1)
    assert best.tag == "client.lr=0.002" and not add and not edges  # inside the grid: nothing to add
    scores["client.lr=0.004"] = [1.5, 1.6]
    best, add, edges = decide(grid, scores, -1, 1)
    assert best.tag == "client.lr=0.004" and [p.tag for p in add] == ["client.lr=0.008"] and not edges
    best, add, edges = decide(grid, scores, -1, 0)  # no extension left: said in one line
    assert not add and edges == [
        "client.lr=0.004 is the largest value tried: the best may lie beyond the grid"
    ]
    scores["client.lr=0.001"] = [1.0, math.nan]  # a diverged seed never wins, however low the other
    assert decide(grid, scores, -1, 0)[0].tag == "client.lr=0.004"
    scores["client.lr=0.001"] = [1.0, 1.1]
    best, add, _ = decide(grid, scores, -1, 1)
    assert best.tag == "client.lr=0.001" and [p.tag for p in add] == ["client.lr=0.0005"]
    # a step grid goes on by its step, an integer grid stays integer, a higher-is-better metric picks the max
    assert [p.tag for p in decide(pts("k", "0", "1", "2"), {"k=0": [3.0]}, 1, 1)[1]] == ["k=-1"]
    assert decide(pts("k", "0.5", "1", "2"), {"k=2": [3.0]}, 1, 1)[1][0].tag == "k=4"
    assert decide(pts("k", "2", "4", "6"), {"k=6": [3.0], "k=2": [1], "k=4": [1]}, 1, 1)[1][0].tag == "k=8"
    assert not decide(pts("k", "sgd", "same"), {"k=sgd": [1.0]}, -1, 1)[1]  # not a number: no edge


def test_a_key_is_extended_along_its_line_through_the_chosen_point():
    grid = [Point((("lr", a), ("r", b))) for a in ("1", "2") for b in ("0.1", "0.2", "0.4")]
    scores = {p.tag: [1.0] for p in grid} | {"lr=2,r=0.2": [0.5]}
    best, add, edges = decide(grid, scores, -1, 1)  # r inside its line; lr at the largest of its line
    assert best.tag == "lr=2,r=0.2" and [p.tag for p in add] == ["lr=4,r=0.2"] and not edges


def toy_loss(run) -> float:
    """A validation loss with its minimum at lr 3e-3 for fedit and 7e-4 for flora, a little seed noise."""
    opt = {"fedit": 3e-3, "flora": 7e-4}[run.name]
    return 1.0 + math.log(run.cfg.client.lr / opt) ** 2 + 0.001 * (run.seed - 1000)


def test_tuning_runs_its_grid_on_validation_runs_extends_an_edge_and_records_what_it_chose(tmp_path):
    """The tuning's own loop, with a stand-in for the runs (they write what a finished run writes): every
    point on every tuning seed, each a validation run of the variant at that point; fedit's best lies past
    the grid (extended once, then said), flora's inside it; the record recomputed read-only from the kept
    folders chooses the same."""
    seen: list = []

    def run_all(runs):  # as the comparison's: a finished run is reused, not run again
        for r in runs:
            if (r.run_dir / "summary.json").exists():
                continue
            assert r.cfg.eval.split == "validation" and r.cfg.eval.benchmark == "none"
            assert r.cfg.federation.seed in (1000, 1001) and r.run_dir.is_relative_to(tmp_path / "tuning")
            seen.append((r.name, r.cfg.client.lr, r.seed))
            fake_run(r.run_dir, "validation", toy_loss(r), 100 - 1000 * r.cfg.client.lr)

    variants = [Variant("fedit", ["aggregation.name=fedit"]), Variant("flora", ["aggregation.name=flora"])]
    grid_of = grids(variants, ["client.lr=2.5e-4,5e-4,1e-3,2e-3"])
    record = tuning.tune(None, variants, ["data.validation_size=8"], grid_of, [1000, 1001], tmp_path,
                         run_all)  # fmt: skip
    fedit, flora = record["variants"]["fedit"], record["variants"]["flora"]
    assert fedit["chosen"] == {"client.lr": "0.004"} and fedit["extended"] == ["client.lr=0.004"]
    assert (
        fedit["edge_note"] == "client.lr=0.004 is the largest value tried: the best may lie beyond the grid"
    )
    assert (
        flora["chosen"] == {"client.lr": "0.0005"} and flora["extended"] == [] and flora["edge_note"] is None
    )
    assert (
        len(seen) == len(set(seen)) == 2 * (4 + 1) + 2 * 4
    )  # every point once a seed, fedit's extension too
    best = next(p for p in flora["points"] if p["tag"] == "client.lr=0.0005")
    assert best["per_seed"] == {"1000": pytest.approx(1 + math.log(5 / 7) ** 2),
                                "1001": pytest.approx(1.001 + math.log(5 / 7) ** 2)}  # fmt: skip
    assert best["drift_per_seed"] == {"1000": pytest.approx(99.5), "1001": pytest.approx(99.5)}
    again = record_from_folders(tmp_path / "tuning")
    assert {n: v["chosen"] for n, v in again["variants"].items()} == {"fedit": fedit["chosen"],
                                                                     "flora": flora["chosen"]}  # fmt: skip
    assert again["seeds"] == [1000, 1001]


def test_tuning_checks_every_kept_folder_of_its_grid_before_it_reads_a_score(tmp_path):
    """Under halving a point that lost at the first seed is not planned at the second; a finished folder
    left there (an earlier sitting's, of other code or settings) would be read by the choice unchecked. The
    comparison's check sees every point of the grid at every seed before any score is read, and its refusal
    stops the tuning."""
    from fedllm.run.compare.runs import StaleRun

    variants = [Variant("fedit", ["aggregation.name=fedit"])]
    grid_of = grids(variants, ["client.lr=2.5e-4,5e-4,1e-3,2e-3"])
    planted = tmp_path / "tuning" / "fedit" / "client.lr=0.00025" / "seed-1001"
    fake_run(planted, "validation", 0.1)

    def check(runs):
        if any(r.run_dir == planted for r in runs):
            raise StaleRun(f"{planted}: other settings")

    def run_all(runs):
        for r in runs:
            if not (r.run_dir / "summary.json").exists():
                fake_run(r.run_dir, "validation", toy_loss(r))

    with pytest.raises(StaleRun, match="other settings"):
        tuning.tune(None, variants, ["data.validation_size=8"], grid_of, [1000, 1001], tmp_path, run_all,
                    halving=True, check=check)  # fmt: skip
    planted.joinpath("summary.json").unlink()  # gone: the same tuning goes through, the check on every point
    seen: list = []
    record = tuning.tune(None, variants, ["data.validation_size=8"], grid_of, [1000, 1001], tmp_path, run_all,
                         halving=True, check=lambda runs: seen.extend(r.run_dir for r in runs))  # fmt: skip
    assert planted in seen and record["variants"]["fedit"]["chosen"] == {"client.lr": "0.004"}


def test_tuning_is_refused_before_any_run_without_a_validation_split_or_on_the_tables_seeds(tmp_path):
    from fedllm.run.compare import compare

    def never(runs):
        raise AssertionError("no run may start")

    vs = [Variant("fedit")]
    with pytest.raises(ValueError, match="has data.validation_size = 0: a value is chosen on a validation"):
        tuning.tune(None, vs, [], grids(vs, ["client.lr=1e-3"]), [1000], tmp_path, never)
    with pytest.raises(ValueError, match=r"--tune-seeds \[1\] are also the table's seeds"):
        compare(None, vs, [0, 1], tmp_path, tune=["client.lr=1e-3"], tune_seeds=[1, 1000])
    with pytest.raises(ValueError, match="--tune needs --tune-seeds"):
        compare(None, vs, [0, 1], tmp_path, tune=["client.lr=1e-3"])
    with pytest.raises(ValueError, match="--tune-metric 'validation_los': not a metric"):
        compare(
            None, vs, [0], tmp_path, tune=["client.lr=1e-3"], tune_seeds=[9], tune_metric="validation_los"
        )
    assert not (tmp_path / "tuning").exists()


def test_successive_halving_runs_the_grid_once_and_its_better_half_again(tmp_path):
    """--tune-halving: every point at the first tuning seed, the better half (rounded up) at the second, a
    point added past an edge at both; the choice is made on the full mean, read back the same from the
    folders."""
    ran: list = []

    def run_all(runs):
        for r in runs:
            if not (r.run_dir / "summary.json").exists():
                ran.append((r.name, r.cfg.client.lr, r.seed))
                fake_run(r.run_dir, "validation", toy_loss(r), 100 - 1000 * r.cfg.client.lr)

    variants = [Variant("fedit"), Variant("flora")]
    grid_of = grids(variants, ["client.lr=2.5e-4,5e-4,1e-3,2e-3"])
    record = tuning.tune(None, variants, ["data.validation_size=8"], grid_of, [1000, 1001], tmp_path, run_all,
                         halving=True)  # fmt: skip
    flora = [(lr, s) for n, lr, s in ran if n == "flora"]
    assert sorted(lr for lr, s in flora if s == 1000) == [2.5e-4, 5e-4, 1e-3, 2e-3]
    assert sorted(lr for lr, s in flora if s == 1001) == [5e-4, 1e-3]  # the better half of seed 1000's
    fedit = [(lr, s) for n, lr, s in ran if n == "fedit"]
    assert sorted(lr for lr, s in fedit if s == 1001) == [1e-3, 2e-3, 4e-3]  # its extension runs both seeds
    assert record["variants"]["flora"]["chosen"] == {"client.lr": "0.0005"}
    assert record["variants"]["fedit"]["chosen"] == {"client.lr": "0.004"}
    assert record["variants"]["flora"]["seeds_run"]["client.lr=0.00025"] == [1000]
    again = record_from_folders(tmp_path / "tuning")
    chosen = {n: v["chosen"] for n, v in again["variants"].items()}
    assert chosen == {"fedit": {"client.lr": "0.004"}, "flora": {"client.lr": "0.0005"}}
    from fedllm.run.compare.summary import drift_curve

    assert [p["seeds"] for p in drift_curve(record["variants"]["flora"])] == [["1000"]] * 4  # seeds all ran


def test_matched_drift_reads_the_curves_at_equal_agreement():
    """A variant whose loss is lower than the baseline's at every agreement both reach is "lower", however
    far each moved; curves that cross are said to cross; ranges that do not meet share no drift."""
    from fedllm.run.compare.summary import matched_drift

    def variant(points):  # (agreement, loss) per grid point, one tuning seed
        return {"points": [{"tag": f"p{i}", "short": str(i), "per_seed": {"0": y},
                            "drift_per_seed": {"0": x}} for i, (x, y) in enumerate(points)]}  # fmt: skip

    record = {
        "variants": {
            "fedit": variant([(90, 2.0), (70, 1.8), (50, 1.7)]),
            "lower": variant([(80, 1.85), (60, 1.7), (30, 1.6)]),  # moves further, and lower where both are
            "cross": variant([(85, 2.0), (55, 1.6)]),
            "apart": variant([(20, 1.0), (10, 0.9)]),
        }
    }
    got = matched_drift(record, "fedit")
    assert got["lower"]["reading"] == "lower" and got["lower"]["range"] == [50.0, 80.0]
    # at agreement 50: fedit 1.7, lower between (60, 1.7) and (30, 1.6): 1.7 - 10 / 30 * 0.1
    assert got["lower"]["diffs"][0] == pytest.approx(1.7 - 0.1 / 3 - 1.7)
    assert got["cross"]["reading"] == "crosses"
    assert got["apart"]["reading"] == "no shared drift"
    assert "fedit" not in got


def test_a_table_of_some_tuned_rows_keeps_the_others_choices_on_record(tmp_path):
    """The table stage tunes (reuses) only the rows it runs: the rows the design left out keep their recorded
    choice in tuning.json, when the rule that chose them is the same; a record of another rule replaces it."""
    from fedllm.run.compare import write_tuning

    def rec(names, seeds=(1000,)):
        point = {"tag": "client.lr=0.001", "short": "0.001", "per_seed": {"1000": 1.0}, "mean": 1.0,
                 "drift_per_seed": {"1000": 90.0}}  # fmt: skip
        variant = {"points": [point], "chosen": {"client.lr": "0.001"}, "chosen_tag": "client.lr=0.001"}
        return {"metric": "validation_loss", "better": -1, "seeds": list(seeds), "halving": True, "extend": 1,
                "evaluation": [], "variants": {n: dict(variant) for n in names}}  # fmt: skip

    write_tuning(tmp_path, rec(["fedit", "fedex", "hetlora"]), "fedit")
    kept = write_tuning(tmp_path, rec(["fedit", "hetlora"]), "fedit")
    on_file = json.loads((tmp_path / "tuning.json").read_text())
    assert set(kept["variants"]) == set(on_file["variants"]) == {"fedit", "fedex", "hetlora"}
    assert "fedex" in (tmp_path / "tuning.md").read_text()
    other = write_tuning(tmp_path, rec(["fedit"], seeds=(7,)), "fedit")
    assert set(other["variants"]) == {"fedit"}
    write_tuning(tmp_path, rec(["fedit", "fedex"]), "fedit")
    elsewhere = write_tuning(tmp_path, {**rec(["fedit"]), "common": ["lora.ranks=[8]"]}, "fedit")
    assert set(elsewhere["variants"]) == {"fedit"}  # chosen under other common overrides: not kept
    write_tuning(tmp_path, rec(["fedit", "fedex"]), "fedit")
    other_config = write_tuning(tmp_path, {**rec(["fedit"]), "config": "configs/other.yaml"}, "fedit")
    assert set(other_config["variants"]) == {"fedit"}  # chosen from another config file: not kept
