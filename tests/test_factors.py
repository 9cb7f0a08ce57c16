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
    _, with_adapter, merged = adapter_then_merged(peft_model, factors, ["q_proj", "v_proj"], ids)
    assert_close(merged, with_adapter, rtol=1e-4, atol=1e-5)


def adapter_then_merged(model, factors, targets: list[str], ids: torch.Tensor):
    """The logits of the base, of the base with ``factors`` as an adapter, and of the base with them merged
    in (the adapter disabled): the reference path (peft's adapter forward) beside the path under test."""
    install_adapter(model, "probe", factors, LoraConfig(ranks=[8], target_modules=targets))
    model.set_adapter("probe")
    with torch.no_grad():
        with model.disable_adapter():
            before = model(input_ids=ids).logits
        with_adapter = model(input_ids=ids).logits
        merge_into_base(model, factors)
        with model.disable_adapter():
            merged = model(input_ids=ids).logits
    return before, with_adapter, merged


@pytest.mark.real
@pytest.mark.slow  # loads Gemma 3 270M in float32 (about 20 s)
def test_merge_into_base_equals_adapter_forward_on_gemma3():
    """On Gemma 3 (fedllm prepare-real --gemma3), whose layers differ from Llama's (sliding-window
    attention, q/k norms, a scaled embedding), merging an adapter on all 7 projections into the base
    computes what the adapter does: FLoRA and FLoRIST merge every round, so an inexact merge on this
    architecture would show up as their rows alone falling behind in Gemma's table."""
    from transformers import AutoModelForCausalLM

    from fedllm.model.gguf import GGUFError, ensure_checkpoint

    try:
        folder = ensure_checkpoint("gguf:gemma3-270m")
    except GGUFError as e:
        pytest.skip(f"Gemma 3 is not prepared ({e})")
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = attach_lora(base, [8], LoraConfig(ranks=[8], alpha_ratio=2.0, target_modules=projections))
    gen = torch.Generator().manual_seed(5)

    def noise(shape: torch.Size) -> torch.Tensor:
        return 0.02 * torch.randn(shape, generator=gen)

    factors = {
        k: LoraFactors(noise(f.A.shape), noise(f.B.shape), f.scale)
        for k, f in fresh_factors(model, adapter_name(8), 1).items()
    }
    assert len(factors) == 7 * base.config.num_hidden_layers
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563, 9405, 236761]])
    before, with_adapter, merged = adapter_then_merged(model, factors, projections, ids)
    assert (with_adapter - before).abs().max() > 1e-2  # the adapter changes the output: the check has teeth
    assert_close(merged, with_adapter, rtol=1e-4, atol=1e-4)
