"""FLoRAL: mixture forward, aggregation weights, routers, uploads, bias adaptors, personalized export."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import ClientUpdate, GlobalState
from fedllm.aggregation.fedit import FedIT
from fedllm.aggregation.floral import FLoRAL, adaptor_weights
from fedllm.aggregation.floral_mixture import MixtureOptions, MixtureSession
from fedllm.client import ALGORITHMS
from fedllm.config import ConfigError, LoraConfig, load_config
from fedllm.factors import LoraFactors, fresh_factors, read_factors, write_factors
from fedllm.model.modeling import attach_lora, install_adapter
from fedllm.simulation import Simulation
from tests.conftest import faulty, random_factors, switch_in, tiny_overrides


@pytest.mark.parametrize("bias", [False, True])
def test_mixture_forward_equals_stacked_lora(builtin_base, bias):
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(ranks=[6], target_modules=["q_proj", "v_proj", "down_proj"])
    model = attach_lora(AutoModelForCausalLM.from_pretrained(builtin_base), [6], lora).eval()
    gen = torch.Generator().manual_seed(0)
    factors = {
        k: LoraFactors(f.A, 0.2 * torch.randn(f.B.shape, generator=gen), f.scale)
        for k, f in fresh_factors(model, "r6", 1).items()
    }
    write_factors(model, "r6", factors)
    spec = MixtureOptions(num_adaptors=3, temperature=0.7, granularity="block", bias=bias)
    router = {g: torch.randn(3, generator=gen) for g in ("layer0", "layer1", "layer2")}
    biases = (
        {k: 0.1 * torch.randn(3, f.B.shape[0], generator=gen) for k, f in factors.items()} if bias else None
    )
    ids = torch.tensor([[1, 30, 40, 50, 60, 7]])
    session = MixtureSession(model, "r6", spec, router, biases)
    with torch.no_grad():
        mixed = model(input_ids=ids).logits
        baked, baked_bias = session.bake(read_factors(model, "r6"))
    session.close()
    key = next(iter(factors))
    pi = torch.softmax(router["layer0"] / 0.7, -1)
    f = factors[key]
    by_hand = sum(pi[c] * f.scale * f.B[:, 2 * c : 2 * c + 2] @ f.A[2 * c : 2 * c + 2] for c in range(3))
    assert_close(baked[key].delta(), by_hand)
    if bias:  # the bias adaptors travel as s * b: the mixed bias is pi @ (s b)
        assert_close(baked_bias[key], pi @ biases[key])
    install_adapter(model, "baked", baked, lora, biases=baked_bias)
    model.set_adapter("baked")
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert_close(plain, mixed, rtol=1e-4, atol=1e-5)


def probs_extras(probs: dict[str, list[float]]) -> dict[str, torch.Tensor]:
    return {f"router_probs.{k}": torch.tensor(v) for k, v in probs.items()}


def test_aggregation_weights_hand_computed():
    p = [0.25, 0.75]
    u = [
        ClientUpdate(0, 1, {}, extras=probs_extras({"m": [0.8, 0.2]})),
        ClientUpdate(1, 3, {}, extras=probs_extras({"m": [0.4, 0.6]})),
    ]
    w = adaptor_weights(u, p, "m")
    # adaptor 0: 0.25*0.8 = 0.2 vs 0.75*0.4 = 0.3 -> 0.4 / 0.6; adaptor 1: 0.05 vs 0.45 -> 0.1 / 0.9
    assert_close(w, torch.tensor([[0.4, 0.1], [0.6, 0.9]], dtype=torch.float64))
    a = [torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]  # C=2, r=1
    b = [torch.full((4, 2), 1.0), torch.full((4, 2), 2.0)]
    ups = [
        ClientUpdate(k, n, {"m": LoraFactors(a[k], b[k], 1.0)}, extras=u[k].extras)
        for k, n in ((0, 1), (1, 3))
    ]
    g = FLoRAL(num_adaptors=2).aggregate(ups, GlobalState()).state.factors["m"]
    assert_close(g.A[0], torch.full((3,), 0.4 * 1 + 0.6 * 2))
    assert_close(g.A[1], torch.full((3,), 0.1 * 1 + 0.9 * 2))
    assert_close(g.B[:, 1], torch.full((4,), 0.1 * 1 + 0.9 * 2))


def test_each_layer_is_weighted_by_its_own_router():
    """Per-layer routers: layer 0's adaptors follow layer 0's probabilities, layer 1's its own (not their
    mean).
    """
    probs = [
        {"layers.0.q": [0.9, 0.1], "layers.1.q": [0.1, 0.9]},
        {"layers.0.q": [0.1, 0.9], "layers.1.q": [0.9, 0.1]},
    ]
    a = [torch.full((2, 3), 1.0), torch.full((2, 3), 3.0)]
    ups = [
        ClientUpdate(
            k,
            1,
            {m: LoraFactors(a[k], torch.ones(4, 2), 1.0) for m in probs[k]},
            extras=probs_extras(probs[k]),
        )
        for k in range(2)
    ]
    g = FLoRAL(num_adaptors=2).aggregate(ups, GlobalState()).state.factors
    # equal p_k: layer 0, adaptor 0: weights 0.9 / 0.1 -> 0.9 * 1 + 0.1 * 3 = 1.2; layer 1, adaptor 0: 0.1 /
    # 0.9 -> 2.8
    assert_close(g["layers.0.q"].A[0], torch.full((3,), 1.2))
    assert_close(g["layers.1.q"].A[0], torch.full((3,), 2.8))


@pytest.mark.parametrize(("granularity", "routers"), [("client", 1), ("block", 3), ("module", 9)])
@pytest.mark.parametrize("server_temperature", [False, True])
def test_router_options_follow_the_reference(builtin_base, granularity, routers, server_temperature):
    """One router per client, block or target module; training noise U[0, 1) x noise by default (as the
    reference); the server gets softmax(logits) unless asked to apply the router's temperature too."""
    from transformers import AutoModelForCausalLM

    from fedllm.aggregation.floral_mixture import router_group

    lora = LoraConfig(ranks=[4], target_modules=["q_proj", "v_proj", "down_proj"])
    model = attach_lora(AutoModelForCausalLM.from_pretrained(builtin_base), [4], lora)
    opts = MixtureOptions(
        num_adaptors=2, temperature=0.5, granularity=granularity, server_temperature=server_temperature
    )
    assert opts.noise == 1.0 and opts.noise_dist == "uniform"
    session = MixtureSession(model, "r4", opts, None)
    try:
        assert len(session.logits) == routers
        key = "model.layers.1.self_attn.v_proj"
        group = router_group(key, granularity)
        assert group == {"client": "all", "block": "layer1", "module": key}[granularity]
        with torch.no_grad():
            session.logits[group].copy_(torch.tensor([1.0, -1.0]))
        probs = session.upload()[f"router_probs.{key}"]
        want = torch.softmax(torch.tensor([1.0, -1.0]) / (0.5 if server_temperature else 1.0), -1)
        assert_close(probs, want)
        torch.manual_seed(0)
        noisy = session.weights(group, training=True)
        torch.manual_seed(0)
        shift = torch.rand(2)  # the same draw: logits + U[0, 1)
        assert_close(noisy, torch.softmax((torch.tensor([1.0, -1.0]) + shift) / 0.5, -1))
        assert_close(session.weights(group, training=False), torch.softmax(torch.tensor([2.0, -2.0]), -1))
    finally:
        session.close()


