"""Client-batched local training (federation.client_batch, fedllm/client/batched.py): each client's update
is the one it gets alone."""

from __future__ import annotations

import pytest
import torch

from fedllm.config import ConfigError, load_config
from tests.conftest import TEST_PRETRAIN_STEPS, assert_close_updates, tiny_overrides

STRATEGIES = ("fedit", "flora", "flexlora", "florist", "fedex", "hetlora", "ffa", "fedsa")
ALGORITHMS = ("sft", "fedprox", "scaffold")
# the default run's share of the matrix (the whole of it: pytest -m slow)
QUICK = {("fedit", "scaffold"), ("hetlora", "fedprox")}


def _overrides(strategy: str, algorithm: str, k: int, optimizer: str) -> list[str]:
    return [
        f"model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}",
        "data.builtin_examples_per_skill=12",
        "data.min_examples_per_client=4",
        "data.partition=dirichlet",  # unequal data sizes
        "data.dirichlet_alpha=0.3",
        "federation.num_clients=3",
        "lora.ranks=[2,4,8]",
        "lora.dropout=0.2",  # each client's own masks
        "lora.trainable_modules=[]",
        "client.local_steps_per_client=[3,5,2]",  # unequal local steps
        "client.batch_size=4",
        f"client.optimizer={optimizer}",
        f"client.algorithm={algorithm}",
        f"aggregation.name={strategy}",
        *(
            ["aggregation.hetlora.prune_gamma=0.5", "aggregation.hetlora.prune_lambda=0.01"]
            if strategy == "hetlora"
            else []
        ),
        f"federation.client_batch={k}",
        "eval.benchmark=none",
    ]


def _updates(builtin_base, strategy: str, algorithm: str, k: int, optimizer: str = "adamw") -> dict:
    """Round 1's and round 2's updates of every client (float64 model: the comparison sees the algorithm, not
    float32 summation order), the second round from the server's aggregate of the first."""
    from accelerate import Accelerator

    from fedllm import assembly

    cfg = load_config(None, _overrides(strategy, algorithm, k, optimizer))
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    fed.runtime.model.double()
    out = {}
    for round_idx in (1, 2):
        plan = fed.server.plan_round(round_idx)
        clients = [fed.clients[c] for c in plan.active]
        got = fed.runtime.train_many(clients, [plan.starts[c.client_id] for c in clients])
        for u in got:
            assert not isinstance(u, Exception), u
            out.update({(round_idx, u.client_id, m, "A"): f.A for m, f in u.factors.items()})
            out.update({(round_idx, u.client_id, m, "B"): f.B for m, f in u.factors.items()})
            out.update({(round_idx, u.client_id, e): v for e, v in u.extras.items()})
        report = fed.server.finish_round(plan, {u.client_id: u for u in got})
        if report.merged:
            fed.runtime.merge(round_idx, report.merged)
    return out


def _valid(strategy: str, algorithm: str) -> bool:
    """The combinations the config accepts (SCAFFOLD needs a strategy that averages parameters)."""
    try:
        load_config(None, _overrides(strategy, algorithm, 1, "adamw"))
    except ConfigError:
        return False
    return True


MATRIX = [
    pytest.param(s, a, marks=() if (s, a) in QUICK else pytest.mark.slow)
    for s in STRATEGIES
    for a in ALGORITHMS
    if _valid(s, a)
]
assert {tuple(p.values) for p in MATRIX} >= QUICK


@pytest.mark.parametrize("strategy,algorithm", MATRIX)
def test_batched_clients_get_their_lone_updates(builtin_base, strategy, algorithm):
    alone = _updates(builtin_base, strategy, algorithm, 1)
    together = _updates(builtin_base, strategy, algorithm, 3)
    assert alone.keys() == together.keys()
    for key, want in alone.items():
        got = together[key]
        scale = float(want.norm())
        assert float((got - want).norm()) <= 1e-5 * max(scale, 1e-12), (
            key,
            float((got - want).norm()),
            scale,
        )


@pytest.mark.slow
def test_batched_run_matches_the_one_at_a_time_run(builtin_base, tmp_path):
    """Whole runs in float32 (the user's setting): the global adapters agree to float32 noise, which AdamW's
    normalization of near-cancelling gradient entries raises above 1e-5 (docs/scale.md)."""
    from fedllm.simulation import Simulation

    runs = {}
    for k in (1, 4):
        extra = ["lora.trainable_modules=[]", "lora.ranks=[2,4,8,4]", f"federation.client_batch={k}"]
        cfg = load_config(None, tiny_overrides(tmp_path / f"k{k}", *extra))
        sim = Simulation(cfg, tmp_path / f"k{k}")
        sim.setup()
        sim.run()
        runs[k] = tmp_path / f"k{k}"
    assert_close_updates(runs[1], runs[4], 1e-3)


def test_batching_needs_adapters_only_and_says_why_others_train_alone(builtin_base, caplog):
    with pytest.raises(ConfigError, match="federation.client_batch = 2 with lora.trainable_modules"):
        load_config(None, ["federation.client_batch=2", "lora.trainable_modules=[embed_tokens]"])
    from accelerate import Accelerator

    from fedllm import assembly

    cfg = load_config(None, _overrides("fedit", "perfedavg", 2, "sgd"))
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    plan = fed.server.plan_round(1)
    clients = [fed.clients[c] for c in plan.active][:2]
    with caplog.at_level("INFO", logger="fedllm.client.runtime"):
        got = fed.runtime.train_many(clients, [plan.starts[c.client_id] for c in clients])
    assert not any(isinstance(u, Exception) for u in got)
    assert "one at a time: client.algorithm=perfedavg takes several forwards" in caplog.text


def test_a_failing_batch_falls_back_to_each_client_alone(builtin_base, monkeypatch, caplog):
    from accelerate import Accelerator

    from fedllm import assembly
    from fedllm.client import batched

    cfg = load_config(None, _overrides("fedit", "sft", 3, "adamw"))
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    plan = fed.server.plan_round(1)
    clients = [fed.clients[c] for c in plan.active]

    def broken(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(batched, "train_together", broken)
    with caplog.at_level("WARNING"):
        got = fed.runtime.train_many(clients, [plan.starts[c.client_id] for c in clients])
    assert len(got) == 3 and not any(isinstance(u, Exception) for u in got)
    assert (
        "client-batched training failed (RuntimeError: out of memory); training each client alone"
        in caplog.text
    )
    assert torch.isfinite(torch.tensor([u.metrics["loss_last"] for u in got])).all()
