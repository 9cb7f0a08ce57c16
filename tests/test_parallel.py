"""Process layouts: data-parallel batch sharding math, refused combinations, shipped launch configs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fedllm.aggregation import strategy_from_config
from fedllm.assembly import layout_for
from fedllm.client.base import batch_stream
from fedllm.config import ConfigError, load_config
from fedllm.model.parallel import Layout
from fedllm.simulation import Simulation
from tests.conftest import assert_close_updates, switch_in, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def fake_accelerator(kind="MULTI_GPU", processes=2, stage=0, precision="bf16"):
    plugin = SimpleNamespace(zero_stage=stage, deepspeed_config={})
    return SimpleNamespace(
        distributed_type=kind,
        process_index=0,
        num_processes=processes,
        mixed_precision=precision,
        state=SimpleNamespace(deepspeed_plugin=plugin),
    )


def layout(cfg, accelerator):
    return layout_for(cfg, accelerator, strategy_from_config(cfg.aggregation))


def test_layout_defaults():
    cfg = load_config()
    assert layout(cfg, fake_accelerator()).mode == "clients"
    ds = layout(load_config(None, ["eval.personalized=false"]), fake_accelerator("DEEPSPEED", stage=3))
    assert ds.mode == "data" and ds.data_parallel and ds.zero_stage == 3
    assert Layout("clients", 1, 3).my_clients([0, 1, 2, 3, 4]) == [1, 4]
    assert Layout("data", 1, 3).my_clients([0, 1, 2, 3, 4]) == [0, 1, 2, 3, 4]
    assert not Layout("data", 0, 1).data_parallel  # one plain process: nothing to wrap


@pytest.mark.parametrize(
    ("kind", "stage", "overrides", "message"),
    [
        (
            "DEEPSPEED",
            2,
            ["federation.parallel=clients"],
            "federation.parallel = clients cannot run under DeepSpeed",
        ),
        ("DEEPSPEED", 2, ["client.algorithm=fedprox"], "client.algorithm = fedprox"),
        ("DEEPSPEED", 2, ["client.grad_accum=2"], "client.grad_accum must be 1"),
        ("DEEPSPEED", 3, ["model.quantization=4bit", "eval.personalized=false"], "ZeRO-3"),
        ("DEEPSPEED", 3, [], "eval.personalized must be false"),
        (
            "MULTI_GPU",
            0,
            ["federation.parallel=data", "client.batch_size=5"],
            "client.batch_size = 5 must be a multiple",
        ),
        (
            "MULTI_GPU",
            0,
            ["federation.parallel=data", "aggregation.name=floral", "lora.ranks=[4]"],
            "aggregation.name = floral is not supported with federation.parallel=data",
        ),
    ],
)
def test_refused_combinations_name_the_field(kind, stage, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        layout(load_config(None, overrides), fake_accelerator(kind, stage=stage))


def test_fp16_without_deepspeed_is_refused():
    with pytest.raises(ConfigError, match="fp16 needs loss scaling"):
        layout(load_config(), fake_accelerator(precision="fp16"))


def test_bad_parallel_value_is_a_config_error():
    with pytest.raises(ConfigError, match="federation.parallel"):
        load_config(None, ["federation.parallel=pipeline"])


def test_shares_of_a_batch_give_the_whole_batch_gradient(tmp_path, builtin_base):
    """Averaging the shares' gradients (what DDP/DeepSpeed do) gives the one-process gradient exactly."""
    cfg = load_config(None, tiny_overrides(tmp_path, "lora.trainable_modules=[]"))
    fed = Simulation(cfg, tmp_path)
    fed.setup()
    params, _ = switch_in(fed, fed.clients[0], 1)
    with torch.no_grad():  # non-zero B so that every factor has a gradient
        for k, p in params.items():
            if k.endswith(".B"):
                p.normal_(0, 0.02)
    fed.runtime.model.train()
    batch = next(batch_stream(fed.clients[0].train, 4, fed.runtime.tokenizer.pad_token_id, 0))

    def grads(b):
        for p in params.values():
            p.grad = None
        loss = fed.runtime.model(**b).loss
        loss.backward()
        return {k: p.grad.clone() for k, p in params.items()}, loss.item()

    whole, whole_loss = grads(batch)
    shares = []
    for rank in range(2):
        share = next(Layout("data", rank, 2).split_batches(iter([batch])))
        assert share["input_ids"].shape[0] == 2  # an equal share of the rows
        shares.append(grads(share))
    for k in whole:
        torch.testing.assert_close((shares[0][0][k] + shares[1][0][k]) / 2, whole[k], rtol=1e-5, atol=1e-7)
    assert (shares[0][1] + shares[1][1]) / 2 == pytest.approx(whole_loss, rel=1e-5)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "accelerate").glob("*.yaml")))
def test_shipped_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "configs" / "accelerate" / name))
    assert config.mixed_precision == "bf16"
    assert config.num_processes >= 1 and config.num_machines >= 1
    if name.startswith("deepspeed"):
        from accelerate.utils import DeepSpeedPlugin

        assert str(config.distributed_type).endswith("DEEPSPEED")
        ds_file = ROOT / config.deepspeed_config["deepspeed_config_file"]  # relative to the repository root
        plugin = DeepSpeedPlugin(hf_ds_config=str(ds_file))
        assert plugin.zero_stage == int(name[-6])  # deepspeed_zeroN.yaml
        assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
        assert config.deepspeed_config["zero3_init_flag"] == (plugin.zero_stage == 3)


