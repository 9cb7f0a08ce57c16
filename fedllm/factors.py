"""LoRA factors: the one representation that crosses the client/server boundary.

An adapter is ``{module name: LoraFactors(A, B, scale)}`` with ``A: r x in``,
``B: out x r`` and ``delta W = scale * B @ A`` (peft's ``lora_A`` /
``lora_B`` weights and ``scaling``). The scale is kept explicit because
heterogeneous ranks with ``alpha / r`` scaling are the classic source of
silent aggregation bugs; strategies call :meth:`LoraFactors.folded` before any
arithmetic and :meth:`LoraFactors.with_scale` to hand factors back to a client.

Reading always copies: peft's state dicts share memory with live parameters,
and an aggregated update must not change when a client trains on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

PEFT_PREFIX = "base_model.model."


@dataclass
class LoraFactors:
    """``delta W = scale * B @ A``; ``A: r x in``, ``B: out x r``."""

    A: Tensor
    B: Tensor
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self) -> Tensor:
        """The dense update (for tests and small reference computations only)."""
        return self.scale * (self.B @ self.A)

    def folded(self) -> LoraFactors:
        """The same update with the scale folded into B (scale 1)."""
        return LoraFactors(self.A, self.B * self.scale, 1.0)

    def with_scale(self, scale: float) -> LoraFactors:
        """The same update expressed for a layer whose scale is ``scale``."""
        return LoraFactors(self.A, self.B * (self.scale / scale), scale)

    def numel(self) -> int:
        return self.A.numel() + self.B.numel()

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> LoraFactors:
        return LoraFactors(
            self.A.to(device=device, dtype=dtype), self.B.to(device=device, dtype=dtype), self.scale
        )


@dataclass
class DenseDelta:
    """A module's update kept as its dense ``out x in`` matrix (scale folded).

    Used for a merged residual once its factors would be larger than the
    matrix (rank >= out * in / (out + in)); it offers the part of the
    :class:`LoraFactors` interface that residuals and downloads use.
    """

    D: Tensor
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return min(self.D.shape)

    def delta(self) -> Tensor:
        return self.D

    def folded(self) -> DenseDelta:
        return self

    def numel(self) -> int:
        return self.D.numel()

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> DenseDelta:
        return DenseDelta(self.D.to(device=device, dtype=dtype))


Adapter = dict[str, LoraFactors]  # a merged residual may also hold DenseDelta modules


def lora_scale(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """peft's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def module_key(peft_name: str) -> str:
    """peft's module name without its wrapper prefix, i.e. the base model's name."""
    return peft_name[len(PEFT_PREFIX) :] if peft_name.startswith(PEFT_PREFIX) else peft_name


def lora_modules(model, adapter: str) -> dict[str, torch.nn.Module]:
    """``{base module name: peft LoRA layer}`` for the layers that hold ``adapter``."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {}):
            out[module_key(name)] = module
    return out


def read_factors(model, adapter: str) -> Adapter:
    """Copy ``adapter``'s factors out of a peft model (float32, on CPU)."""
    out = {}
    for name, module in lora_modules(model, adapter).items():
        out[name] = LoraFactors(
            module.lora_A[adapter].weight.detach().to("cpu", torch.float32).clone(),
            module.lora_B[adapter].weight.detach().to("cpu", torch.float32).clone(),
            float(module.scaling[adapter]),
        )
    return out


def write_factors(model, adapter: str, factors: Adapter) -> None:
    """Copy ``factors`` into ``adapter``, re-expressed at each layer's own scale.

    Every LoRA layer of the adapter must be covered and ranks must match, so a
    partial or mis-shaped write fails loudly instead of training from garbage.
    """
    modules = lora_modules(model, adapter)
    missing = sorted(set(modules) - set(factors))
    if missing:
        raise KeyError(
            f"no factors for {len(missing)} LoRA module(s) of adapter {adapter!r}, e.g. {missing[0]}"
        )
    with torch.no_grad():
        for name, module in modules.items():
            f = factors[name].with_scale(float(module.scaling[adapter]))
            wa, wb = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            if f.A.shape != wa.shape or f.B.shape != wb.shape:
                raise ValueError(
                    f"{name}: factors A{tuple(f.A.shape)} B{tuple(f.B.shape)} do not fit adapter {adapter!r} "
                    f"(A{tuple(wa.shape)} B{tuple(wb.shape)})"
                )
            wa.copy_(f.A)
            wb.copy_(f.B)


def module_shapes(model, adapter: str) -> dict[str, tuple[int, int]]:
    """``{module: (out_features, in_features)}`` of the layers holding ``adapter``, in the model's order.

    What both halves need to know of the model: the runtime reads it from its
    base, the server receives it from the assembly (it holds no model).
    """
    return {
        key: (m.lora_B[adapter].weight.shape[0], m.lora_A[adapter].weight.shape[1])
        for key, m in lora_modules(model, adapter).items()
    }


