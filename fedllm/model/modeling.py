"""Base model and tokenizer loading, and LoRA attachment per client rank.

One base model lives per process. Every distinct client rank gets one peft
adapter named ``r{rank}``; a client is switched in by writing its factors into
the adapter of its rank, never by loading another model.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch

from fedllm.factors import Adapter, lora_modules, module_key, write_factors
from fedllm.model.gguf import GGUFError, ensure_checkpoint, gguf_file, is_gguf

log = logging.getLogger(__name__)

RESIDUAL = "residual"  # frozen adapter holding merged updates on a quantized base

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class ModelError(RuntimeError):
    """The base model or tokenizer cannot be loaded or used; says what to do."""


def resolve_model_path(name: str, pretrain_steps: int) -> str:
    """'builtin' or 'builtin-testbed' -> the cached built-in base (built on first use); a GGUF file or
    ``gguf:<package>`` -> its converted checkpoint (converted on first use, ``fedllm/model/gguf.py``); else
    ``name``."""
    if is_builtin(name):
        from fedllm.model.builtin_base import ensure_builtin_base

        return str(ensure_builtin_base(pretrain_steps, suite=name))
    if is_gguf(name):
        return str(ensure_checkpoint(name))
    return name


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of the built-in offline bases."""
    return name in ("builtin", "builtin-testbed")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def check_model_reference(name: str) -> None:
    """Fail fast on a model that cannot be reached (offline Hub id, missing local path or GGUF package)."""
    if is_builtin(name):
        return
    if is_gguf(name):
        try:
            gguf_file(name)
        except GGUFError as e:
            raise ModelError(str(e)) from None
        return
    looks_local = name.startswith((".", "/", "~")) or (
        os.sep in name and Path(name).expanduser().parent.exists()
    )
    if Path(name).expanduser().exists():
        if not (Path(name).expanduser() / "config.json").exists():
            raise ModelError(
                f"model.name: local folder {name} has no config.json (expected a saved model folder)"
            )
        return
    if looks_local:
        raise ModelError(f"model.name: local path {name} does not exist")
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise ModelError(
                f"model.name: {name!r} is a Hub id but HF_HUB_OFFLINE=1 and it is not in the local cache; "
                f"download it first (hf download {name}) or pass a local path"
            )


