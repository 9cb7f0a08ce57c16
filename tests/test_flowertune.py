"""FlowerTune's leaderboard in fedllm: its federations as configs, its generative evaluations as protocols.

The reference for prompts and extraction is FlowerTune's own code, run by
``scripts/check_flowertune_agreement.py`` on a fetched copy (not committed); what it gave is kept in
``tests/fixtures/flowertune_reference.json`` (each prompt's sha256, and its extraction of awkward
generations), so a drift of fedllm's prompts or extraction fails here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import pytest
from conftest import TEST_PRETRAIN_STEPS

from data_prep import flowertune_samples as samples
from data_prep.loaders import DataError, load_examples
from data_prep.partition import contiguous
from data_prep.prompts import build_prompt
from eval import flowertune as ft
from eval.flowertune_data import BenchmarkDataError, held_out

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "flowertune_reference.json").read_text())
CONFIGS = ["general_nlp", "finance", "medical", "code"]
LEADERBOARD = {"general_nlp": (20, 2), "finance": (50, 5), "medical": (20, 2), "code": (10, 2)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return samples.write_all(tmp_path_factory.mktemp("flowertune"))


# ----------------------------------------------------------------------------- training side
def test_each_dataset_is_mapped_as_flowertunes_template_reads_it(tmp_path):
    rec = {"instruction": "Classify it.", "input": "Stocks fell.", "output": "negative"}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    got = {f: load_examples(str(path), f)[0] for f in ("flowertune-general-nlp", "flowertune-finance",
                                                        "flowertune-medical", "flowertune-code")}  # fmt: skip
    assert got["flowertune-general-nlp"].instruction == "Classify it."  # the input is dropped
    assert got["flowertune-finance"].instruction == "Classify it. Stocks fell."
    assert got["flowertune-code"].instruction == "Classify it. Stocks fell."
    assert got["flowertune-medical"].instruction == "Stocks fell."  # the input is the question
    # FlowerTune's formatting_prompts_func, written out: the header, "### Instruction:", "### Response: "
    text = build_prompt(got["flowertune-finance"], "flowertune") + "negative"
    assert text == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n### Instruction:\nClassify it. Stocks fell.\n### Response: negative"
    )
    # an empty input keeps the template's trailing space, as FlowerTune's concatenation does
    path.write_text(json.dumps({**rec, "input": ""}) + "\n")
    assert load_examples(str(path), "flowertune-code")[0].instruction == "Classify it. "


def test_a_flowertune_record_without_a_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl, line 1: missing required field 'input'"):
        load_examples(str(path), "flowertune-medical")


@pytest.mark.parametrize(("n", "k"), [(120, 50), (103, 20), (10, 10), (20000, 7)])
def test_contiguous_partition_is_flwr_datasets_iid_partitioner(n, k):
    from datasets import Dataset

    ds = Dataset.from_dict({"i": list(range(n))})
    assert contiguous(n, k) == [ds.shard(k, j, contiguous=True)["i"] for j in range(k)]


def test_round_schedule_is_flowertunes_cosine_annealing():
    from fedllm.client.runtime import round_lr

    def cosine_annealing(r, total, lmax, lmin):  # FlowerTune's models.py, written out
        return lmin + 0.5 * (lmax - lmin) * (1 + math.cos(math.pi * r / total))

    for r in (1, 50, 199, 200):
        assert round_lr(5e-5, 1e-6, "cosine", r, 200) == pytest.approx(cosine_annealing(r, 200, 5e-5, 1e-6))
    assert round_lr(5e-5, 1e-6, "constant", 7, 200) == 5e-5


def run_config(name: str, files: dict, tmp_path: Path, *extra: str):
    from fedllm.config import load_config
    from fedllm.simulation import Simulation

    domain = name.replace("_", "-")
    cfg = load_config(
        f"configs/flowertune_{name}.yaml",
        [
            "model.name=builtin",
            f"model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}",
            "model.quantization=none",
            "model.dtype=float32",
            "model.gradient_checkpointing=false",
            f"data.dataset={files[f'train-{domain}']}",
            "data.max_seq_len=128",
            "data.max_unknown_share=1",
            "federation.rounds=1",
            "client.local_steps=1",
            "client.batch_size=2",
            *extra,
        ],
    )
    sim = Simulation(cfg, tmp_path / name)
    sim.setup()
    return cfg, sim.run()


def check_leaderboard_round(name, files, tmp_path, capsys):
    from fedllm.cli import print_summary

    cfg, summary = run_config(name, files, tmp_path)
    clients, sampled = LEADERBOARD[name]
    assert (cfg.federation.num_clients, cfg.data.partition, cfg.data.template) == (
        clients,
        "contiguous",
        "flowertune",
    )
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["n_sampled"] == sampled and rows[-1]["n_updates"] == sampled
    print_summary(summary)
    out = capsys.readouterr().out
    c = summary["communication"]
    mib = (c["total_up_bytes"] + c["total_down_bytes"]) / 2**20
    assert c["total_up_bytes"] > 0
    assert (
        f"communication MiB  {mib:,.2f} MiB up + down (FlowerTune's 'MB', 2^20 bytes) of the 200,000 MiB"
        in out
    )


def test_finance_config_runs_a_round_with_the_leaderboards_50_clients(files, tmp_path, capsys):
    check_leaderboard_round("finance", files, tmp_path, capsys)


@pytest.mark.parametrize("name", ["general_nlp", "medical", "code"])
def test_each_other_config_runs_a_round_with_the_leaderboards_clients(name, files, tmp_path, capsys):
    check_leaderboard_round(name, files, tmp_path, capsys)


def test_the_budget_warning_fires_once_communication_exceeds_it(files, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fedllm.round_loop"):
        run_config("code", files, tmp_path, "output.comm_budget_mib=0.01", "federation.num_clients=4")
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("communication budget: used ") for m in lines)
    assert any("has exceeded output.comm_budget_mib = 0 MiB" in m for m in lines)


# ----------------------------------------------------------------------------- evaluation side
def protocol_items(protocol: str, files: dict) -> list:
    where = {
        "flowertune-general-nlp": "mmlu",
        "flowertune-medical": "medical",
        "flowertune-finance": "finance",
    }
    return ft.load_items(protocol, str(files[where[protocol]]), list(ft.BENCHMARKS[protocol]))


@pytest.mark.parametrize("protocol", list(ft.BENCHMARKS))
def test_prompts_are_the_ones_flowertunes_code_gave(protocol, files):
    items = protocol_items(protocol, files)
    want = FIXTURE[protocol]["prompts"]
    for name, hashes in want.items():
        got = [hashlib.sha256(it.prompt.encode()).hexdigest() for it in items if it.benchmark == name]
        assert got == hashes, name
    assert len(items) >= 40


def test_extraction_is_flowertunes_on_awkward_generations():
    for g, gold, kind, pred, gold_out in FIXTURE["flowertune-general-nlp"]["format_answer"]:
        assert list(ft.format_answer(g.lower(), gold, kind)) == [pred, gold_out], (g, gold, kind)
    for g, label in FIXTURE["flowertune-finance"]["change_target"]:
        assert ft.change_target(g) == label, g
    # the quirk users ask about, kept on purpose: an MCQ answer is the first letter of the cleaned text
    assert ft.score(ft.Item("stem", 0, "", "A", "mcq"), "Answer: C").extracted == "a"
    assert ft.score(ft.Item("pubmedqa", 0, "", "maybe", "boolean"), "maybe").correct
    assert ft.score(ft.Item("pubmedqa", 0, "", "maybe", "boolean"), "perhaps").extracted is None


@pytest.mark.parametrize("bench", ["fiqa", "fpb"])
def test_fpb_and_fiqa_hold_out_the_rows_flowertunes_code_does(bench):
    """At the real sizes (FiQA's 1,173 rows over three splits, FPB's 4,846), the rows fedllm scores are the
    ones FlowerTune's finance ``load_data`` holds out (the fixture: its own code run on index columns by
    scripts/check_flowertune_agreement.py). FinGPT's 0.226 share of FiQA would hold out 266 rows, not 294."""
    want = FIXTURE["flowertune-finance"]["held_out"][bench]
    rows = held_out(bench, [{"i": i} for i in range(want["rows"])])
    idx = [r["i"] for r in rows]
    assert len(idx) == want["held_out"]
    assert hashlib.sha256(json.dumps(idx).encode()).hexdigest() == want["sha256"]


