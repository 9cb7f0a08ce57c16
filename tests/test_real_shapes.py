"""TinyLlama's real shapes (hidden 2048, intermediate 5632, GQA 32/4, vocabulary 32000), one decoder layer: a
round of every strategy with mixed ranks up to 64 on all seven projections, through the driver of
scripts/bench_real_shapes.py (the full-depth numbers are that script's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_real_shapes", ROOT / "scripts" / "bench_real_shapes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_layer(bench):
    from fedllm.builtin_model import build_tokenizer

    return {"model": bench.tinyllama(1), "tokenizer": build_tokenizer()}


@pytest.mark.parametrize("strategy", ["fedit", "flora", "flexlora", "florist", "floral"])
def test_every_strategy_runs_at_tinyllama_shape(tmp_path, bench, one_layer, strategy):
    ranks = [64, 16, 4]
    cfg = bench.config_for(strategy, ranks, steps=1, batch_size=1, run_dir=tmp_path)
    driver = bench.make_driver(
        cfg, tmp_path, one_layer["model"], one_layer["tokenizer"], examples_per_client=2, seq_len=48
    )
    try:
        result = bench.timed_round(driver)  # raises if any client failed
        assert result["n_updates"] == 3
        adapter, _, _ = driver.server.global_adapter()
        adapter = adapter or driver.server.state.residual  # FLoRA, FLoRIST: the round's update is in the base
        assert len(adapter) == len(bench.MODULES)  # every projection of the layer
        base = driver.runtime.model.get_base_model()
        for key, f in adapter.items():
            module = base.get_submodule(key).base_layer
            assert f.B.shape[0] == module.out_features and f.A.shape[1] == module.in_features, key
            assert f.A.shape[0] == f.B.shape[1] <= sum(ranks), key
            assert torch.isfinite(f.A).all() and torch.isfinite(f.B).all() and f.B.abs().sum() > 0, key
    finally:
        one_layer["model"] = driver.runtime.model.unload()  # the bare base for the next strategy
