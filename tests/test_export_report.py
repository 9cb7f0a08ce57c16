"""Export (adapter, merged, model card, Hub push) and reports from a finished run."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fedllm.config import load_config
from fedllm.simulation import Simulation
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, builtin_base):
    d = tmp_path_factory.mktemp("runs") / "fedit"
    cfg = load_config(None, tiny_overrides(d, "data.client_test_fraction=0.3"))
    fed = Simulation(cfg, d)
    fed.setup()
    fed.run()
    return d


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_export_loads_both_ways(finished_run, tmp_path):
    import os

    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedllm.run.artifacts import export_run
    from fedllm.run.export import base_model_reference

    old = os.umask(0o022)
    try:
        out = export_run(finished_run, tmp_path / "adapter")
        merged = export_run(finished_run, tmp_path / "merged", merge=True)
    finally:
        os.umask(old)
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    for folder in (out, merged):  # a colleague can read every file, and load the tokenizer from the folder
        assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir() if p.is_file()} == {"0o644"}
        assert AutoTokenizer.from_pretrained(folder)("Is 95 even or odd ?")["input_ids"]
    base_path = base_model_reference(load_config(finished_run / "config.yaml"))
    a = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), out).eval()
    b = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 7, 20, 33, 5]])
    torch.testing.assert_close(logits(a, ids), logits(b, ids))
    # and it is the run's own global adapter
    g = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path), finished_run / "global_adapter"
    )
    torch.testing.assert_close(logits(a, ids), logits(g.eval(), ids))


def test_merged_export_equals_base_plus_adapter(finished_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedllm.run.artifacts import export_run
    from fedllm.run.export import base_model_reference

    merged = export_run(finished_run, tmp_path / "merged", merge=True)
    names = {p.name for p in merged.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "README.md",
    } <= names
    m = AutoModelForCausalLM.from_pretrained(merged).eval()
    AutoTokenizer.from_pretrained(merged)
    base_path = base_model_reference(load_config(finished_run / "config.yaml"))
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path), finished_run / "global_adapter"
    ).eval()
    ids = torch.tensor([[1, 9, 11, 40, 2]])
    torch.testing.assert_close(logits(m, ids), logits(ref, ids), rtol=1e-4, atol=1e-5)


def test_model_card_parses_and_carries_metrics(finished_run, tmp_path, caplog):
    from huggingface_hub import ModelCard

    from fedllm.run.artifacts import export_run

    out = export_run(finished_run, tmp_path / "card")
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "peft" and data["license"] == "apache-2.0"
    assert "federated-learning" in data["tags"] and "fedit" in data["tags"]
    assert "base_model" not in data and "datasets" not in data  # built-in base and data: no Hub ids to name
    assert "base_model is left out" in caplog.text
    assert str(finished_run) not in card.content and "/tmp" not in card.content  # no path of this machine
    summary = json.loads((finished_run / "summary.json").read_text())
    result = data["model-index"][0]["results"][0]
    assert result["metrics"][0]["value"] == pytest.approx(summary["accuracy_after"], abs=1e-4)
    assert result["dataset"]["name"] == "fedllm built-in MMLU-format benchmark"
    assert card.text.splitlines()[1].startswith("# fedllm fedit LoRA adapter")
    assert f"{summary['communication']['total_up_params']:,} params" in card.text
    assert "| rounds (exported / configured) | 2 / 2 |" in card.text


def test_model_card_of_an_earlier_round_describes_that_round(finished_run, tmp_path):
    from huggingface_hub import ModelCard

    from fedllm.run.artifacts import export_run

    rows = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    card = ModelCard.load(export_run(finished_run, tmp_path / "r1", round_idx=1) / "README.md")
    assert "| rounds (exported / configured) | 1 / 2 |" in card.text
    value = card.data.to_dict()["model-index"][0]["results"][0]["metrics"][0]["value"]
    assert value == pytest.approx(rows[1]["accuracy"], abs=1e-4)  # round 1's accuracy, not the last round's
    assert f"{rows[1]['cumulative']['total_up_params']:,} params" in card.text


def test_model_card_names_hub_ids_only(finished_run, tmp_path):
    """A Hub base and a Hub data set are named as the Hub knows them; the title says what was exported."""
    from huggingface_hub import ModelCard

    from fedllm.config import load_config
    from fedllm.run.model_card import card_text
    from fedllm.run.reader import RunFolder

    run = RunFolder(finished_run)
    cfg = load_config(finished_run / "config.yaml")
    cfg.model.name, cfg.data.dataset = "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "dolly"
    (tmp_path / "README.md").write_text(card_text(run, cfg, cfg.model.name, merged=True))
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert data["datasets"] == ["databricks/databricks-dolly-15k"] and data["library_name"] == "transformers"
    assert "# fedllm fedit merged model" in card.text
    cfg.model.name, cfg.data.dataset = str(tmp_path), str(tmp_path / "d.jsonl")  # local paths: left out
    (tmp_path / "README.md").write_text(card_text(run, cfg, cfg.model.name, merged=False))
    data = ModelCard.load(tmp_path / "README.md").data.to_dict()
    assert "base_model" not in data and "datasets" not in data


def test_push_uses_exact_repo_and_files_and_never_writes_the_token(finished_run, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    from fedllm.cli import main

    token = "hf_SECRETtoken1234567890"
    monkeypatch.setenv("HF_TOKEN", token)
    calls = {}

    def create_repo(self, repo_id, **kw):
        calls["create"] = (repo_id, kw.get("private"))

    def upload_folder(self, folder_path, repo_id, **kw):
        from pathlib import Path

        calls["upload"] = (repo_id, sorted(p.name for p in Path(folder_path).iterdir()))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "push"
    assert (
        main(
            ["export", str(finished_run), "--output", str(out), "--push-to-hub", "org/fed-model", "--private"]
        )
        == 0
    )
    assert calls["create"] == ("org/fed-model", True)
    assert calls["upload"][0] == "org/fed-model"
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
        calls["upload"][1]
    )
    for folder in (out, finished_run):
        for p in folder.rglob("*"):
            if p.is_file():
                assert token.encode() not in p.read_bytes(), p


def test_personalized_client_export(finished_run, tmp_path):
    from peft import AutoPeftModelForCausalLM

    from fedllm.run.artifacts import export_run
    from fedllm.run.export import ExportError

    out = export_run(finished_run, tmp_path / "client1", client=1)
    model = AutoPeftModelForCausalLM.from_pretrained(out)
    assert "client 1" in (out / "README.md").read_text()
    assert model is not None
    with pytest.raises(ExportError, match="the run has clients 0..3"):
        export_run(finished_run, tmp_path / "bad", client=9)


def test_eval_job_on_run_dir(finished_run, tmp_path, capsys):
    from fedllm.cli import main

    out = tmp_path / "res.json"
    assert main(["eval", "--run", str(finished_run), "--limit", "2", "--output", str(out)]) == 0
    # the scoring time is printed apart from loading (scripts/compare_lm_eval.py reads this line)
    assert re.search(r"^scored 10 questions in [0-9.]+ s$", capsys.readouterr().out, re.M)
    res = json.loads(out.read_text())
    assert res["n"] == 10 and len(res["records"]) == 10 and 0 <= res["accuracy"] <= 1
    rows = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert res["accuracy"] == pytest.approx(_acc_limit2(finished_run))
    assert rows


def _acc_limit2(run_dir):
    """Independent check: score the run's global model with eval.mmlu.evaluate directly."""
    from fedllm.run.artifacts import load_for_eval

    model, tok = load_for_eval("builtin", None, str(run_dir), None, None, "float32", "cpu")
    from eval.mmlu import evaluate

    return evaluate(model, tok, "builtin", limit=2)[0]["accuracy"]


