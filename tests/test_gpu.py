"""GPU-only paths: bitsandbytes on CUDA, bf16, multi-GPU launches, DeepSpeed ZeRO-2/3 across GPUs.

Skipped cleanly without CUDA. Run them with ``bash scripts/gpu_check.sh`` on
a GPU machine (``pytest -m gpu tests/test_gpu.py``); the multi-GPU tests
also skip with fewer than 2 GPUs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedllm.config import load_config
from fedllm.simulation import Simulation
from tests.conftest import assert_close_updates, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
EXTRA = ("eval.personalized=false", "client.local_steps=6", "eval.limit=4")


def launch(run_dir: Path, accelerate_args: list[str], *extra: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *accelerate_args,
            "-m",
            "fedllm.cli",
            "run",
            *tiny_overrides(run_dir, *EXTRA, *extra),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory, builtin_base):
    """One process, full precision, on GPU 0: the reference for the launches below."""
    runs = {}
    for strategy in ("fedit", "flora"):
        d = tmp_path_factory.mktemp(strategy) / "run"
        launch(d, ["--num_processes", "1", "--mixed_precision", "no"], f"aggregation.name={strategy}")
        runs[strategy] = d
    return runs


@pytest.mark.parametrize(
    "extra",
    [
        ["client.algorithm=scaffold"],
        ["client.algorithm=perfedavg", "client.perfedavg.variant=hf"],
        [
            "aggregation.name=floral",
            "lora.ranks=[4]",
            "aggregation.floral.bias_adaptors=true",
            "eval.personalized=true",
        ],
    ],
    ids=["scaffold", "perfedavg-hf", "floral"],
)
def test_stateful_algorithms_and_floral_train_every_client_on_cuda(tmp_path, extra, builtin_base):
    """Client state (c_k, routers) and downloads cross between the CPU and the GPU: no client may fail."""
    summary = launch(tmp_path / "run", ["--num_processes", "1", "--mixed_precision", "no"], *extra)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["failed_client_calls"] == 0 and all(r["n_updates"] == 4 for r in rows[1:])
    assert summary["loss_after"] < summary["loss_before"]


@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_qlora_on_cuda_keeps_residual_and_learns(tmp_path, mode, builtin_base):
    cfg = load_config(
        None, tiny_overrides(tmp_path, *EXTRA, f"model.quantization={mode}", "aggregation.name=flora")
    )
    fed = Simulation(cfg, tmp_path)
    fed.setup()
    assert next(fed.runtime.model.parameters()).device.type == "cuda"
    summary = fed.run()
    assert summary["loss_after"] < summary["loss_before"]
    assert summary["residual_adapter_rank"] > 0 and summary["quantization"] == mode


def test_bf16_single_gpu_config(tmp_path, plain):
    summary = launch(tmp_path / "run", ["--config_file", str(ROOT / "configs/accelerate/single_gpu.yaml")])
    assert summary["mixed_precision"] == "bf16" and summary["processes"] == 1
    reference = json.loads((plain["fedit"] / "summary.json").read_text())
    assert summary["loss_after"] == pytest.approx(
        reference["loss_after"], rel=0.05
    )  # bf16 autocast, same run


@two_gpus
def test_two_gpus_client_parallel_equals_one(tmp_path, plain):
    summary = launch(tmp_path / "run", ["--multi_gpu", "--num_processes", "2", "--mixed_precision", "no"])
    assert summary["processes"] == 2 and summary["parallel"] == "clients"
    assert_close_updates(plain["fedit"], tmp_path / "run", 1e-3)


@two_gpus
def test_two_gpus_data_parallel_equals_one(tmp_path, plain):
    summary = launch(
        tmp_path / "run",
        ["--multi_gpu", "--num_processes", "2", "--mixed_precision", "no"],
        "federation.parallel=data",
    )
    assert summary["processes"] == 2 and summary["parallel"] == "data"
    assert_close_updates(plain["fedit"], tmp_path / "run", 2e-2)  # AdamW magnifies reduction-order noise


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_on_gpus(tmp_path, stage, plain):
    n = min(2, torch.cuda.device_count())
    summary = launch(
        tmp_path / "run",
        [
            "--config_file",
            str(ROOT / f"configs/accelerate/deepspeed_zero{stage}.yaml"),
            "--num_processes",
            str(n),
            "--mixed_precision",
            "no",
        ],
        "aggregation.name=flora",
    )
    assert summary["processes"] == n and summary["deepspeed_zero_stage"] == stage
    assert summary["failed_client_calls"] == 0
    assert ("residual_adapter_rank" in summary) == (stage == 3)
    assert_close_updates(plain["flora"], tmp_path / "run", 2e-2)


def test_batched_clients_get_their_lone_updates_on_cuda(builtin_base):
    """Client batching on a GPU: without dropout each client's batched update equals its lone one (float64,
    1e-5 relative), as on the CPU. With dropout the masks come from each client's own generator through
    ``bernoulli_``, not CUDA's fused dropout kernel: their keep rate is 1 - p and they are not all ones."""
    from fedllm.client.batched import Routing, _Masks, _Span
    from tests.test_client_batch import _updates, _worst

    extra = ("lora.dropout=0.0",)
    alone = _updates(builtin_base, "fedit", "scaffold", 1, extra=extra, cpu=False)
    together = _updates(builtin_base, "fedit", "scaffold", 3, extra=extra, cpu=False)
    worst, where = _worst(alone, together)
    assert worst <= 1e-5, (where, worst)

    drop = torch.nn.Dropout(0.2).train()
    layer = type("Layer", (), {"lora_dropout": {"s": drop}})()
    routing = Routing.__new__(Routing)
    routing._drawn = {}
    routing._spans = [_Span("s", 0, 64, 32, _Masks(0, torch.device("cuda")))]
    x = torch.zeros(64, 32, 256, device="cuda")
    (mask,) = routing._noise(layer, x, torch.float32)
    kept = float((mask > 0).float().mean())
    assert mask.is_cuda and abs(kept - 0.8) < 0.01 and float(mask.max()) == pytest.approx(1 / 0.8)