@pytest.mark.slow
def test_run_federated_script_launches_processes(tmp_path, builtin_base):
    """scripts/run_federated.sh with the multi-GPU config, on 2 CPU processes, bf16 from the config."""
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "NUM_PROCESSES": "2",
        "OMP_NUM_THREADS": "1",
        "MAIN_PROCESS_PORT": "29541",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "run_federated.sh"),
            "configs/accelerate/multi_gpu.yaml",
            *tiny_overrides(run_dir, "federation.rounds=1", "eval.personalized=false"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["parallel"] == "clients"
    assert summary["mixed_precision"] == "bf16"
    assert math.isfinite(summary["loss_after"])  # bf16 autocast ran without overflow
    bad = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_federated.sh"), "missing.yaml"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
@pytest.mark.parametrize("config", ["multi_gpu.yaml", "single_gpu.yaml", "deepspeed_zero3.yaml"])
def test_run_federated_script_refuses_gpu_configs_without_gpus(tmp_path, config):
    """No GPU: refused with the CPU command to run instead (not N independent single-process runs)."""
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "run_federated.sh"),
            f"configs/accelerate/{config}",
            "--output-dir",
            str(tmp_path / "r"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2 and "no GPU found" in out.stderr
    assert "ACCELERATE_USE_CPU=1 NUM_PROCESSES=2" in out.stderr and not (tmp_path / "r").exists()
    if config.startswith("deepspeed"):
        cpu = subprocess.run(
            ["bash", str(ROOT / "scripts" / "run_federated.sh"), f"configs/accelerate/{config}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**env, "ACCELERATE_USE_CPU": "1"},
            timeout=120,
        )
        assert cpu.returncode == 2 and "does not run on CPU processes" in cpu.stderr


DS_EXTRA = ("aggregation.name=flora", "eval.personalized=false", "eval.limit=2")
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or shutil.which("c++") is None,
    reason="DeepSpeed (and a C++ compiler for its CPU communication op) not installed",
)


@pytest.fixture(scope="module")
def plain_flora(tmp_path_factory, builtin_base):
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    subprocess.run(
        [sys.executable, "-m", "fedllm.cli", "run", *tiny_overrides(run_dir, *DS_EXTRA)],
        check=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return run_dir


@needs_deepspeed
@pytest.mark.slow  # 75 s on 2 cores: run before stopping, with -m slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_through_shipped_config_matches_plain_run(tmp_path, stage, plain_flora):
    """A DeepSpeed ZeRO-2/3 engine (one CPU process) trains every client to the plain run's result.

    ZeRO-3 shards the base, so FLoRA's merged update goes to the frozen residual adapter instead.
    """
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "configs" / "accelerate" / f"deepspeed_zero{stage}.yaml"),
            "--num_processes",
            "1",
            "--mixed_precision",
            "no",
            "--main_process_port",
            str(29560 + stage),
            "-m",
            "fedllm.cli",
            "run",
            *tiny_overrides(run_dir, *DS_EXTRA),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    plain = json.loads((plain_flora / "summary.json").read_text())
    assert summary["parallel"] == "data" and summary["deepspeed_zero_stage"] == stage
    assert summary["failed_client_calls"] == 0
    assert ("residual_adapter_rank" in summary) == (stage == 3)
    assert summary["loss_after"] == pytest.approx(plain["loss_after"], rel=1e-4)
    assert_close_updates(plain_flora, run_dir, 1e-2)


def test_gradient_checkpointing_gives_the_same_update(tmp_path, builtin_base):
    """model.gradient_checkpointing recomputes activations in backward: less memory, same gradients."""
    runs = {}
    for flag in ("false", "true"):
        cfg = load_config(
            None,
            tiny_overrides(
                tmp_path / flag,
                "federation.rounds=1",
                "eval.benchmark=none",
                "eval.personalized=false",
                f"model.gradient_checkpointing={flag}",
            ),
        )
        fed = Simulation(cfg, tmp_path / flag)
        fed.setup()
        base = fed.runtime.model.get_base_model()
        assert base.model.gradient_checkpointing == (flag == "true")
        fed.run()
        runs[flag] = fed.server.state.factors
    for k, f in runs["false"].items():
        torch.testing.assert_close(runs["true"][k].B, f.B, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runs["true"][k].A, f.A, rtol=1e-5, atol=1e-6)


def test_data_layout_refuses_clients_smaller_than_a_batch():
    from data_prep.prompts import TokenizedExample
    from fedllm.assembly import check_client_batches

    cfg = load_config(None, ["client.batch_size=16"])
    data = [([TokenizedExample([1, 2], [1, 2])] * n, []) for n in (16, 15)]
    check_client_batches(cfg, Layout("clients", 0, 2), data)  # each process takes whole clients: fine
    with pytest.raises(
        ValueError, match=r"client 1 has 15 .*fewer than client.batch_size = 16.*min_examples"
    ):
        check_client_batches(cfg, Layout("data", 0, 2), data)  # a 2-process launch with parallel=data