def test_report_table_and_plots(finished_run, tmp_path):
    from PIL import Image

    from fedllm.run.report import report

    text = report([finished_run], tmp_path)
    assert "final acc" in text and "fedit" in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert len(data["runs"]) == 1 and len(data["groups"]) == 1
    rows = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    expected = [[r["round"], r["accuracy"]] for r in rows if r.get("accuracy") is not None]
    assert data["runs"][0]["accuracy_by_round"] == expected
    assert [[x, y] for x, y, _ in data["groups"][0]["loss_by_round"]] == [
        [r["round"], r["eval_loss"]] for r in rows
    ]
    comm = [c for c, _ in data["runs"][0]["accuracy_by_comm"]]
    assert comm == sorted(comm) and len(comm) == len(expected)
    for name in ("accuracy_vs_round.png", "accuracy_vs_communication.png", "loss_vs_round.png"):
        with Image.open(tmp_path / name) as im:
            im.verify()
            assert im.format == "PNG"
        assert (tmp_path / name).with_suffix(".pdf").read_bytes().startswith(b"%PDF")


def test_report_figures_have_integer_rounds_megabytes_and_reference_lines(
    finished_run, tmp_path, monkeypatch
):
    import matplotlib.figure

    from fedllm.run import report as rep

    seen = {}
    real = matplotlib.figure.Figure.savefig

    def keep(fig, path, *a, **k):  # look at each figure as it is saved
        ax = fig.axes[0]
        seen[path.stem] = (
            ax.get_xlabel(),
            list(ax.get_xticks()),
            [t.get_text() for t in ax.get_legend().get_texts()],
        )
        return real(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    rep.report([finished_run], tmp_path)
    label, ticks, legend = seen["accuracy_vs_round"]
    assert label == "round" and all(float(t).is_integer() for t in ticks)
    assert "chance (4 options)" in legend and "base model (round 0)" in legend
    label, _, _ = seen["accuracy_vs_communication"]
    assert "(KB, up + down)" in label or "(MB, up + down)" in label


def _fake_run(path, seed, accs, losses, strategy="fedit"):
    """A run directory with hand-made numbers (report only reads files)."""
    import yaml

    path.mkdir(parents=True)
    cfg = {
        "aggregation": {"name": strategy},
        "federation": {"seed": seed},
        "output": {"dir": str(path)},
        "eval": {"benchmark": "builtin"},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [
        {
            "round": i,
            "accuracy": a,
            "eval_loss": lo,
            "up_bytes": 10,
            "down_bytes": 20,
            "cumulative": {"total_up_bytes": 10 * i, "total_down_bytes": 20 * i},
        }
        for i, (a, lo) in enumerate(zip(accs, losses, strict=True))
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"strategy": strategy, "wall_s": 1.0 + seed}))
    return path


