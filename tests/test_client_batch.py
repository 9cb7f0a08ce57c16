"""Client-batched local training (federation.client_batch, fedllm/client/batched.py): each client's update
is the one it gets alone."""

from __future__ import annotations

import contextlib
import logging

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
        with _no_fallback():  # clients trained alone after a failed batch would pass for equal
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


@contextlib.contextmanager
def _no_fallback():
    """Fails if client-batched training fell back to training each client alone."""
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logger = logging.getLogger("fedllm.client.runtime")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "client-batched training failed" in m], seen


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


def _routed_case(dtype=torch.float64, dropout=(True, False, True), frozen_a=False):
    """Three clients' rows of a stacked batch (4, 2 and 3 rows of width 5), ranks 2, 5 and 3, one base
    projection 6 -> 7, and the routed layer's description; the masks as a client's lone dropout draws them."""
    from fedllm.client.batched import _Layer

    g = torch.Generator().manual_seed(0)
    rows, width, ranks, scales = [4, 2, 3], 5, [2, 5, 3], [0.5, 2.0, 1.25]
    x = torch.randn(sum(rows), width, 6, generator=g, dtype=dtype)
    w = torch.randn(7, 6, generator=g, dtype=dtype)
    a = [torch.randn(r, 6, generator=g, dtype=dtype).requires_grad_(not frozen_a) for r in ranks]
    b = [torch.randn(7, r, generator=g, dtype=dtype).requires_grad_() for r in ranks]
    bounds, noise, at = [], [], 0
    for n, drops in zip(rows, dropout, strict=True):
        bounds.append((at * width, (at + n) * width))
        at += n
        mask = (torch.rand(n * width, 6, generator=g) > 0.3).to(dtype) / 0.7
        noise.append(mask if drops else None)
    return x, w, a, b, _Layer(scales, bounds, noise, dtype)


def _reference(x, w, a, b, layer):
    """Each client's rows through ``x W^T + s B A drop(x)`` with plain autograd."""
    flat = x.reshape(-1, x.shape[-1])
    parts = []
    for (lo, hi), ak, bk, s, noise in zip(layer.bounds, a, b, layer.scales, layer.noise, strict=True):
        xk = flat[lo:hi] if noise is None else flat[lo:hi] * noise
        parts.append(flat[lo:hi] @ w.T + s * (xk @ ak.T) @ bk.T)
    return torch.cat(parts).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("frozen_a", [False, True])
def test_the_routed_layer_is_autograd_through_each_clients_adapter(frozen_a):
    """Output and gradients (input, A, B) of the hand-written backward equal plain autograd's in float64, with
    unequal ranks, rows and scales, dropout on two of three clients and (FFA-LoRA) a frozen A."""
    from fedllm.client.batched import _RoutedLoRA

    x, w, a, b, layer = _routed_case(frozen_a=frozen_a)
    x.requires_grad_()
    upstream = torch.randn(
        x.shape[0], x.shape[1], 7, dtype=x.dtype, generator=torch.Generator().manual_seed(1)
    )
    got = _RoutedLoRA.apply(torch.nn.functional.linear(x, w), x, layer, *a, *b)
    grads = torch.autograd.grad((got * upstream).sum(), [x, *[t for t in a + b if t.requires_grad]])
    want = _reference(x, w, a, b, layer)
    wants = torch.autograd.grad((want * upstream).sum(), [x, *[t for t in a + b if t.requires_grad]])
    torch.testing.assert_close(got, want)
    for g, r in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, r)
    assert all(t.grad is None for t in a + b)

    def fn(xx, *weights):
        return _RoutedLoRA.apply(torch.nn.functional.linear(xx, w), xx, layer, *weights)

    small = [t.detach().clone().requires_grad_(t.requires_grad) for t in a + b]
    assert torch.autograd.gradcheck(fn, (x.detach().clone().requires_grad_(), *small))


def test_the_routed_layer_under_bf16_autocast_is_the_modules_bf16_product():
    """Under autocast (a GPU's bf16, here the CPU's) the adapters' products run in the autocast dtype, as
    peft's modules run there, and their gradients arrive in the adapters' own dtype."""
    from fedllm.client.batched import _Layer, _RoutedLoRA

    x, w, a, b, layer = _routed_case(dtype=torch.float32, dropout=(False, False, False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = _Layer(layer.scales, layer.bounds, layer.noise, torch.bfloat16)
        got = _RoutedLoRA.apply(torch.nn.functional.linear(x, w), x, bf16, *a, *b)
        flat = x.reshape(-1, 6)
        want = torch.cat(
            [
                torch.nn.functional.linear(flat[lo:hi], w)
                + torch.nn.functional.linear(torch.nn.functional.linear(flat[lo:hi], ak), bk) * s
                for (lo, hi), ak, bk, s in zip(layer.bounds, a, b, layer.scales, strict=True)
            ]
        ).view(got.shape)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in a + b)
