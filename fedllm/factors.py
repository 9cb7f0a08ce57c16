"""LoRA factors: the one representation that crosses the client/server boundary.

An adapter is ``{module name: LoraFactors(A, B, scale)}`` with ``A: r x in``,
``B: out x r`` and ``delta W = scale * B @ A`` (peft's ``lora_A`` /
``lora_B`` weights and ``scaling``). The scale is kept explicit because
heterogeneous ranks with ``alpha / r`` scaling are the classic source of
silent aggregation bugs; strategies call :meth:`LoraFactors.folded` before any
arithmetic and :meth:`LoraFactors.with_scale` to hand factors back to a client.

Reading always copies: peft's state dicts share memory with live parameters,
and an aggregated update must not change when a client trains on.

The second half is the low-rank linear algebra on factors that the server's strategies and the client
runtime's merged base share (padding, stacking, the SVD of a product from QR of its factors and an r x r
core): below both halves of the federation, it imports nothing but torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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


def lora_modules(model: Any, adapter: str) -> dict[str, Any]:
    """``{base module name: peft LoRA layer}`` for the layers that hold ``adapter`` (typed ``Any``: a
    layer's ``lora_A`` / ``lora_B`` ModuleDicts are attributes a type checker cannot follow)."""
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


# ---- low-rank linear algebra on factors ------------------------------------------------------------------
# The key identity: for stacked factors ``B = [B_1 .. B_K]`` (out x R) and
# ``A = [p_1 A_1; ..; p_K A_K]`` (R x in), ``B @ A = sum_k p_k B_k A_k``. Its SVD
# is computed without ever forming the out x in matrix: thin QR of ``B`` and
# ``A^T``, then an SVD of the small R x R core ``R_B @ R_A^T``. That is what
# makes FlexLoRA and FLoRIST cheap on the server.


def pad_rank(f: LoraFactors, rank: int) -> LoraFactors:
    """Zero-pad (folded) factors to ``rank``; the product is unchanged."""
    if f.rank > rank:
        raise ValueError(f"cannot pad rank {f.rank} down to {rank}")
    extra = rank - f.rank
    A = torch.cat([f.A, f.A.new_zeros(extra, f.A.shape[1])])
    B = torch.cat([f.B, f.B.new_zeros(f.B.shape[0], extra)], dim=1)
    return LoraFactors(A, B, f.scale)


def pad_with(f: LoraFactors, g: LoraFactors) -> LoraFactors:
    """Folded ``f`` at ``g``'s rank, its components beyond its own rank taken from folded ``g``: an upload
    that trained only its leading components, seen as unchanged elsewhere (its change padded with zeros)."""
    if f.rank > g.rank:
        raise ValueError(f"cannot pad rank {f.rank} down to {g.rank}")
    A, B = g.A.clone(), g.B.clone()
    A[: f.rank] = f.A
    B[:, : f.rank] = f.B
    return LoraFactors(A, B, f.scale)


def truncate_rank(f: LoraFactors, rank: int) -> LoraFactors:
    """The leading ``rank`` rows of A and columns of B."""
    return LoraFactors(f.A[:rank], f.B[:, :rank], f.scale)


def fit_rank(f: LoraFactors, rank: int) -> LoraFactors:
    """The leading ``rank`` components, zero-padded when ``f`` has fewer."""
    return pad_rank(f, rank) if f.rank < rank else truncate_rank(f, rank)


def stack(factors: list[LoraFactors], weights: list[float]) -> LoraFactors:
    """Stacked factors whose product is ``sum_k w_k scale_k B_k A_k`` exactly."""
    A = torch.cat([w * f.A for f, w in zip(factors, weights, strict=True)])
    B = torch.cat([f.B * f.scale for f in factors], dim=1)
    return LoraFactors(A, B, 1.0)


def low_rank_svd(f: LoraFactors) -> tuple[Tensor, Tensor, Tensor]:
    """``U, S, Vh`` of ``scale * B @ A`` from QR of the factors and an R x R core SVD.

    The core SVD runs in float64: it is tiny and its accuracy bounds the result.
    """
    qb, rb = torch.linalg.qr(f.B * f.scale)
    qa, ra = torch.linalg.qr(f.A.T)
    core = rb.double() @ ra.double().T
    uc, s, vch = torch.linalg.svd(core, full_matrices=False)
    dtype = f.B.dtype
    return qb @ uc.to(dtype), s.to(dtype), vch.to(dtype) @ qa.T


def svd_factors(u: Tensor, s: Tensor, vh: Tensor, rank: int, split: str = "sqrt") -> LoraFactors:
    """Rank-``rank`` factors of ``U S Vh`` (scale 1).

    ``B = U sqrt(S), A = sqrt(S) Vh`` (``split="sqrt"``) or ``B = U S, A = Vh`` (``"us"``).

    The product is the same; the split is not: it decides the scale of each
    factor a client starts training from ('us' gives A orthonormal rows).
    """
    s = s[:rank].clamp_min(0)
    if split == "us":
        return LoraFactors(vh[:rank], u[:, :rank] * s[None, :], 1.0)
    if split != "sqrt":
        raise ValueError(f"split = {split!r}: expected 'us' or 'sqrt'")
    root = s.sqrt()
    return LoraFactors(root[:, None] * vh[:rank], u[:, :rank] * root[None, :], 1.0)


def energy_rank(s: Tensor, tau: float) -> int:
    """Smallest p with ``sum_{i<p} s_i^2 / sum_i s_i^2 >= tau`` (at least 1)."""
    energy = s.double() ** 2
    total = energy.sum()
    if total <= 0:
        return 1
    frac = torch.cumsum(energy, 0) / total
    p = int(torch.searchsorted(frac, torch.tensor(tau, dtype=frac.dtype) - 1e-12).item()) + 1
    return min(max(p, 1), s.numel())


def weighted_mean(tensors: list[Tensor], weights: list[float]) -> Tensor:
    out = torch.zeros_like(tensors[0])
    for t, w in zip(tensors, weights, strict=True):
        out.add_(t, alpha=w)
    return out


def compact(adapter: Adapter) -> Adapter:
    """Same update as LoRA factors of rank at most min(out, in) per module (an exact SVD when larger, or of a
    dense module): what a peft adapter folder or a residual adapter can hold."""
    out = {}
    for key, f in adapter.items():
        if isinstance(f, DenseDelta):
            u, s, vh = torch.linalg.svd(f.D.double(), full_matrices=False)
            f = svd_factors(u.to(f.D.dtype), s.to(f.D.dtype), vh.to(f.D.dtype), s.numel(), "sqrt")
        elif f.rank > min(f.B.shape[0], f.A.shape[1]):
            u, s, vh = low_rank_svd(f)
            f = svd_factors(u, s, vh, min(f.B.shape[0], f.A.shape[1]))
        out[key] = f.folded()
    return out


def numerical_rank(s: Tensor, shape: tuple[int, int]) -> int:
    """How many singular values exceed ``s_max * max(out, in) * eps(float32)`` (numpy's matrix_rank rule)."""
    if s.numel() == 0 or float(s[0]) <= 0:
        return 0
    tol = float(s[0]) * max(shape) * torch.finfo(torch.float32).eps
    return int((s > tol).sum())


def smallest_exact(f: LoraFactors | DenseDelta) -> LoraFactors | DenseDelta:
    """The same update in its smallest exact form: factors of its numerical rank (QR of the factors and an
    SVD of the small core, never the dense matrix), or the dense matrix once that is smaller.

    Always the SVD's factors, even at full rank: a merge is downloaded in this form (a site's catch-up),
    and FLoRA's stacked merge as it was built holds each sampled client's own B_k and p_k A_k; the SVD of
    the sum reveals the sum only."""
    if isinstance(f, DenseDelta):
        return f
    out_f, in_f = f.B.shape[0], f.A.shape[1]
    if f.rank * (out_f + in_f) >= out_f * in_f:
        return DenseDelta(f.delta())
    u, s, vh = low_rank_svd(f)
    p = max(1, numerical_rank(s, (out_f, in_f)))
    return svd_factors(u, s, vh, p, "sqrt")


def add_to_residual(residual: Adapter, merged: Adapter) -> Adapter:
    """The cumulative update merged into the base after also merging ``merged``, in its smallest exact form.

    Its size is bounded by ``min(rank so far, out, in)`` per module, never by
    the number of rounds. The server's checkpointed residual, a client's
    catch-up download and every client's merged base are built by this one
    function, so they cannot drift apart.
    """
    grown = concat(residual, merged)
    return {k: smallest_exact(f) if k in merged else f for k, f in grown.items()}


def ranks_under_budget(
    spectra: dict[str, tuple[Tensor, int]], budget_bytes: float, tau: float = 1.0, cap: int | None = None
) -> tuple[dict[str, int], float]:
    """Each module's rank under a download budget, and the energy share chosen.

    One share for all modules, the largest up to ``tau`` whose broadcast (``4 p_m (out_m + in_m)`` bytes,
    float32, summed over modules) fits: lowering one energy threshold keeps the same fraction of every
    module's update energy, so no module is starved for another's sake. ``cap`` bounds each module's rank
    (a client's own rank). A budget below one component per module gives every module rank 0 (the budget
    is never exceeded). ``spectra``: ``{module: (singular values, out + in)}``.
    """
    shares = {}
    for key, (s, _) in spectra.items():
        e = s.double() ** 2
        c = (e.cumsum(0) / e.sum().clamp_min(1e-300)).tolist()
        shares[key] = c[:cap] if cap is not None else c

    def ranks(t: float) -> dict[str, int]:
        return {
            k: (0 if t <= 0 or not c else next((i + 1 for i, f in enumerate(c) if f >= t - 1e-12), len(c)))
            for k, c in shares.items()
        }

    def cost(r: dict[str, int]) -> float:
        return sum(4 * p * spectra[k][1] for k, p in r.items())

    for t in sorted({tau, *(f for c in shares.values() for f in c if f <= tau)}, reverse=True):
        if cost(ranks(t)) <= budget_bytes:
            return ranks(t), t
    return ranks(0.0), 0.0


def singular_values(f: LoraFactors) -> Tensor:
    """The singular values of ``scale * B @ A`` for factors in SVD form (orthogonal columns of B, rows of
    A, as FlexLoRA keeps its global update), whichever way the singular values are split between them."""
    return f.B.norm(dim=0) * f.A.norm(dim=1) * abs(f.scale)