def test_report_groups_seeds_into_mean_and_band(tmp_path):
    """Seeds of one variant are one line: mean +/- std per round; another strategy is another group."""
    from fedllm.run.report import report

    runs = [
        _fake_run(tmp_path / "fedit" / f"seed-{s}", s, accs, [0.5, 0.4])
        for s, accs in enumerate([[0.3, 0.5], [0.3, 0.7], [0.3, 0.6]])
    ]
    runs.append(_fake_run(tmp_path / "flora" / "seed-0", 0, [0.3, 0.9], [0.5, 0.3], strategy="flora"))
    text = report(runs, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    g = {x["name"]: x for x in data["groups"]}
    assert set(g) == {"fedit", "seed-0"} and g["fedit"]["seeds"] == [0, 1, 2]
    assert g["fedit"]["final_accuracy"]["mean"] == pytest.approx(0.6)
    assert g["fedit"]["final_accuracy"]["std"] == pytest.approx(0.1)  # sample std of 0.5, 0.7, 0.6
    assert g["fedit"]["accuracy_by_round"][1] == pytest.approx([1, 0.6, 0.1])
    assert "0.6000±0.1000" in text and "fedit (3)" in text and "mean±std over the seeds" in text


def test_tensorboard_tracker_logs_rounds(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = load_config(
        None, tiny_overrides(tmp_path / "tb", "output.log_with=[tensorboard]", "federation.rounds=1")
    )
    fed = Simulation(cfg, tmp_path / "tb")
    fed.setup()
    fed.run()
    events = list((tmp_path / "tb").rglob("events.out.tfevents*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.parametrize("offline", ["1", "0"])
def test_push_without_network_is_one_line_and_keeps_the_export(
    finished_run, tmp_path, monkeypatch, capsys, offline
):
    from fedllm.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)  # "0": the machine has no route to the Hub either way
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline == "1")
    out = tmp_path / "push"
    with pytest.raises(SystemExit) as e:
        main(["export", str(finished_run), "--output", str(out), "--push-to-hub", "org/fed-model"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert (
        err.startswith("fedllm: error: --push-to-hub org/fed-model")
        and f"hf upload org/fed-model {out}" in err
    )
    assert (out / "adapter_model.safetensors").exists()


def test_personalization_numbers_in_summary_card_report_and_export_folders(finished_run, tmp_path, capsys):
    """The clients' own accuracy (global and personalized model) is in summary.json, the printed summary, a
    client export's card and the report; default export folders are named by what they hold and never
    collide."""
    import shutil

    from fedllm.cli import main, print_summary
    from fedllm.run.report import report

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    clients = summary["clients"]
    assert clients["evaluated"] == sorted(int(k) for k in rows[-1]["personal"])
    assert clients["personal_acc_mean"] == pytest.approx(rows[-1]["personal_acc"])
    assert clients["per_client"]["1"]["global_acc"] == pytest.approx(rows[-1]["personal"]["1"]["global_acc"])
    print_summary(summary)
    out = capsys.readouterr().out
    assert "clients' own data  held-out loss: global model" in out
    assert "whole answers predicted: global model" in out
    assert f"personalized {clients['personal_loss_mean']:.4f} (mean over" in out
    for argv in ([], ["--client", "1"], ["--client", "2"], ["--merge"]):
        assert main(["export", str(run), *argv]) == 0
    assert sorted(p.name for p in (run / "export").iterdir()) == ["client-1", "client-2", "global", "merged"]
    card = (run / "export" / "client-1" / "README.md").read_text()
    mine = rows[-1]["personal"]["1"]
    assert f"client 1's own held-out accuracy (round {rows[-1]['round']})" in card
    assert f"**{mine['personal_acc']:.4f}** / {mine['global_acc']:.4f}" in card
    assert "model-index" not in card  # the personalized model was not benchmarked
    text = report([run], tmp_path / "rep")
    assert "rounds x steps" in text and "2 x 2" in text and "clients own" in text
    assert (tmp_path / "rep" / "personal_accuracy_vs_round.png").exists()
    assert not list(run.glob("*.png"))  # nothing written into the run's folder
