"""4-bit and 8-bit bases (bitsandbytes on CPU) and QLoRA rounds, incl. the frozen residual path."""

from __future__ import annotations

import json

import pytest
import torch

from fedllm.config import load_config
from fedllm.factors import lora_modules
from fedllm.federation import Federation
from fedllm.modeling import RESIDUAL, ModelError, is_quantized, load_base, merge_into_base
from tests.conftest import tiny_overrides

pytest.importorskip("bitsandbytes")


def federation(tmp_path, *extra):
    cfg = load_config(None, tiny_overrides(tmp_path, "eval.personalized=false", *extra))
    fed = Federation(cfg, tmp_path)
    fed.setup()
    return fed


@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_quantized_base_loads_and_stays_close(mode, builtin_base):
    cfg = load_config(None, tiny_overrides("unused", f"model.quantization={mode}")).model
    model, tok = load_base(cfg)
    assert is_quantized(model)
    linear = model.model.layers[0].self_attn.q_proj
    assert type(linear).__name__ == ("Linear4bit" if mode == "4bit" else "Linear8bitLt")
    if mode == "4bit":
        q = linear.weight.quant_state
        assert linear.weight.quant_type == "nf4" and q.nested  # NF4 with double quantization
    cfg.quantization = "none"
    full, _ = load_base(cfg)
    ids = tok("Question: which is larger , 7 or 3 ?\nAnswer:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, full(input_ids=ids).logits
    assert torch.isfinite(a).all()
    # quantization error is real but small: same next-token distribution up to a few percent
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98


def test_merge_into_quantized_base_is_refused(tmp_path, builtin_base):
    fed = federation(tmp_path / "r", "model.quantization=4bit")
    with pytest.raises(ModelError, match="quantized"):
        merge_into_base(fed.model, {})


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_qlora_round_learns_like_full_precision(tmp_path, mode, builtin_base):
    extra = ("aggregation.name=fedit", "federation.rounds=1", "client.local_steps=10")
    full = federation(tmp_path / "full", *extra).run()
    fed = federation(tmp_path / "q", f"model.quantization={mode}", *extra)
    summary = fed.run()
    assert summary["loss_after"] < summary["loss_before"] - 0.01  # it learns
    assert summary["loss_after"] == pytest.approx(full["loss_after"], rel=0.02)  # about as well as float32
    assert "residual_adapter_rank" not in summary  # fedit does not merge: nothing to keep aside
    assert (tmp_path / "q" / "global_adapter" / "adapter_model.safetensors").exists()
    frozen = [p for n, p in fed.model.named_parameters()
              if "lora_" not in n and "embed_tokens" not in n and "lm_head" not in n]
    assert frozen and not any(p.requires_grad for p in frozen)


def test_flora_on_4bit_keeps_merged_update_as_frozen_residual(tmp_path, builtin_base):
    fed = federation(tmp_path / "r", "model.quantization=4bit", "aggregation.name=flora", "federation.rounds=1",
                     "lora.trainable_modules=[]", "lora.ranks=[2,4]")
    before = {k: v.clone() for k, v in fed.model.state_dict().items() if "lora_" not in k}
    summary = fed.run()
    assert summary["quantization"] == "4bit" and summary["residual_adapter_rank"] == 2 + 4 + 2 + 4
    assert "frozen residual adapter" in summary["note"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["residual_adapter_rank"] == 12
    after = fed.model.state_dict()
    for k, v in before.items():  # the quantized weights were never rewritten
        assert torch.equal(after[k], v), k

    # the residual adapter is exactly the FLoRA update sum_k p_k s_k B_k A_k, and frozen under a client's adapter
    key = "model.layers.1.mlp.down_proj"
    res = fed.state.residual[key]
    module = lora_modules(fed.model, RESIDUAL)[key]
    got = module.lora_B[RESIDUAL].weight @ module.lora_A[RESIDUAL].weight * module.scaling[RESIDUAL]
    torch.testing.assert_close(got, res.delta(), rtol=1e-5, atol=1e-7)
    params, _, _ = fed.load_client(fed.clients[0], 2)
    assert fed.model.active_adapters == ["r2", RESIDUAL]
    assert not any(p.requires_grad for n, p in fed.model.named_parameters() if f".{RESIDUAL}." in n)
    assert all(p.requires_grad for p in params.values())

    # the residual layer computes base(x) + x @ delta^T
    x = torch.randn(3, module.in_features)
    with torch.no_grad(), fed.model.disable_adapter():
        plain = module(x)
    fed.install_global()
    with torch.no_grad():
        torch.testing.assert_close(module(x), plain + x @ res.delta().T, rtol=1e-4, atol=1e-5)


def test_residual_survives_resume(tmp_path, builtin_base):
    fed = federation(tmp_path / "r", "model.quantization=4bit", "aggregation.name=florist", "federation.rounds=1",
                     "lora.trainable_modules=[]", "lora.ranks=[2,4]")
    fed.run()
    fed.install_global()
    loss, _ = fed.heldout(fed.eval_data)
    again = federation(tmp_path / "r", "model.quantization=4bit", "aggregation.name=florist", "federation.rounds=1",
                       "lora.trainable_modules=[]", "lora.ranks=[2,4]")
    again.restore()
    assert again.start_round == 2 and RESIDUAL in again.model.peft_config
    again.install_global()
    assert again.heldout(again.eval_data)[0] == pytest.approx(loss, rel=1e-5)
