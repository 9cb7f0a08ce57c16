"""End-to-end federated runs on the tiny base, and fail-fast errors of the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fedllm.config import load_config
from fedllm.simulation import Simulation
from tests.conftest import install_global, tiny_overrides


def run(tmp_path, *extra, name="run"):
    cfg = load_config(None, tiny_overrides(tmp_path / name, *extra))
    fed = Simulation(cfg, tmp_path / name)
    fed.setup()
    return fed, fed.run()


@pytest.mark.parametrize("strategy", ["fedit", "flora", "flexlora", "florist", "fedex", "hetlora", "ffa"])
def test_two_round_run_writes_everything(tmp_path, strategy):
    fed, summary = run(tmp_path, f"aggregation.name={strategy}")
    d = tmp_path / "run"
    assert (d / "config.yaml").exists() and (d / "partition.json").exists() and (d / "summary.json").exists()
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["n_updates"] == 4 and r["up_params"] > 0
        assert {"time_train_s", "time_aggregate_s", "time_eval_s", "accuracy", "eval_loss"} <= set(r)
        # each evaluation phase's own time, within the evaluation's
        phases = r["time_eval_loss_s"] + r["time_eval_benchmark_s"]
        assert 0 < phases <= r["time_eval_s"]
    assert summary["ranks"] == [4, 8, 16, 32]
    assert (d / "global_adapter" / "adapter_model.safetensors").exists()

    # The exported adapter loads with peft and reproduces the in-run global model.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fedllm.run.export import base_model_reference

    base = AutoModelForCausalLM.from_pretrained(base_model_reference(fed.cfg))
    model = PeftModel.from_pretrained(base, d / "global_adapter").eval()
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    install_global(fed)
    ctx = (
        torch.no_grad()
        if fed.strategy.global_adapter(fed.server.state)
        else fed.runtime.model.disable_adapter()
    )
    with ctx, torch.no_grad():
        ours = fed.runtime.model(input_ids=ids).logits
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_download_cost_per_strategy(tmp_path):
    """FLoRA's download grows with the sum of ranks (up to the dense matrix), FlexLoRA's with each client's
    rank."""
    sim, flora = run(tmp_path, "aggregation.name=flora", "lora.trainable_modules=[]", name="a")
    _, flex = run(tmp_path, "aggregation.name=flexlora", "lora.trainable_modules=[]", name="b")
    rows_a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    shapes = sim.server.modules.values()
    # round 2: FLoRA sends each of 4 clients the round-1 update of rank 4+8+16+32 = 60 in its smallest exact
    # form (a module whose dense matrix is smaller goes dense); FlexLoRA sends each client its own rank
    assert rows_a[2]["down_params"] == 4 * sum(min(60 * (o + i), o * i) for o, i in shapes)
    assert rows_b[2]["down_params"] == sum(r * (o + i) for r in (4, 8, 16, 32) for o, i in shapes)
    assert flora["communication"]["total_up_params"] == flex["communication"]["total_up_params"]


def test_same_seed_same_result(tmp_path):
    from safetensors.torch import load_file

    run(tmp_path, name="x")
    run(tmp_path, name="y")
    a = load_file(tmp_path / "x" / "global_adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "y" / "global_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fedllm.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["aggregation.name=nope"],
            "aggregation.name = 'nope' is unknown; valid choices: fedex, fedit, fedsa",
        ),
        (["lora.ranks=[4,0]"], "lora.ranks: rank 0 is invalid"),
        (["data.dataset=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl does not exist"),
        (["model.name=meta-llama/Llama-3.2-1B"], "is a Hub id but HF_HUB_OFFLINE=1"),
        (["federation.num_clients=5000"], "federation.num_clients = 5000 with data.min_examples_per_client"),
    ],
)
def test_cli_fails_fast_with_one_message(tmp_path, args, message):
    out = cli(
        "run",
        "--output-dir",
        str(tmp_path / "r"),
        "data.builtin_examples_per_skill=20",
        "model.builtin_pretrain_steps=60",
        *args,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_record_without_fields(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"instruction": "a", "context": "", "response": "b", "category": "x"})
        + "\n"
        + json.dumps({"instruction": "a", "context": ""})
        + "\n"
    )
    out = cli("run", "--output-dir", str(tmp_path / "r"), f"data.dataset={data}")
    assert out.returncode == 2
    assert f"{data}, line 2: missing required field 'response'" in out.stderr


def test_help_config_lists_options():
    out = cli("run", "--help-config")
    assert out.returncode == 0 and "aggregation.florist.tau" in out.stdout and "energy fraction" in out.stdout