def init_factors(shapes: dict[str, tuple[int, int]], rank: int, scale: float, seed: int) -> Adapter:
    """A new LoRA initialization (A Kaiming-uniform as peft does, B zero), seeded.

    Each module draws from its own generator seeded by ``(seed, module
    index)``, so the init does not depend on which process (or which side of
    the federation) computes it, and ranks share their leading rows: with the
    same seed every client of a round starts from the same global
    initialization, which parameter-averaging strategies (FedIT) need, and the
    server can derive what a client started from.
    """
    out = {}
    for i, (name, (out_f, in_f)) in enumerate(shapes.items()):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + i) % (1 << 62))
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on an (r, in) weight
        A = (torch.rand((rank, in_f), generator=gen) * 2 - 1) * bound
        out[name] = LoraFactors(A, torch.zeros(out_f, rank), scale)
    return out


def fresh_factors(model, adapter: str, seed: int) -> Adapter:
    """:func:`init_factors` for ``adapter`` of a peft model (its rank, shapes and scale)."""
    modules = lora_modules(model, adapter)
    first = next(iter(modules.values()))
    rank, scale = first.lora_A[adapter].weight.shape[0], float(first.scaling[adapter])
    return init_factors(module_shapes(model, adapter), rank, scale, seed)


def read_dense(model, names: list[str]) -> dict[str, Tensor]:
    """Copies of fully trained base parameters (e.g. embeddings), by parameter name."""
    params = dict(model.named_parameters())
    return {
        module_key(k): v.detach().to("cpu", torch.float32).clone()
        for k, v in params.items()
        if module_key(k) in names
    }


def write_dense(model, dense: dict[str, Tensor]) -> None:
    params = {module_key(k): v for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, v in dense.items():
            params[k].copy_(v)


def dense_param_names(model, modules: list[str]) -> list[str]:
    """Parameter names of the base modules listed in ``lora.trainable_modules``.

    A tied weight is one parameter under its first name: with tied embeddings (SmolLM2, Gemma, Llama 3.2)
    ``lm_head`` resolves to ``embed_tokens.weight``, and listing either trains (and sends) the one matrix,
    once, which is both the input embedding and the output head."""

    def wanted(key: str) -> bool:
        return any(key == m or key.endswith(f".{m}") for m in modules)

    names, by_id = [], {}
    for k, p in model.named_parameters():
        key = module_key(k)
        by_id[id(p)] = key
        if "lora_" not in key and wanted(key.removesuffix(".weight")) and key.endswith(".weight"):
            names.append(key)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        weight = mod._parameters.get("weight")  # its own, not a wrapper's view of its base layer's
        key = by_id.get(id(weight)) if weight is not None else None
        if key and "lora_" not in key and key not in names and wanted(module_key(mod_name)):
            names.append(key)  # a tied module: its weight is listed under the name it is tied to
    return names


def concat(*adapters: Adapter) -> Adapter:
    """The exact sum of several adapters as one adapter (scales folded, ranks added; a dense module stays
    dense)."""
    out: Adapter = {}
    for adapter in adapters:
        for name, f in adapter.items():
            g, have = f.folded(), out.get(name)
            if have is None:
                out[name] = g
            elif isinstance(g, DenseDelta) or isinstance(have, DenseDelta):
                out[name] = DenseDelta(have.delta() + g.delta())
            else:
                out[name] = LoraFactors(torch.cat([have.A, g.A]), torch.cat([have.B, g.B], dim=1), 1.0)
    return out


def adapter_numel(adapter: Adapter) -> int:
    return sum(f.numel() for f in adapter.values())


def adapter_tensors(adapter: Adapter, prefix: str) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Flat tensors ``{prefix}{module}.A/.B`` and scales of an adapter (for checkpoints and messages)."""
    tensors, scales = {}, {}
    for key, f in adapter.items():
        if isinstance(f, DenseDelta):
            tensors[f"{prefix}{key}.D"] = f.D.contiguous()
        else:
            tensors[f"{prefix}{key}.A"] = f.A.contiguous()
            tensors[f"{prefix}{key}.B"] = f.B.contiguous()
        scales[f"{prefix}{key}"] = f.scale
    return tensors, scales


def prefixed(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """``tensors`` with every name under ``prefix`` (how messages, checkpoints and client state are
    flattened).
    """
    return {f"{prefix}{k}": v for k, v in tensors.items()}


def unprefixed(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of ``tensors`` under ``prefix``, with the prefix cut (the inverse of :func:`prefixed`)."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def adapter_from_tensors(tensors: dict[str, Tensor], scales: dict[str, float], prefix: str) -> Adapter:
    """The adapter :func:`adapter_tensors` flattened under ``prefix``."""
    out = {}
    for name, scale in scales.items():
        if name.startswith(prefix):
            key = name[len(prefix) :]
            if f"{name}.D" in tensors:
                out[key] = DenseDelta(tensors[f"{name}.D"])
            else:
                out[key] = LoraFactors(tensors[f"{name}.A"], tensors[f"{name}.B"], float(scale))
    return out