def test_an_adaptor_nobody_uses_is_kept_not_nan():
    """Softmax underflow (logits [0, -200]) leaves adaptor 1 with no mass: it keeps its previous value."""
    pi = torch.softmax(torch.tensor([0.0, -200.0]), -1)
    assert pi[1] == 0
    before = GlobalState({"m": LoraFactors(torch.full((2, 3), 5.0), torch.full((4, 2), 7.0), 1.0)})
    ups = [
        ClientUpdate(
            k,
            n,
            {"m": LoraFactors(torch.full((2, 3), float(k)), torch.ones(4, 2), 1.0)},
            extras={"router_probs.m": pi},
        )
        for k, n in ((0, 3), (1, 5))
    ]
    res = FLoRAL(num_adaptors=2).aggregate(ups, before)
    g = res.state.factors["m"]
    assert torch.isfinite(g.A).all() and torch.isfinite(g.B).all()
    assert_close(g.A[1], torch.full((3,), 5.0)) and assert_close(g.B[:, 1], torch.full((4,), 7.0))
    assert_close(g.A[0], torch.full((3,), 5 / 8))  # adaptor 0: the p_k average (0 * 3 + 1 * 5) / 8
    assert res.info["unused_adaptors"] == 1


def test_one_adaptor_is_fedit():
    gen = torch.Generator().manual_seed(3)
    ups = [
        ClientUpdate(k, n, {"m": random_factors(4, 6, 5, 2.0, gen)}, extras={"router_probs.m": torch.ones(1)})
        for k, n in enumerate([3, 9, 4])
    ]
    a = FLoRAL(num_adaptors=1).aggregate(ups, GlobalState()).state.factors["m"]
    b = FedIT().aggregate(ups, GlobalState()).state.factors["m"]
    assert_close(a.A, b.A)
    assert_close(a.B, b.B)


