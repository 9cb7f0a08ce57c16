"""4-bit and 8-bit bases (bitsandbytes on CPU) and QLoRA rounds, incl. the frozen residual path.

bitsandbytes has two CPU 4-bit kernels: dequantize-then-matmul (every CPU) and
a packed AVX512-BF16 inference kernel (only on CPUs with AVX512-BF16, chosen
on the first inference forward). Every 4-bit test runs with both, so the suite
says the same on every machine; the packed variant skips, with its reason,
where the CPU cannot run it.
"""

from __future__ import annotations

import json

import pytest
import torch

from fedllm.config import load_config
from fedllm.factors import lora_modules
from fedllm.model.modeling import (
    RESIDUAL,
    ModelError,
    is_quantized,
    load_base,
    merge_into_base,
    packed_kernel_problems,
    restore_dequant_layers,
    select_cpu_4bit_kernel,
)
from fedllm.simulation import Simulation
from tests.conftest import TEST_PRETRAIN_STEPS, heldout_of, install_global, switch_in, tiny_overrides

pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import has_avx512bf16

PACKED_OK = bool(has_avx512bf16())
NO_PACKED = pytest.mark.skipif(not PACKED_OK, reason="the packed kernel needs a CPU with AVX512-BF16")
KERNELS = ["dequant", pytest.param("packed", marks=NO_PACKED)]


def federation(tmp_path, *extra):
    cfg = load_config(None, tiny_overrides(tmp_path, "eval.personalized=false", *extra))
    fed = Simulation(cfg, tmp_path)
    fed.setup()
    return fed


def packed_layers(model) -> int:
    """Linear4bit layers currently in bitsandbytes' packed AVX512-BF16 format."""
    return sum(
        bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False))
        for m in model.modules()
        if type(m).__name__ == "Linear4bit"
    )


