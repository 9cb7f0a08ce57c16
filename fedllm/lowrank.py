"""Low-rank linear algebra on LoRA factors, on plain tensors: the strategies' math and the merged residual.

Below both halves of the federation (the server's strategies and the client
runtime's merged base use it alike), so it imports nothing but torch and the
``LoraFactors`` type.

The key identity: for stacked factors ``B = [B_1 .. B_K]`` (out x R) and
``A = [p_1 A_1; ..; p_K A_K]`` (R x in), ``B @ A = sum_k p_k B_k A_k``. Its SVD
is computed without ever forming the out x in matrix: thin QR of ``B`` and
``A^T``, then an SVD of the small R x R core ``R_B @ R_A^T``. That is what
makes FlexLoRA and FLoRIST cheap on the server.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedllm.factors import Adapter, DenseDelta, LoraFactors, concat


def pad_rank(f: LoraFactors, rank: int) -> LoraFactors:
    """Zero-pad (folded) factors to ``rank``; the product is unchanged."""
    if f.rank > rank:
        raise ValueError(f"cannot pad rank {f.rank} down to {rank}")
    extra = rank - f.rank
    A = torch.cat([f.A, f.A.new_zeros(extra, f.A.shape[1])])
    B = torch.cat([f.B, f.B.new_zeros(f.B.shape[0], extra)], dim=1)
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