def test_floral_needs_one_rank_and_refuses_perfedavg():
    with pytest.raises(ConfigError, match="floral mixes C adaptors of one rank"):
        load_config(None, ["aggregation.name=floral", "lora.ranks=[4,8]"])
    with pytest.raises(
        ConfigError,
        match="client.algorithm = perfedavg with aggregation.name = floral: the algorithm.s objective",
    ):
        load_config(None, ["aggregation.name=floral", "lora.ranks=[4]", "client.algorithm=perfedavg"])
    with pytest.raises(
        ConfigError,
        match="scaffold with aggregation.name = floral: the algorithm keeps its server state as sum_k",
    ):
        load_config(None, ["aggregation.name=floral", "lora.ranks=[4]", "client.algorithm=scaffold"])


def floral_run(tmp_path, *extra, hook=None):
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "r",
            "aggregation.name=floral",
            "lora.ranks=[4]",
            "aggregation.floral.num_adaptors=2",
            "data.client_test_fraction=0.3",
            "client.local_steps=3",
            *extra,
        ),
    )
    fed = faulty(Simulation)(cfg, tmp_path / "r", fault=hook)
    fed.setup()
    fed.run()
    return fed


@pytest.mark.parametrize("stateful", [True, False])
def test_routers_stay_local_and_follow_statefulness(tmp_path, monkeypatch, stateful):
    starts = []
    real_init = MixtureSession.__init__

    def spy(self, model, adapter, spec, router, biases=None):
        if model.training:
            starts.append(None if router is None else {k: v.clone() for k, v in router.items()})
        real_init(self, model, adapter, spec, router, biases)

    monkeypatch.setattr(MixtureSession, "__init__", spy)
    uploads = []
    fed = floral_run(
        tmp_path,
        f"aggregation.floral.stateful_routers={stateful}",
        hook=lambda r, k, u: uploads.append(u) or u,
    )
    modules = set(uploads[0].factors)
    for u in uploads:  # no router parameter travels: only the probabilities it gives each module
        assert set(u.extras) == {f"router_probs.{m}" for m in modules}
        assert all(t.shape == (2,) for t in u.extras.values())
    assert starts[:4] == [None] * 4  # round 1: no router yet
    if stateful:
        assert all(s is not None and not torch.equal(s["all"], torch.zeros(2)) for s in starts[4:8])
    else:
        assert starts[4:8] == [None] * 4
    for c in fed.clients:  # kept by the client, in its state file between rounds
        fed.store.load(c)
        assert "hook.all" in c.state
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert "personal_acc" in rows[-1] and "agg_router_mass" in rows[-1]


def floral_algorithms() -> list[str]:
    """The registered client algorithms the config layer lets FLoRAL run with."""
    out = []
    for a in sorted(ALGORITHMS):
        try:
            load_config(None, [f"client.algorithm={a}", "aggregation.name=floral", "lora.ranks=[4]"])
        except ConfigError:
            continue
        out.append(a)
    return out


