"""Shared fixtures: offline Hub, a fast built-in base cached once per session."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from fedllm.factors import LoraFactors

# Tests use a briefly pretrained base: learning is tested end to end elsewhere
# (the README's default run); here only mechanics and math are.
TEST_PRETRAIN_STEPS = 60


@pytest.fixture(scope="session", autouse=True)
def fedllm_cache(tmp_path_factory):
    cache = os.environ.get("FEDLLM_TEST_CACHE") or str(tmp_path_factory.mktemp("fedllm-cache"))
    os.environ["FEDLLM_CACHE"] = cache
    return cache


@pytest.fixture(scope="session")
def builtin_base(fedllm_cache):
    from fedllm.model.builtin_base import ensure_builtin_base

    return ensure_builtin_base(TEST_PRETRAIN_STEPS)


def random_factors(
    rank: int, out_dim: int, in_dim: int, scale: float, gen: torch.Generator, dtype=torch.float64
) -> LoraFactors:
    return LoraFactors(
        torch.randn(rank, in_dim, generator=gen, dtype=dtype),
        torch.randn(out_dim, rank, generator=gen, dtype=dtype),
        scale,
    )


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def tiny_overrides(run_dir, *extra: str) -> list[str]:
    """Overrides for a fast 2-round run on the tiny base."""
    return [
        f"model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}",
        "data.builtin_examples_per_skill=12",
        "data.eval_size=16",
        "data.min_examples_per_client=4",
        "federation.rounds=2",
        "client.local_steps=2",
        "client.batch_size=4",
        "eval.limit=3",
        # each test's runs evaluate their own base: a round-0 row reused from another test would make any
        # comparison of round 0 between runs true by construction (tests/test_evaluation_cache.py reuses)
        "eval.reuse_base=false",
        f"output.dir={run_dir}",
        *extra,
    ]


def adapter_updates(run_dir) -> dict[str, torch.Tensor]:
    """Each module's exported update B @ A, plus dense modules, of a run's global adapter.

    Factorizations differ by an SVD gauge between runs; the products must not.
    """
    from safetensors.torch import load_file

    t = load_file(Path(run_dir) / "global_adapter" / "adapter_model.safetensors")
    out = {k: v for k, v in t.items() if "lora_" not in k}
    out.update({k: t[k.replace("lora_A", "lora_B")] @ v for k, v in t.items() if "lora_A" in k})
    return out


def assert_close_updates(a, b, tol: float) -> None:
    """Every module's update of run ``b`` within relative Frobenius distance ``tol`` of run ``a``'s."""
    ua, ub = adapter_updates(a), adapter_updates(b)
    assert ua.keys() == ub.keys()
    for k in ua:  # (a module the run left at zero, e.g. FedSA-LoRA's unshared B, must stay zero)
        assert float((ub[k] - ua[k]).norm()) <= tol * float(ua[k].norm()), k


def assert_resume_matches_straight(tmp_path, *over: str) -> None:
    """Two tiny rounds then a resume to three, against three straight (``tmp_path/a``, ``tmp_path/b``): the
    same global adapter, which needs everything a round's state carries to come back from the checkpoint."""
    from fedllm.cli import main

    assert main(["run", *tiny_overrides(tmp_path / "a", *over)]) == 0
    assert main(["run", "--resume", str(tmp_path / "a"), "federation.rounds=3"]) == 0
    assert main(["run", *tiny_overrides(tmp_path / "b", *over, "federation.rounds=3")]) == 0
    a, b = adapter_updates(tmp_path / "a"), adapter_updates(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-8)


def switch_in(sim, client, round_idx: int):
    """Switch ``client`` in as it would start ``round_idx``; returns its trainable parameters and start
    factors.
    """
    return sim.runtime.switch_in(client, sim.server.client_start(round_idx, client.client_id))


def install_global(sim) -> bool:
    """Install the server's global model on the runtime's base (as the evaluation does)."""
    return sim.runtime.install_global(*sim.server.global_adapter())


def heldout_of(sim, data):
    from fedllm.model.evaluation import heldout

    return heldout(sim.runtime.model, sim.runtime.tokenizer, data, sim.cfg.eval.batch_size)


def faulty(cls):
    """A driver class whose clients' updates pass through ``fault(round, client, update) -> update`` (a test's
    stand-in for a buggy or hostile client), e.g. ``faulty(Simulation)(cfg, run_dir, fault=f)``."""

    class Faulty(cls):
        def __init__(self, *args, fault=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.fault = fault

        def setup(self):
            super().setup()
            train = self.runtime.train

            def train_with_fault(client, start):
                update = train(client, start)
                return self.fault(start.round, client.client_id, update) if self.fault else update

            self.runtime.train = train_with_fault

    return Faulty