def compute_dtype(name: str) -> torch.dtype:
    """The dtype 4-bit layers compute in; 'auto' picks bfloat16 where the GPU has it."""
    if name != "auto":
        return DTYPES[name]
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def quantization_config(mode: str, compute_dtype: torch.dtype, quant_type: str = "nf4"):
    """bitsandbytes config: NF4 with double quantization (or FP4 without) for 4bit, LLM.int8 for 8bit.

    Fails before any weight is read when bitsandbytes is missing.
    """
    if mode == "none":
        return None
    import importlib.util

    if _PEFT_WITHOUT_BNB:
        raise ModelError(
            f"model.quantization = {mode}: this process set peft to pass over bitsandbytes (a float base's "
            "run, lora_without_bitsandbytes); load a quantized base in a process of its own"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError(f"model.quantization = {mode} needs bitsandbytes: pip install 'fedllm[quant]'")
    from transformers import BitsAndBytesConfig

    if mode == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=quant_type == "nf4",
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


_PEFT_WITHOUT_BNB = (
    False  # set by lora_without_bitsandbytes: this process cannot put LoRA on a quantized base
)


def lora_without_bitsandbytes() -> bool:
    """Have peft pass over bitsandbytes' layers for the rest of this process; True where it now does.

    peft asks once whether bitsandbytes is installed (a cached answer) and, where it is, imports it when it
    builds its first LoRA layer, whatever the base; bitsandbytes' default backend then imports torch's
    inductor: 1.5 s of fedllm's 15 s start-up on a 2-core CPU (py-spy over the peer benchmark's job,
    docs/peers.md), for layers a float base never uses. Here peft's question is answered while bitsandbytes
    is hidden (``sys.modules[name] = None``: ``find_spec`` then says "not installed"), and nothing else in
    the process sees it hidden. For a process that loads a float base only (the command line's ``fedllm
    run`` with ``model.quantization = none``): a quantized base in it could not get LoRA layers, so
    :func:`quantization_config` refuses one, and :func:`load_base` a checkpoint stored quantized. Nothing
    is changed where peft has answered already or bitsandbytes is imported already (nothing left to save)."""
    import sys

    from peft import import_utils

    global _PEFT_WITHOUT_BNB
    asked = getattr(import_utils.is_bnb_available, "cache_info", None)  # a peft that stops caching: as is
    if asked is None or asked().currsize or "bitsandbytes" in sys.modules:
        return _PEFT_WITHOUT_BNB
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        import_utils.is_bnb_available()
        import_utils.is_bnb_4bit_available()
    finally:
        del sys.modules["bitsandbytes"]
    _PEFT_WITHOUT_BNB = True
    log.debug("peft passes over bitsandbytes in this process (the base is not quantized)")
    return True


def load_base(model_cfg, device: torch.device | str = "cpu"):
    """Load the frozen base and its tokenizer through ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.prompts import TURN_FORMATS

    check_model_reference(model_cfg.name)
    path = resolve_model_path(model_cfg.name, model_cfg.builtin_pretrain_steps)
    dtype = DTYPES[model_cfg.dtype]
    qconfig = quantization_config(
        model_cfg.quantization, compute_dtype(model_cfg.quant_compute_dtype), model_cfg.quant_type
    )
    # use_kernels=False: transformers >= 5.25 swaps layers for kernels fetched from the Hub by default (and
    # re-swaps them at every train()/eval() for the model's device); fedllm's bases are the plain modules,
    # offline and the same on every machine
    kwargs = {"dtype": dtype, "trust_remote_code": model_cfg.trust_remote_code, "use_kernels": False}
    if qconfig is not None:
        # bitsandbytes logs one line per 8-bit matmul on float32 inputs (it casts them to float16)
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
        kwargs["quantization_config"] = qconfig
        kwargs["device_map"] = {"": device}
    from eval.progress import bars_as_lines

    try:
        with bars_as_lines(log):  # transformers' "Loading weights" bar: whole lines in a log file
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        hint = " (HF_HUB_OFFLINE=1: download it first or pass a local path)" if _offline() else ""
        raise ModelError(f"model.name: cannot load {model_cfg.name!r}{hint}: {e}") from None
    if _PEFT_WITHOUT_BNB and is_quantized(model):  # a checkpoint stored quantized: peft needs bitsandbytes
        raise ModelError(
            f"model.name: {model_cfg.name!r} is stored quantized by bitsandbytes (its config.json's "
            "quantization_config), and this process set peft to pass over bitsandbytes (model.quantization = "
            "none): set model.quantization to the checkpoint's 4bit or 8bit"
        )
    if qconfig is None:
        model.to(device)
    elif model_cfg.quantization == "4bit" and torch.device(device).type == "cpu":
        select_cpu_4bit_kernel(model, model_cfg.quant_cpu_kernel)
    turns = TURN_FORMATS.get(getattr(model.config, "model_type", ""))
    if turns is not None and not getattr(tokenizer, "chat_template", None):
        # a base checkpoint without a chat template (the Gemma 3 270M GGUF): its family's own turn format,
        # so that conversations (data.template=chat) can train on it
        tokenizer.chat_template = turns
        log.info("the tokenizer has no chat template: using %s's turn format", model.config.model_type)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelError(
                f"tokenizer of {model_cfg.name!r} has neither a pad nor an eos token; add a pad token"
            )
        tokenizer.pad_token = tokenizer.eos_token
        log.info("tokenizer has no pad token: using eos (%r) for padding", tokenizer.eos_token)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    return model, tokenizer


PACKED_BLOCK_N = 32  # bitsandbytes packs output rows in blocks of 32 (_convert_weight_packed_for_cpu)


def _linear4bit_layers(model) -> dict[str, torch.nn.Module]:
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def packed_kernel_problems(model) -> list[str]:
    """Layers bitsandbytes' AVX512-BF16 4-bit kernel cannot take, each with its shape and the constraint.

    The kernel repacks a weight in blocks of 32 output rows and reads the
    block-wise scales as ``out x (in / blocksize)``; other shapes fail inside
    its first forward with a bare assertion.
    """
    problems = []
    for name, m in _linear4bit_layers(model).items():
        out_f, in_f = m.out_features, m.in_features
        block = m.weight.quant_state.blocksize if m.weight.quant_state is not None else 64
        if out_f % PACKED_BLOCK_N or in_f % block:
            problems.append(
                f"{name} ({out_f} x {in_f}, out x in): needs out_features % {PACKED_BLOCK_N} == 0 "
                f"and in_features % {block} == 0"
            )
    return problems


def select_cpu_4bit_kernel(model, kernel: str) -> str:
    """Allow bitsandbytes' packed AVX512-BF16 4-bit kernel on every layer, or forbid it; returns ``kernel``.

    bitsandbytes switches a layer to its packed format on the first inference
    forward on such CPUs, with constraints on layer shapes and no backward.
    'dequant' forbids that. 'packed' allows it after checking the shapes (the
    layer is named when it cannot work) and keeps each layer's exact dequant
    form aside, so that :func:`restore_dequant_layers` can give training the
    very weights it had before (bitsandbytes' own inverse re-quantizes the
    block scales from bfloat16: the frozen base would drift a little with every
    evaluation). That copy costs the 4-bit weights' memory once more.
    """
    from bitsandbytes.functional import has_avx512bf16

    layers = _linear4bit_layers(model)
    if kernel == "packed":
        if not has_avx512bf16():
            raise ModelError(
                "model.quant_cpu_kernel = packed needs a CPU with AVX512-BF16 (this one has none): "
                "use model.quant_cpu_kernel=dequant"
            )
        problems = packed_kernel_problems(model)
        if problems:
            raise ModelError(
                f"model.quant_cpu_kernel = packed: bitsandbytes' AVX512-BF16 4-bit kernel cannot take "
                f"{len(problems)} layer(s), e.g. {problems[0]}; use model.quant_cpu_kernel=dequant"
            )
        for m in layers.values():
            m.fedllm_dequant = (m.weight.data, copy.deepcopy(m.weight.quant_state))
    for m in layers.values():
        m.support_avx512bf16_for_cpu = kernel == "packed"
    model.fedllm_cpu_4bit_kernel = kernel
    return kernel


def restore_dequant_layers(model) -> int:
    """Give packed layers back their exact dequant form before training; returns how many were restored.

    The packed kernel computes no gradient for its input, so a LoRA trained
    through a packed layer would silently miss every gradient that flows
    through the frozen base weight.
    """
    if not is_quantized(model):
        return 0
    n = 0
    for m in _linear4bit_layers(model).values():
        saved = getattr(m, "fedllm_dequant", None)
        if saved is not None and getattr(m.weight.quant_state, "packing_format_for_cpu", False):
            m.weight.data = saved[0]
            m.weight.quant_state = m.quant_state = copy.deepcopy(saved[1])
            n += 1
    return n


def context_length(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def adapter_name(rank: int) -> str:
    return f"r{rank}"


def peft_lora_config(rank: int, lora_cfg, alpha: float | None = None):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=lora_cfg.alpha_ratio * rank if alpha is None else alpha,
        target_modules=list(lora_cfg.target_modules),
        lora_dropout=lora_cfg.dropout,
        use_rslora=lora_cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_lora(model, ranks: list[int], lora_cfg):
    """Wrap ``model`` in peft with one adapter per distinct rank; freeze the base.

    Modules in ``lora.trainable_modules`` are made trainable in place (shared
    by all adapters); their values are swapped per client like the factors.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    distinct = sorted(set(ranks))
    try:
        first = adapter_name(distinct[0])
        peft_model = get_peft_model(model, peft_lora_config(distinct[0], lora_cfg), adapter_name=first)
    except ValueError as e:
        raise ModelError(f"lora.target_modules {lora_cfg.target_modules}: {e}") from None
    for r in distinct[1:]:
        peft_model.add_adapter(adapter_name(r), peft_lora_config(r, lora_cfg))
    set_trainable_modules(peft_model, lora_cfg.trainable_modules)
    return peft_model


def set_trainable_modules(peft_model, modules: list[str]) -> list[str]:
    """Unfreeze the named base modules; returns the parameter names."""
    from fedllm.factors import dense_param_names

    names = dense_param_names(peft_model, modules)
    if modules and not names:
        raise ModelError(f"lora.trainable_modules {modules}: no such modules in the base model")
    for k, p in peft_model.named_parameters():
        if module_key(k) in names:
            p.requires_grad_(True)
    return names


def is_quantized(model) -> bool:
    """True when the (peft-wrapped) base was loaded 4- or 8-bit by bitsandbytes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def activate(peft_model, name: str) -> list[torch.nn.Parameter]:
    """Make ``name`` the active (and only trainable) adapter; return the trainable params.

    When a frozen residual adapter exists (merging strategies on a quantized
    base) it stays active underneath ``name``: it stands for the base weights
    that cannot be rewritten.
    """
    if RESIDUAL in peft_model.peft_config and name != RESIDUAL:
        peft_model.base_model.set_adapter([name, RESIDUAL])
        _freeze_adapter(peft_model, RESIDUAL)
    else:
        peft_model.set_adapter(name)
    return [p for p in peft_model.parameters() if p.requires_grad]


def _freeze_adapter(peft_model, name: str) -> None:
    for key, p in peft_model.named_parameters():
        if f".{name}." in key and "lora_" in key:
            p.requires_grad_(False)


def adapter_params(peft_model, name: str) -> dict[str, torch.nn.Parameter]:
    """``{"<module>.A": lora_A weight, "<module>.B": lora_B weight}`` of adapter ``name``."""
    params = {}
    for key, module in lora_modules(peft_model, name).items():
        params[f"{key}.A"] = module.lora_A[name].weight
        params[f"{key}.B"] = module.lora_B[name].weight
    return params


def install_adapter(
    peft_model,
    name: str,
    factors: Adapter,
    lora_cfg,
    dropout: float | None = None,
    biases: dict[str, torch.Tensor] | None = None,
) -> None:
    """(Re)create adapter ``name`` with the rank of ``factors`` (zero-padded) and load them.

    Used for the global model and personalized models, whose rank is not a
    client rank (FlexLoRA's global update has the sum of ranks). ``biases``
    (FLoRAL's bias adaptors, mixed) go into peft's ``lora_B`` bias (``lora_bias``).
    """
    import warnings

    from fedllm.factors import pad_rank

    if name in peft_model.peft_config:
        peft_model.delete_adapter(name)
    rank = max(f.rank for f in factors.values())
    config = peft_lora_config(rank, lora_cfg, alpha=rank)
    if dropout is not None:
        config.lora_dropout = dropout
    config.lora_bias = bool(biases)
    with warnings.catch_warnings():  # "merging won't be possible" on bias-free layers: nothing is merged here
        warnings.filterwarnings("ignore", message=".*lora_bias=True.*")
        peft_model.add_adapter(name, config)
    write_factors(peft_model, name, {k: pad_rank(f.folded(), rank) for k, f in factors.items()})
    if biases:
        modules = lora_modules(peft_model, name)
        with torch.no_grad():
            for key, b in biases.items():
                modules[key].lora_B[name].bias.copy_(b)


def install_residual(peft_model, residual: Adapter, lora_cfg) -> int:
    """Hold everything merged so far as the frozen, dropout-free adapter ``residual``; returns its rank.

    Quantized weights cannot absorb ``B @ A`` without a lossy dequantize /
    requantize round trip, so on 4/8-bit bases the merging strategies keep
    the cumulative merged update here instead (exact; compacted by an SVD
    when its rank exceeds the layer's dimensions).
    """
    from fedllm.factors import compact

    factors = compact(residual)
    install_adapter(peft_model, RESIDUAL, factors, lora_cfg, dropout=0.0)
    _freeze_adapter(peft_model, RESIDUAL)
    return max(f.rank for f in factors.values())


def merge_into_base(peft_model, merged: Adapter, sign: float = 1.0) -> None:
    """Add ``sign`` x each module's update (``scale * B @ A``, or a dense delta) to the frozen base weights
    (non-quantized bases)."""
    if is_quantized(peft_model):
        raise ModelError("cannot merge into a 4/8-bit quantized base: keep the update as a residual adapter")
    modules = lora_modules(peft_model, next(iter(peft_model.peft_config)))
    with torch.no_grad():
        for key, f in merged.items():
            weight = modules[key].get_base_layer().weight
            delta = f.to(torch.float32).delta()
            weight.add_(delta.to(weight.device, weight.dtype), alpha=sign)