@pytest.mark.parametrize("algorithm", floral_algorithms())
def test_nothing_router_shaped_is_uploaded_or_corrected_by_any_algorithm(tmp_path, algorithm):
    """The router is outside every algorithm: no control variate, no proximal pull, no upload, no
    state clash.
    """
    uploads = []
    fed = floral_run(
        tmp_path,
        f"client.algorithm={algorithm}",
        "client.fedprox.mu=10",
        hook=lambda r, k, u: uploads.append(u) or u,
    )
    for u in uploads:
        assert all(k.startswith(("router_probs.", "dc.")) for k in u.extras), sorted(u.extras)
        assert not any("router" in k.removeprefix("dc.") for k in u.extras if k.startswith("dc.")), sorted(
            u.extras
        )
        assert not any("router" in k for k in u.factors)
    for c in fed.clients:
        fed.store.load(c)
        router = c.state["hook.all"]
        assert router.shape == (2,) and not torch.equal(
            router, torch.zeros(2)
        )  # trained, and not overwritten
        assert not any(k.startswith(("algo.router", "pending.router")) for k in c.state)
    assert not any("router" in k for k in fed.server.algorithm.state_dict())


def assert_export_matches_mixture(fed, out, client_id: int) -> None:
    """Client ``client_id``'s exported personalized adapter gives the logits of its live router mixture."""
    from peft import AutoPeftModelForCausalLM

    exported = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    c = fed.clients[client_id]
    fed.store.load(c)  # its router, from its state file
    switch_in(fed, c, fed.start_round)
    fed.runtime.model.eval()
    ids = torch.tensor([[1, 11, 22, 33, 44]])
    with fed.runtime.view(c, fed.server.client_start(fed.start_round, c.client_id), "own"), torch.no_grad():
        mixed, theirs = fed.runtime.model(input_ids=ids).logits, exported(input_ids=ids).logits
    assert_close(theirs, mixed, rtol=1e-4, atol=1e-5)


def test_bias_adaptors_are_averaged_and_exported(tmp_path):
    from fedllm.run.artifacts import export_run

    uploads = []
    fed = floral_run(
        tmp_path,
        "aggregation.floral.bias_adaptors=true",
        "aggregation.floral.router_lr=0.5",
        hook=lambda r, k, u: uploads.append(u) or u,
    )
    biases = {k: v for k, v in fed.server.state.extras.items() if k.startswith("bias.")}
    modules = {k.removeprefix("bias.") for k in biases}
    assert modules == set(fed.server.state.factors) and all(v.shape[0] == 2 for v in biases.values())
    last = uploads[-4:]  # the last round's uploads: bias.<module> (C x out) beside the probabilities
    key = next(iter(modules))
    w = adaptor_weights(last, [u.num_examples / sum(x.num_examples for x in last) for u in last], key)
    by_hand = sum(w[k, :, None].float() * u.extras[f"bias.{key}"] for k, u in enumerate(last))
    assert_close(biases[f"bias.{key}"], by_hand, rtol=1e-5, atol=1e-7)
    assert float(by_hand.abs().sum()) > 0  # they trained
    out = export_run(tmp_path / "r", tmp_path / "c1", client=1)
    assert json.loads((out / "adapter_config.json").read_text())["lora_bias"] is True
    assert_export_matches_mixture(fed, out, 1)


def test_personalized_export_matches_mixture(tmp_path):
    from fedllm.run.artifacts import export_run

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "r",
            "aggregation.name=floral",
            "lora.ranks=[2]",
            "aggregation.floral.num_adaptors=3",
            "client.local_steps=3",
            "aggregation.floral.router_lr=0.5",
        ),
    )
    fed = Simulation(cfg, tmp_path / "r")
    fed.setup()
    fed.run()
    out = export_run(tmp_path / "r", tmp_path / "c2", client=2)
    assert_export_matches_mixture(fed, out, 2)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 6  # C * r