@pytest.mark.parametrize(
    ("mode", "kernel"),
    [("4bit", "dequant"), pytest.param("4bit", "packed", marks=NO_PACKED), ("8bit", "dequant")],
)
def test_quantized_base_loads_and_stays_close(mode, kernel, builtin_base):
    cfg = load_config(
        None, tiny_overrides("unused", f"model.quantization={mode}", f"model.quant_cpu_kernel={kernel}")
    ).model
    model, tok = load_base(cfg)
    assert is_quantized(model)
    linear = model.model.layers[0].self_attn.q_proj
    assert type(linear).__name__ == ("Linear4bit" if mode == "4bit" else "Linear8bitLt")
    if mode == "4bit":
        q = linear.weight.quant_state
        assert linear.weight.quant_type == "nf4" and q.nested  # NF4 with double quantization
        assert model.fedllm_cpu_4bit_kernel == kernel
    cfg.quantization = "none"
    full, _ = load_base(cfg)
    ids = tok("Is 7 below or above 50 ?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, full(input_ids=ids).logits
    assert torch.isfinite(a).all()
    if mode == "4bit":  # the kernel really used: packed layers only with the packed kernel
        assert (packed_layers(model) > 0) == (kernel == "packed")
    # quantization error is real but small: same next-token distribution up to a few percent
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98


def test_layer_shapes_the_packed_kernel_cannot_take_are_named(builtin_base, tmp_path):
    """A 4-bit layer of 168 outputs (not a multiple of 32) is refused before any forward, naming the layer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(builtin_base)
    odd = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=168,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    )
    odd.save_pretrained(tmp_path / "odd")
    tok.save_pretrained(tmp_path / "odd")
    from fedllm.model.modeling import quantization_config

    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "odd",
        quantization_config=quantization_config("4bit", torch.float32),
        device_map={"": "cpu"},
    )
    problems = packed_kernel_problems(model)
    # gate_proj and up_proj are 168 x 64 (168 % 32 != 0), down_proj 64 x 168 (168 % 64 != 0); attention is
    # fine
    assert [p.split(" ")[0] for p in problems] == [
        f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")
    ]
    assert "model.layers.0.mlp.gate_proj (168 x 64, out x in): needs out_features % 32 == 0" in problems[0]
    if PACKED_OK:
        with pytest.raises(ModelError, match=r"cannot take .*model.layers.0.mlp.gate_proj \(168 x 64"):
            select_cpu_4bit_kernel(model, "packed")
    else:
        with pytest.raises(ModelError, match="needs a CPU with AVX512-BF16"):
            select_cpu_4bit_kernel(model, "packed")
    assert select_cpu_4bit_kernel(model, "dequant") == "dequant"  # always possible


@pytest.mark.parametrize("kernel", KERNELS)
def test_training_after_an_evaluation_gets_full_gradients(tmp_path, kernel, builtin_base):
    """An evaluation packs the layers (packed kernel); training must unpack them, or no gradient crosses the
    base.
    """
    fed = federation(
        tmp_path / "r",
        "model.quantization=4bit",
        f"model.quant_cpu_kernel={kernel}",
        "lora.trainable_modules=[]",
    )
    fed.evaluate(0)  # inference forwards: bitsandbytes packs here with the packed kernel
    assert (packed_layers(fed.runtime.model) > 0) == (kernel == "packed")
    params, _ = switch_in(fed, fed.clients[0], 1)
    assert packed_layers(fed.runtime.model) == 0
    with torch.no_grad():  # non-zero B so that A gets gradients too
        for k, p in params.items():
            if k.endswith(".B"):
                p.normal_(0, 0.02)
    fed.runtime.model.train()
    from fedllm.client.base import batch_stream

    batch = next(batch_stream(fed.clients[0].train, 4, fed.runtime.tokenizer.pad_token_id, 0))
    fed.runtime.model(**batch).loss.backward()
    first = next(k for k in params if "layers.0." in k and k.endswith("q_proj.A"))
    assert params[first].grad is not None and float(params[first].grad.norm()) > 0


def test_merge_into_quantized_base_is_refused(tmp_path, builtin_base):
    fed = federation(tmp_path / "r", "model.quantization=4bit", "model.quant_cpu_kernel=dequant")
    with pytest.raises(ModelError, match="quantized"):
        merge_into_base(fed.runtime.model, {})


@pytest.mark.parametrize(
    ("mode", "kernel"),
    [("8bit", "dequant"), ("4bit", "dequant"), pytest.param("4bit", "packed", marks=NO_PACKED)],
)
def test_qlora_round_learns_like_full_precision(tmp_path, mode, kernel, builtin_base):
    extra = ("aggregation.name=fedit", "federation.rounds=1", "client.local_steps=10")
    full = federation(tmp_path / "full", *extra).run()
    fed = federation(tmp_path / "q", f"model.quantization={mode}", f"model.quant_cpu_kernel={kernel}", *extra)
    summary = fed.run()
    assert summary["loss_after"] < summary["loss_before"] - 0.01  # it learns
    assert summary["loss_after"] == pytest.approx(full["loss_after"], rel=0.03)  # about as well as float32
    assert "residual_adapter_rank" not in summary  # fedit does not merge: nothing to keep aside
    assert summary["quantization"] == mode
    assert summary.get("quant_cpu_kernel") == (kernel if mode == "4bit" else None)
    assert (tmp_path / "q" / "global_adapter" / "adapter_model.safetensors").exists()
    frozen = [
        p
        for n, p in fed.runtime.model.named_parameters()
        if "lora_" not in n and "embed_tokens" not in n and "lm_head" not in n
    ]
    assert frozen and not any(p.requires_grad for p in frozen)


@pytest.mark.parametrize("kernel", KERNELS)
def test_flora_on_4bit_keeps_merged_update_as_frozen_residual(tmp_path, kernel, builtin_base):
    fed = federation(
        tmp_path / "r",
        "model.quantization=4bit",
        f"model.quant_cpu_kernel={kernel}",
        "aggregation.name=flora",
        "federation.rounds=1",
        "lora.trainable_modules=[]",
        "lora.ranks=[2,4]",
    )
    before = {k: v.clone() for k, v in fed.runtime.model.state_dict().items() if "lora_" not in k}
    summary = fed.run()
    assert summary["quantization"] == "4bit" and summary["residual_adapter_rank"] == 2 + 4 + 2 + 4
    assert "frozen residual adapter" in summary["note"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["residual_adapter_rank"] == 12
    restore_dequant_layers(
        fed.runtime.model
    )  # as before training: state_dict() of a packed layer re-quantizes
    after = fed.runtime.model.state_dict()
    for k, v in before.items():  # the quantized weights were never rewritten
        assert torch.equal(after[k], v), k

    # the residual adapter is exactly the FLoRA update sum_k p_k s_k B_k A_k, and frozen under a client's
    # adapter
    key = "model.layers.1.mlp.down_proj"
    res = fed.server.state.residual[key]
    module = lora_modules(fed.runtime.model, RESIDUAL)[key]
    got = module.lora_B[RESIDUAL].weight @ module.lora_A[RESIDUAL].weight * module.scaling[RESIDUAL]
    torch.testing.assert_close(got, res.delta(), rtol=1e-5, atol=1e-7)
    params, _ = switch_in(fed, fed.clients[0], 2)
    assert fed.runtime.model.active_adapters == ["r2", RESIDUAL]
    assert not any(p.requires_grad for n, p in fed.runtime.model.named_parameters() if f".{RESIDUAL}." in n)
    assert all(p.requires_grad for p in params.values())

    # the residual layer computes base(x) + x @ delta^T
    x = torch.randn(3, module.in_features)
    with torch.no_grad(), fed.runtime.model.disable_adapter():
        plain = module(x)
    install_global(fed)
    with torch.no_grad():
        torch.testing.assert_close(module(x), plain + x @ res.delta().T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_residual_survives_resume(tmp_path, kernel, builtin_base):
    extra = (
        "model.quantization=4bit",
        f"model.quant_cpu_kernel={kernel}",
        "aggregation.name=florist",
        "federation.rounds=1",
        "lora.trainable_modules=[]",
        "lora.ranks=[2,4]",
    )
    fed = federation(tmp_path / "r", *extra)
    fed.run()
    install_global(fed)
    loss, _ = heldout_of(fed, fed.eval_data)
    again = federation(tmp_path / "r", *extra)
    again.restore()
    assert again.start_round == 2 and RESIDUAL in again.runtime.model.peft_config
    install_global(again)
    assert heldout_of(again, again.eval_data)[0] == pytest.approx(loss, rel=1e-5)


PROBE = """
import sys, torch
from fedllm.model.modeling import ModelError, lora_without_bitsandbytes, quantization_config
passed_over = {skip} and lora_without_bitsandbytes()
from peft import LoraConfig, get_peft_model
get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"]))
try:
    quantization_config("4bit", torch.float32)
    refused = False
except ModelError as e:
    refused = "process of its own" in str(e)
print(passed_over, "bitsandbytes" in sys.modules, refused)
"""


@pytest.mark.parametrize("skip", [True, False])
def test_a_float_bases_process_builds_lora_without_importing_bitsandbytes(skip):
    """peft imports bitsandbytes (1.5 s of start-up: its backend imports torch's inductor) on its first LoRA
    layer wherever it is installed; a process that passes over it builds the same layers without importing
    it, and then refuses a quantized base rather than give it no LoRA layers. Without the call (the control)
    the same LoRA layer imports it, so the first arm shows the call doing it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PROBE.format(skip=skip)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1].split()
    assert last == (["True", "False", "True"] if skip else ["False", "True", "False"])


CLI_PROBE = """
import runpy, sys
sys.argv = ["fedllm", "--log-level", "DEBUG", "run", *{argv!r}]
try:
    runpy.run_module("fedllm.cli", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("bitsandbytes imported:", "bitsandbytes" in sys.modules)
"""


def test_the_command_line_run_of_a_float_base_never_imports_bitsandbytes(tmp_path, builtin_base):
    """``fedllm run`` as a program (the console script, ``python -m fedllm.cli``, what ``fedllm compare``
    starts) on a float base: its whole run, LoRA layers, rounds and save, without bitsandbytes."""
    import subprocess
    import sys

    run = tmp_path / "run"
    over = tiny_overrides(run, "federation.rounds=1", "eval.benchmark=none", "eval.personalized=false")
    code = CLI_PROBE.format(argv=["--output-dir", str(run), *over])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "peft passes over bitsandbytes in this process" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == "bitsandbytes imported: False"


def test_a_caller_that_passes_argv_keeps_its_process_as_it_is(tmp_path, monkeypatch):
    """``main(argv)`` from a test or a notebook settles nothing process-wide: peft there keeps seeing
    bitsandbytes (a later quantized base in that process must still get its LoRA layers)."""
    from fedllm import cli, simulation
    from fedllm.model import modeling

    class Reached(Exception):
        """The run was reached: the process-wide choice, if any, was made before it."""

    def never() -> bool:
        raise AssertionError("a caller's process was changed")

    def stop(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(modeling, "lora_without_bitsandbytes", never)
    monkeypatch.setattr(simulation, "Simulation", stop)  # the run itself is not needed
    with pytest.raises(Reached):
        cli.main(["run", "--output-dir", str(tmp_path / "run"), *tiny_overrides(tmp_path / "run")])


def test_a_checkpoint_stored_quantized_is_refused_where_peft_passes_over_bitsandbytes(builtin_base):
    """A checkpoint whose config.json quantizes it with bitsandbytes, loaded with model.quantization = none
    in such a process, would get plain LoRA layers on bitsandbytes' modules: refused, naming the setting."""
    import subprocess
    import sys

    code = f"""
from fedllm.config import load_config
from fedllm.model import modeling
assert modeling.lora_without_bitsandbytes()
modeling.is_quantized = lambda model: True  # what a bitsandbytes-quantized checkpoint loads as
try:
    modeling.load_base(load_config(None, ["model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}"]).model)
except modeling.ModelError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "is stored quantized by bitsandbytes" in out.stdout and "model.quantization" in out.stdout