def test_budgets_follow_the_reference_batching(files):
    from fedllm.model.builtin_base import build_tokenizer

    tok = build_tokenizer()
    items = protocol_items("flowertune-finance", files)[:40]
    ft.set_budgets(items, tok, "flowertune-finance", 32, 512)
    widths = [len(ft.encode(tok, it.prompt)) for it in items]
    assert {it.max_new_tokens for it in items[:32]} == {512 - max(widths[:32])}
    assert {it.max_new_tokens for it in items[32:]} == {512 - max(widths[32:])}


def test_eval_cli_writes_every_record_and_one_json_line(files, tmp_path, builtin_base, capsys):
    from fedllm.cli import main

    out = tmp_path / "r.json"
    data = str(files["medical"])
    rc = main([
        "eval", "--protocol", "flowertune-medical", "--model", str(builtin_base), "--data", data,
        "--benchmarks", "pubmedqa,careqa", "--limit", "5", "--output", str(out),
    ])  # fmt: skip
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last["benchmarks"]) == {"pubmedqa", "careqa"} and last["n"] == 10
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 10
    for r in recs:
        assert {"benchmark", "index", "prompt", "generation", "extracted", "gold"} <= set(r)
        assert r["prompt"].startswith("<|im_start|>question\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--benchmarks", "fpb"], "--benchmarks fpb: not part of flowertune-medical"),
        (["--data", "/nonexistent"], "--data /nonexistent: not a folder"),
    ],
)
def test_bad_eval_input_is_one_line_before_the_model_loads(args, message, files, capsys):
    from fedllm.cli import main

    base = [
        "eval",
        "--protocol",
        "flowertune-medical",
        "--model",
        "/nonexistent-model",
        "--data",
        str(files["medical"]),
    ]
    with pytest.raises(SystemExit) as stop:
        main([*base, *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_benchmark_field_names_the_file_and_row(tmp_path):
    (tmp_path / "careqa").mkdir()
    (tmp_path / "careqa" / "test.jsonl").write_text(json.dumps({"question": "q", "op1": "a"}) + "\n")
    with pytest.raises(BenchmarkDataError, match=r"test\.jsonl, row 0: missing field 'op2'"):
        ft.load_items("flowertune-medical", str(tmp_path), ["careqa"])


def test_the_leaderboards_4bit_base_is_fp4_with_float32_compute(builtin_base):
    import torch

    from fedllm.run.artifacts import load_for_eval

    model, _ = load_for_eval(str(builtin_base), None, None, None, None, "float32", "cpu", "4bit", "fp4")
    q = model.config.quantization_config
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "fp4" and not q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.float32