def test_lora_preconditioning_transforms_gradients(builtin_base):
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(ranks=[4], target_modules=["q_proj"])
    model = attach_lora(AutoModelForCausalLM.from_pretrained(builtin_base), [4], lora)
    gen = torch.Generator().manual_seed(0)
    write_factors(
        model,
        "r4",
        {
            k: LoraFactors(f.A, 0.3 * torch.randn(f.B.shape, generator=gen), f.scale)
            for k, f in fresh_factors(model, "r4", 2).items()
        },
    )
    ids = torch.tensor([[1, 30, 40, 50, 60, 7]])
    grads = {}
    for eps in (0.0, 0.1):
        opts = MixtureOptions(num_adaptors=2, precondition_eps=eps, noise=0.0)  # the same forward twice
        session = MixtureSession(model, "r4", opts, None)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        layer = next(iter(session.modules.values()))
        grads[eps] = (
            layer.lora_A["r4"].weight.grad.clone(),
            layer.lora_B["r4"].weight.grad.clone(),
            layer.lora_A["r4"].weight.detach().clone(),
            layer.lora_B["r4"].weight.detach().clone(),
        )
        session.close()
    ga, gb, a, b = grads[0.0]
    pa, pb, _, _ = grads[0.1]
    for c in range(2):
        rows = slice(2 * c, 2 * c + 2)
        bc, ac = b[:, rows], a[rows]
        assert_close(
            pa[rows], torch.linalg.solve(bc.T @ bc + 0.1 * torch.eye(2), ga[rows]), rtol=1e-4, atol=1e-6
        )
        assert_close(
            pb[:, rows],
            torch.linalg.solve(ac @ ac.T + 0.1 * torch.eye(2), gb[:, rows].T).T,
            rtol=1e-4,
            atol=1e-6,
        )


@pytest.mark.parametrize("router_optimizer", ["same", "sgd"])
def test_the_router_is_stepped_as_its_optimizer_option_says(router_optimizer):
    """``router_optimizer=sgd`` (the reference code's): each router step is exactly -router_lr x its gradient,
    unscheduled, while the adaptors take the client's AdamW steps; ``same``: the router is a group of that
    AdamW, scheduled with it."""
    from fedllm.client.base import LocalRun, LocalWork
    from fedllm.client.sft import SFT

    w = torch.nn.Parameter(torch.ones(3))
    router = torch.nn.Parameter(torch.zeros(4))
    work = LocalWork(round=1, client_id=0, steps=3, seed=0, lr=0.01, batch_size=1, scheduler="cosine",
                     local_params={"all": router}, local_lr=0.5,
                     local_optimizer=router_optimizer)  # fmt: skip
    run = LocalRun(SFT(), {"w": w}, work)
    grads = [torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.25, 0.0, -1.0, 3.0])]
    for g in grads:
        before = router.detach().clone()
        run.zero_grad()
        w.grad, router.grad = torch.ones(3), g.clone()
        run.step(0.0)
        if router_optimizer == "sgd":  # exact SGD at the full rate, step after step (no cosine decay)
            torch.testing.assert_close(router.detach(), before - 0.5 * g, rtol=0, atol=0)
        else:  # AdamW's first steps move every coordinate with a gradient by about lr, not lr x grad
            assert not torch.allclose(router.detach(), before - 0.5 * g)
    assert not torch.equal(w.detach(), torch.ones(3))  # the adaptors trained either way
    in_adamw = any(p is router for group in run.optimizer.param_groups for p in group["params"])
    assert in_adamw == (router_optimizer == "same")


def test_a_runs_routers_get_the_optimizer_its_config_names(tmp_path, monkeypatch):
    """aggregation.floral.router_optimizer reaches every client's local run (the session hands it on)."""
    from fedllm.client import base

    seen = []
    real = base.LocalRun.__init__

    def spy(self, algo, params, work, *args, **kwargs):
        real(self, algo, params, work, *args, **kwargs)
        seen.append((work.local_optimizer, work.local_lr, self.local_optimizer is not None))

    monkeypatch.setattr(base.LocalRun, "__init__", spy)
    floral_run(tmp_path, "aggregation.floral.router_optimizer=sgd", "aggregation.floral.router_lr=0.1")
    assert seen and set(seen) == {("sgd", 0.1, True)}
