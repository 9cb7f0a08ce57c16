"""Reading and writing LoRA factors from a peft model, and merging into the base."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from fedllm.config import LoraConfig
from fedllm.factors import LoraFactors, fresh_factors, read_factors, write_factors
from fedllm.model.modeling import adapter_name, attach_lora, install_adapter, merge_into_base


@pytest.fixture
def peft_model(builtin_base):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(builtin_base)
    return attach_lora(
        base, [4, 8], LoraConfig(ranks=[4, 8], alpha_ratio=2.0, target_modules=["q_proj", "v_proj"])
    )


def test_round_trip_and_copies(peft_model):
    name = adapter_name(8)
    factors = {
        k: LoraFactors(torch.randn_like(f.A), torch.randn_like(f.B), f.scale)
        for k, f in fresh_factors(peft_model, name, 0).items()
    }
    write_factors(peft_model, name, factors)
    back = read_factors(peft_model, name)
    assert set(back) == set(factors)
    for k in factors:
        assert_close(back[k].A, factors[k].A)
        assert_close(back[k].B, factors[k].B)
        assert back[k].scale == 2.0  # alpha / r = 2r / r
    # copies, not views: changing the model does not change what was read
    key = next(iter(back))
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    assert_close(back[key].A, factors[key].A)


def test_fresh_init_shares_leading_rows_across_ranks(peft_model):
    small, big = fresh_factors(peft_model, adapter_name(4), 5), fresh_factors(peft_model, adapter_name(8), 5)
    for k in small:
        assert_close(small[k].A, big[k].A[:4])
        assert not small[k].B.any()
    other = fresh_factors(peft_model, adapter_name(4), 6)
    assert not torch.equal(other[k].A, small[k].A)


def test_write_rescales_to_layer_scale(peft_model):
    name = adapter_name(4)
    ref = read_factors(peft_model, name)
    key = next(iter(ref))
    f = LoraFactors(torch.ones_like(ref[key].A), torch.ones_like(ref[key].B), 8.0)  # scale 8 vs layer scale 2
    write_factors(peft_model, name, {**ref, key: f})
    got = read_factors(peft_model, name)[key]
    assert_close(got.delta(), f.delta())


def test_write_rejects_bad_shapes_and_missing_modules(peft_model):
    name = adapter_name(4)
    ref = read_factors(peft_model, name)
    key = next(iter(ref))
    with pytest.raises(ValueError, match="do not fit adapter 'r4'"):
        write_factors(peft_model, name, {**ref, key: LoraFactors(torch.zeros(5, 3), torch.zeros(3, 5), 1.0)})
    with pytest.raises(KeyError, match="no factors for 1 LoRA module"):
        write_factors(peft_model, name, {k: v for k, v in ref.items() if k != key})


def test_merge_into_base_equals_adapter_forward(peft_model):
    name = adapter_name(8)
    gen = torch.Generator().manual_seed(3)
    factors = {
        k: LoraFactors(0.1 * torch.randn_like(f.A), 0.1 * torch.randn(f.B.shape, generator=gen), f.scale)
        for k, f in fresh_factors(peft_model, name, 3).items()
    }
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    install_adapter(peft_model, "probe", factors, LoraConfig(target_modules=["q_proj", "v_proj"]))
    peft_model.set_adapter("probe")
    with torch.no_grad():
        with_adapter = peft_model(input_ids=ids).logits
        merge_into_base(peft_model, factors)
        with peft_model.disable_adapter():
            merged = peft_model(input_ids=ids).logits
    assert_close(merged, with_adapter, rtol=1e-4, atol=1e-5)
