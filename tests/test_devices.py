"""Device discipline without a GPU: every client algorithm and strategy runs rounds, merges, evaluation,
personalization and a personalized export with the model on a pretend device (tests/pretend_device.py), and
every tensor that crosses to the server or stays in a client's state is on the CPU.

The rule (``fedllm/client/runtime.py``): the server, messages and client state live on the CPU; the runtime
moves tensors onto the model's device when it switches a client in and back when it reads an update out."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fedllm.aggregation import STRATEGIES
from fedllm.client import ALGORITHMS
from fedllm.config import load_config
from fedllm.factors import DenseDelta
from tests.conftest import tiny_overrides
from tests.pretend_device import DeviceMix, PretendDevice, on_cpu, pretend_accelerator, to_pretend_device

CASES = (
    [(a, "fedit", []) for a in sorted(ALGORITHMS)]
    + [("perfedavg", "fedit", ["client.perfedavg.variant=hf"])]
    + [("sft", s, []) for s in sorted(STRATEGIES) if s != "fedit"]
    + [
        (
            "fedprox",
            "floral",
            ["aggregation.floral.bias_adaptors=true", "aggregation.floral.precondition_eps=1e-5"],
        )
    ]
)


@pytest.fixture(autouse=True)
def one_thread():
    """Every op goes through Python here and the tensors are tiny: more threads only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_pretend_device_trains_and_catches_a_mix():
    with PretendDevice():
        model = to_pretend_device(
            torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        )
        p = next(model.parameters())
        assert p.device.type == "lazy"
        x = torch.randn(5, 4).to(p.device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        assert on_cpu(p.detach().cpu()) and not on_cpu(torch.zeros(2, device=p.device))
        assert float(p.detach().sum() * torch.tensor(2.0)) == pytest.approx(
            2 * float(p.detach().cpu().sum())
        )  # a scalar
        with pytest.raises(DeviceMix, match="meet tensors on the CPU"):
            p.detach() - p.detach().cpu()  # what SCAFFOLD's finish did before: it raises on a real GPU too


SLOW_CASES = {("perfedavg", "fedit"), ("fedprox", "floral")}  # their variant with options: 12 s each
# in the default run: FedIT's plain client path and each client side with device moves of its own (FLoRAL's
# routers, Fed-SB's R and dense step, RoLoRA's alternating freeze); the other strategies' rounds (8 s each)
# run with the slow tests
DEFAULT_STRATEGIES = {"fedit", "floral", "fedsb", "rolora"}


@pytest.mark.parametrize(
    ("algorithm", "strategy", "extra"),
    [
        pytest.param(
            a,
            s,
            e,
            marks=pytest.mark.slow if (e and (a, s) in SLOW_CASES) or s not in DEFAULT_STRATEGIES else (),
        )
        for a, s, e in CASES
    ],
    ids=[f"{a}-{s}{'+' if e else ''}" for a, s, e in CASES],
)
def test_a_round_on_an_accelerator_mixes_no_devices(tmp_path, builtin_base, algorithm, strategy, extra):

    floral = STRATEGIES[strategy].hook.local_params
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            f"client.algorithm={algorithm}",
            f"aggregation.name={strategy}",
            "eval.limit=1",
            "client.local_steps=1",
            "data.client_test_fraction=0.3",
            *(["lora.ranks=[4]"] if floral else []),
            *extra,
        ),
    )
    with _simulation_on_pretend_device(cfg, tmp_path) as sim:
        for r in (1, 2):
            row = sim.run_round(r).row
            assert row["n_updates"] == 4, row["failed"]  # a device mix fails a client (the run goes on)
        scores = sim.evaluate(0)
        personal = sim.personalized(2, [0, 1, 2, 3])
        start = sim.server.client_start(3, 0)
        adapter, dense, biases = sim.runtime.personalized_adapter(sim.clients[0], start)
    assert scores["eval_loss"] is not None and personal["personal"]
    tensors, _ = sim.server.state_dict()
    crossing = [*tensors.values(), *dense.values(), *biases.values()]
    crossing += [t for f in adapter.values() for t in ((f.D,) if isinstance(f, DenseDelta) else (f.A, f.B))]
    for c in sim.clients:  # the client state as it is read back from its file
        sim.store.load(c)
        crossing += list(c.state.values())
    assert all(on_cpu(t) for t in crossing), [type(t).__name__ for t in crossing if not on_cpu(t)][:3]


@contextlib.contextmanager
def _simulation_on_pretend_device(cfg, tmp_path):
    """A simulation of ``cfg`` whose model is on the pretend device, open while the mode is: data and model
    loaded on the CPU, then the model moved in the mode, as a driver moves it to a GPU."""
    from fedllm import assembly
    from fedllm.simulation import Simulation

    parts = assembly.load_partitions(cfg)
    model, tokenizer = assembly.load_model(cfg, _cpu())
    data, eval_data = assembly.tokenize_partitions(cfg, parts, model, tokenizer)
    with PretendDevice():
        to_pretend_device(model)
        acc = pretend_accelerator()
        fed = assembly.federation_on(
            cfg, acc, model, tokenizer, data, eval_data=eval_data, benchmark=assembly.benchmark_for(cfg)
        )
        yield Simulation(cfg, tmp_path, accelerator=acc, federation=fed)


def _cpu():
    import types

    return types.SimpleNamespace(device=torch.device("cpu"), main_process_first=contextlib.nullcontext)


@pytest.mark.parametrize("algorithm", ["scaffold", "fedprox"])
def test_client_batched_rounds_on_an_accelerator_mix_no_devices(tmp_path, builtin_base, caplog, algorithm):
    """Clients trained together (their stacked batch, the routed layers and their gradients, SCAFFOLD's and
    FedProx's per-client state) stay on the device; a device mix would fail the batch, and the fallback to
    training each client alone would hide it, so the test fails on that warning too. Without dropout: a
    generator cannot be made on the pretend device (a GPU's dropout masks come from one on the GPU)."""
    from fedllm.client import batched

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path,
            f"client.algorithm={algorithm}",
            "lora.trainable_modules=[]",
            "federation.client_batch=4",
            "eval.limit=1",
            "client.local_steps=2",
            "eval.personalized=false",
        ),
    )
    routed = []
    original = batched._RoutedLoRA.forward

    def counted(*args):
        routed.append(args[1].device.type)
        return original(*args)

    with (
        _simulation_on_pretend_device(cfg, tmp_path) as sim,
        caplog.at_level("WARNING", logger="fedllm.client.runtime"),
    ):
        batched._RoutedLoRA.forward = staticmethod(counted)
        try:
            for r in (1, 2):
                row = sim.run_round(r).row
                assert row["n_updates"] == 4, row["failed"]
        finally:
            batched._RoutedLoRA.forward = staticmethod(original)
    assert "client-batched training failed" not in caplog.text, caplog.text
    assert routed and set(routed) == {"lazy"}
    tensors, _ = sim.server.state_dict()
    assert all(on_cpu(t) for t in tensors.values())
