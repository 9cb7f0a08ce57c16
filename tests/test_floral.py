"""FLoRAL: mixture forward, aggregation weights, routers, uploads, personalized export."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import ClientUpdate, GlobalState
from fedllm.aggregation.fedit import FedIT
from fedllm.aggregation.floral import FLoRAL, adaptor_weights
from fedllm.config import ConfigError, LoraConfig, load_config
from fedllm.factors import LoraFactors, fresh_factors, read_factors, write_factors
from fedllm.federation import Federation
from fedllm.mixture import MixtureSession, MixtureSpec
from fedllm.modeling import attach_lora, install_adapter
from tests.conftest import random_factors, tiny_overrides


def test_mixture_forward_equals_stacked_lora(builtin_base):
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(ranks=[6], target_modules=["q_proj", "v_proj", "down_proj"])
    model = attach_lora(AutoModelForCausalLM.from_pretrained(builtin_base), [6], lora).eval()
    gen = torch.Generator().manual_seed(0)
    factors = {k: LoraFactors(f.A, 0.2 * torch.randn(f.B.shape, generator=gen), f.scale)
               for k, f in fresh_factors(model, "r6", 1).items()}
    write_factors(model, "r6", factors)
    spec = MixtureSpec(num_adaptors=3, rank=2, temperature=0.7, per_layer=True)
    router = {g: torch.randn(3, generator=gen) for g in ("layer0", "layer1", "layer2")}
    ids = torch.tensor([[1, 30, 40, 50, 60, 7]])
    session = MixtureSession(model, "r6", spec, router)
    with torch.no_grad():
        mixed = model(input_ids=ids).logits
        # by hand for one module: sum_c pi_c s B_c A_c equals the baked LoRA
        baked = session.bake(read_factors(model, "r6"))
    session.close()
    key = next(iter(factors))
    pi = torch.softmax(router["layer0"] / 0.7, -1)
    f = factors[key]
    by_hand = sum(pi[c] * f.scale * f.B[:, 2 * c:2 * c + 2] @ f.A[2 * c:2 * c + 2] for c in range(3))
    assert_close(baked[key].delta(), by_hand)
    install_adapter(model, "baked", baked, lora)
    model.set_adapter("baked")
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert_close(plain, mixed, rtol=1e-4, atol=1e-5)


def test_aggregation_weights_hand_computed():
    p = [0.25, 0.75]
    u = [ClientUpdate(0, 1, {}, extras={"router_probs": torch.tensor([0.8, 0.2])}),
         ClientUpdate(1, 3, {}, extras={"router_probs": torch.tensor([0.4, 0.6])})]
    w = adaptor_weights(u, p, 2)
    # adaptor 0: 0.25*0.8 = 0.2 vs 0.75*0.4 = 0.3 -> 0.4 / 0.6; adaptor 1: 0.05 vs 0.45 -> 0.1 / 0.9
    assert_close(w, torch.tensor([[0.4, 0.1], [0.6, 0.9]], dtype=torch.float64))
    # and the adaptors follow those weights
    a = [torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]  # C=2, r=1
    b = [torch.full((4, 2), 1.0), torch.full((4, 2), 2.0)]
    ups = [ClientUpdate(k, n, {"m": LoraFactors(a[k], b[k], 1.0)}, extras=u[k].extras) for k, n in ((0, 1), (1, 3))]
    g = FLoRAL(num_adaptors=2).aggregate(ups, GlobalState()).state.factors["m"]
    assert_close(g.A[0], torch.full((3,), 0.4 * 1 + 0.6 * 2))
    assert_close(g.A[1], torch.full((3,), 0.1 * 1 + 0.9 * 2))
    assert_close(g.B[:, 1], torch.full((4,), 0.1 * 1 + 0.9 * 2))


def test_one_adaptor_is_fedit():
    gen = torch.Generator().manual_seed(3)
    ups = [ClientUpdate(k, n, {"m": random_factors(4, 6, 5, 2.0, gen)}, extras={"router_probs": torch.ones(1)})
           for k, n in enumerate([3, 9, 4])]
    a = FLoRAL(num_adaptors=1).aggregate(ups, GlobalState()).state.factors["m"]
    b = FedIT().aggregate(ups, GlobalState()).state.factors["m"]
    assert_close(a.A, b.A)
    assert_close(a.B, b.B)


def test_floral_needs_one_rank():
    with pytest.raises(ConfigError, match="floral mixes C adaptors of one rank"):
        load_config(None, ["aggregation.name=floral", "lora.ranks=[4,8]"])


@pytest.mark.parametrize("stateful", [True, False])
def test_routers_stay_local_and_follow_statefulness(tmp_path, monkeypatch, stateful):
    starts = []
    real_init = MixtureSession.__init__

    def spy(self, model, adapter, spec, router):
        if model.training:
            starts.append(None if router is None else {k: v.clone() for k, v in router.items()})
        real_init(self, model, adapter, spec, router)

    monkeypatch.setattr(MixtureSession, "__init__", spy)
    uploads = []

    def hook(r, k, u):
        uploads.append(u)
        return u

    cfg = load_config(None, tiny_overrides(tmp_path / "r", "aggregation.name=floral", "lora.ranks=[4]",
                                           "aggregation.num_adaptors=2", f"aggregation.stateful_routers={stateful}",
                                           "data.client_test_fraction=0.3", "client.local_steps=3"))
    fed = Federation(cfg, tmp_path / "r", client_hook=hook)
    fed.setup()
    fed.run()
    for u in uploads:  # no router parameter travels: only its probabilities
        assert set(u.extras) == {"router_probs"}
        assert not any("router" in k for k in u.factors) and u.extras["router_probs"].shape == (2,)
    assert starts[:4] == [None] * 4  # round 1: no router yet
    if stateful:
        assert all(s is not None and not torch.equal(s["all"], torch.zeros(2)) for s in starts[4:8])
    else:
        assert starts[4:8] == [None] * 4
    assert all("router.all" in c.state for c in fed.clients)  # kept by the client (and the checkpoint)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert "personal_acc" in rows[-1] and "agg_router_mass" in rows[-1]


def test_personalized_export_matches_mixture(tmp_path):
    from peft import AutoPeftModelForCausalLM

    from fedllm.export import export_run

    cfg = load_config(None, tiny_overrides(tmp_path / "r", "aggregation.name=floral", "lora.ranks=[2]",
                                           "aggregation.num_adaptors=3", "client.local_steps=3",
                                           "aggregation.router_lr=0.5"))
    fed = Federation(cfg, tmp_path / "r")
    fed.setup()
    fed.run()
    out = export_run(tmp_path / "r", tmp_path / "c2", client=2)
    exported = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    c = fed.clients[2]
    fed.load_client(c, fed.start_round)
    fed.model.eval()
    session = fed.open_mixture(c, own_router=True)
    ids = torch.tensor([[1, 11, 22, 33, 44]])
    with torch.no_grad():
        mixed = fed.model(input_ids=ids).logits
        theirs = exported(input_ids=ids).logits
    session.close()
    assert_close(theirs, mixed, rtol=1e-4, atol=1e-5)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 6  # C * r


def test_lora_preconditioning_transforms_gradients(builtin_base):
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(ranks=[4], target_modules=["q_proj"])
    model = attach_lora(AutoModelForCausalLM.from_pretrained(builtin_base), [4], lora)
    gen = torch.Generator().manual_seed(0)
    write_factors(model, "r4", {k: LoraFactors(f.A, 0.3 * torch.randn(f.B.shape, generator=gen), f.scale)
                                for k, f in fresh_factors(model, "r4", 2).items()})
    ids = torch.tensor([[1, 30, 40, 50, 60, 7]])
    grads = {}
    for eps in (0.0, 0.1):
        session = MixtureSession(model, "r4", MixtureSpec(num_adaptors=2, rank=2, precondition_eps=eps), None)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        layer = next(iter(session.modules.values()))
        grads[eps] = (layer.lora_A["r4"].weight.grad.clone(), layer.lora_B["r4"].weight.grad.clone(),
                      layer.lora_A["r4"].weight.detach().clone(), layer.lora_B["r4"].weight.detach().clone())
        session.close()
    ga, gb, a, b = grads[0.0]
    pa, pb, _, _ = grads[0.1]
    for c in range(2):
        rows = slice(2 * c, 2 * c + 2)
        bc, ac = b[:, rows], a[rows]
        assert_close(pa[rows], torch.linalg.solve(bc.T @ bc + 0.1 * torch.eye(2), ga[rows]), rtol=1e-4, atol=1e-6)
        assert_close(pb[:, rows], torch.linalg.solve(ac @ ac.T + 0.1 * torch.eye(2), gb[:, rows].T).T,
                     rtol=1e-4, atol=1e-6)
