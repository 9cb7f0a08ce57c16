"""The training step's arithmetic: the response-token loss with the vocabulary head applied only at label
positions equals the causal LM's own loss and gradients, projects far fewer positions, and falls back where a
model cannot keep logits; mixed precision comes from the config and refuses a conflicting launch."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from data_prep import builtin_skills
from data_prep.prompts import collate, tokenize_examples
from fedllm.config import ModelConfig
from fedllm.model.loss import keeps_logits, response_loss
from fedllm.model.modeling import load_base
from tests.conftest import TEST_PRETRAIN_STEPS


def _lora_model_and_batch():
    model, tok = load_base(ModelConfig(name="builtin", builtin_pretrain_steps=TEST_PRETRAIN_STEPS), "cpu")
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a trained adapter, not peft's zero B: the gradient reaches A too
            torch.nn.init.normal_(p, std=0.05)
    examples = builtin_skills.instruction_examples(2, seed=3)[:6]
    data = tokenize_examples(examples, tok, "plain", 64)
    batch = collate(data, tok.pad_token_id)
    ends = (batch["labels"] != -100).int().cumsum(1).argmax(1)
    assert len(set(ends.tolist())) > 1  # responses end at different columns: the union is exercised
    return model, batch


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_response_loss_equals_the_models_own_loss_and_gradients():
    model, batch = _lora_model_and_batch()
    assert keeps_logits(model)
    full = model(**batch).loss
    full.backward()
    want = _grads(model)
    model.zero_grad()
    rows = []
    hook = model.get_base_model().lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape))
    mine = response_loss(model, batch)
    hook.remove()
    mine.backward()
    got = _grads(model)
    torch.testing.assert_close(mine, full, rtol=1e-6, atol=1e-6)
    assert set(got) == set(want) and len(got) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    # the head saw only the label positions' union, not every position of the batch
    kept = rows[0][1]
    width = batch["input_ids"].shape[1]
    assert kept < width - 1
    assert kept == int((batch["labels"][:, 1:] != -100).any(0).sum())


def test_a_model_without_logits_to_keep_gets_its_own_loss():
    class OldModel(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, labels=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    model, batch = _lora_model_and_batch()
    old = OldModel(model.get_base_model())
    assert not keeps_logits(old)
    with torch.no_grad():
        torch.testing.assert_close(response_loss(old, batch), model(**batch).loss)


def test_mixed_precision_from_the_config_and_its_conflicts(monkeypatch, caplog):
    """model.mixed_precision sets accelerate's; a launch that asks for another is refused; a CPU without
    bf16 instructions gets a warning, one with them none."""
    from types import SimpleNamespace

    from fedllm.config import ConfigError, load_config
    from fedllm.model import precision

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert precision.accelerator_kwargs(load_config(None, ["model.mixed_precision=bf16"])) == {
        "mixed_precision": "bf16"
    }
    assert precision.accelerator_kwargs(load_config(None, ["model.mixed_precision=none"])) == {
        "mixed_precision": "no"
    }
    assert precision.accelerator_kwargs(load_config(None, [])) == {}  # the launch decides
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ConfigError, match="model.mixed_precision = bf16 but the launch asks for fp16"):
        precision.accelerator_kwargs(load_config(None, ["model.mixed_precision=bf16"]))
    acc = SimpleNamespace(mixed_precision="bf16", device=torch.device("cpu"))
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    precision.warn_where_emulated(acc)
    assert "without AVX-512 BF16 or AMX" in caplog.text
    caplog.clear()
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    precision.warn_where_emulated(acc)
    assert caplog.text == ""


@pytest.mark.parametrize("native", [True, False], ids=["cpu-with-bf16", "cpu-without-bf16"])
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it(
    monkeypatch, caplog, tmp_path, builtin_base, native, request
):
    """model.mixed_precision=auto: bf16 autocast on a CPU with AVX-512 BF16 or AMX, float32 on one without
    (where bf16 is emulated, about 35x slower); said once in the log, and the run's config.yaml records the
    value used, so a comparison never mixes the two. An explicit bf16 stays bf16, with its warning."""
    import logging

    from accelerate.state import AcceleratorState

    from fedllm.config import load_config
    from fedllm.model import precision
    from fedllm.run.reader import RunFolder
    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: False)
    caplog.set_level(logging.INFO)
    want = "bf16" if native else "none"
    over = ["model.mixed_precision=auto", "federation.rounds=1", "eval.personalized=false"]
    cfg = load_config(None, tiny_overrides(tmp_path / "r", *over, "client.local_steps=2"))
    AcceleratorState._reset_state(True)  # accelerate keeps one mixed precision per process
    request.addfinalizer(lambda: AcceleratorState._reset_state(True))
    sim = Simulation(cfg, tmp_path / "r")
    assert str(sim.acc.mixed_precision) == ("bf16" if native else "no")
    sim.setup()
    sim.run()
    assert RunFolder(tmp_path / "r").config().model.mixed_precision == want
    said = [r.getMessage() for r in caplog.records if "mixed_precision = auto" in r.getMessage()]
    assert len(said) == 1 and ("bf16 autocast" if native else "float32") in said[0]
    assert not any("emulates bfloat16" in r.getMessage() for r in caplog.records)
    caplog.clear()
    explicit = load_config(None, ["model.mixed_precision=bf16"])
    assert precision.accelerator_kwargs(explicit) == {"mixed_precision": "bf16"}


def test_a_router_loss_or_a_ddp_wrapper_is_seen():
    """A mixture-of-experts model whose .loss adds its router's auxiliary loss keeps the full forward (the
    shortcut would drop that term); DistributedDataParallel's wrapper is looked through."""
    model, _ = _lora_model_and_batch()

    class Wrapper(torch.nn.Module):  # what DDP looks like from outside: .module holds the model
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    assert keeps_logits(Wrapper(model))
    model.get_base_model().config.output_router_logits = True
    assert not keeps_logits(model) and not keeps_logits(Wrapper(model))
