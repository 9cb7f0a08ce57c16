"""What a site's masked vector carries, and how the server turns the protocol's sum back into a round.

A strategy whose aggregate is linear in the uploads (``Strategy.sums_uploads``: FedIT, FFA-LoRA, FedSVD,
RoLoRA, FedSA-LoRA without B sharing)
needs only ``sum_k w_k x_k`` of fixed-shape tensors. Every site sends the *change* of what it uploads,
measured from what it started from, in the aggregation space (B with its scale folded in), zero-padded from
its rank to the federation's largest one (its leading components, as the strategies pad), flattened in an
order the server fixes (the round's *layout*, sent with the start). Changes, not values: a change is bounded
by the clip each site applies before masking, so every value fits the protocol's integer range.

The server gets the protocol's weighted mean of the survivors' vectors, ``sum_k w_k c_k`` with
``w_k = n_k / sum n`` over the sites that finished (or ``1 / |S|``), and adds back what it knows: the same
weighted sum of the survivors' starting points (its own derivation of each reference, as for a plain round).
The result is one update at the largest rank (scale 1) that the strategy aggregates with weight 1, which for
a linear strategy is the plain round's result exactly, up to the protocol's quantization
(``tests/test_secagg.py``). Under distributed DP (uniform weights, noised changes) the server forms
``base + sum_k c_k`` instead, and the DP wrapper divides by the sample size and adds the noise of the sites
that did not finish (``fedllm/privacy/strategy.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from fedllm.aggregation.base import base_point
from fedllm.checks import clip_
from fedllm.factors import Adapter, LoraFactors
from fedllm.protocol import ClientUpdate, SummedUpdates, UploadContext, UploadTransform, upload_changes

KEY = "secagg"  # the embedded changes in an update's ``attachments`` (what its masked vector carries)
Layout = list[tuple[str, tuple[int, ...]]]


class SecureSummand(UploadTransform):
    """The site's change, clipped to ``clip_norm`` (0: as it is, DP's transform clipped and noised it),
    attached to the update (``attachments['secagg']``) by name (``A.<module>``, ``B.<module>`` folded,
    ``dense.<name>``): what the site's masked vector will carry once the round's layout pads it."""

    def __init__(self, clip_norm: float) -> None:
        self.clip_norm = clip_norm

    def apply(self, update: ClientUpdate, ctx: UploadContext) -> ClientUpdate:
        if update.extras:
            raise RuntimeError(
                f"secure aggregation: extra {next(iter(update.extras))!r} has no place in the secure sum"
            )
        changes = {name: c.float() for name, c in upload_changes(update, ctx).items()}
        if self.clip_norm > 0:
            clip_(list(changes.values()), self.clip_norm)
        update.attachments = {**update.attachments, KEY: changes}
        return update


def layout(server, round_idx: int) -> Layout:
    """The round's vector, in order: what the strategy's clients upload this round at the federation's
    largest rank, then the dense modules. Every site pads its changes into it; the server reads the sum
    back with it."""
    uploads = server.hook.for_round(round_idx).uploads
    out: Layout = []
    for key, (out_f, in_f) in server.modules.items():
        if "A" in uploads:
            out.append((f"A.{key}", (server.max_rank, in_f)))
        if "B" in uploads:
            out.append((f"B.{key}", (out_f, server.max_rank)))
    out += [(f"dense.{k}", tuple(t.shape)) for k, t in server.state.dense.items()]
    return out


def layout_size(lay: Layout) -> int:
    return sum(math.prod(shape) for _, shape in lay)


def to_vector(changes: dict[str, Tensor], lay: Layout) -> np.ndarray:
    """The site's changes zero-padded into the layout (each at its leading corner) and flattened; a change
    the layout has no place for, or one larger than its place, is refused (the site fails the round)."""
    unknown = sorted(set(changes) - {name for name, _ in lay})
    if unknown:
        raise ValueError(f"secure aggregation: the round's layout has no place for {unknown[0]!r}")
    out = np.zeros(layout_size(lay), dtype=np.float64)
    at = 0
    for name, shape in lay:
        n = math.prod(shape)
        if name in changes:
            c = changes[name]
            if c.dim() != len(shape) or any(a > b for a, b in zip(c.shape, shape, strict=True)):
                raise ValueError(f"secure aggregation: {name} is {tuple(c.shape)}, its place {shape}")
            block = np.zeros(shape, dtype=np.float64)
            block[tuple(slice(0, s) for s in c.shape)] = c.detach().double().cpu().numpy()
            out[at : at + n] = block.ravel()
        at += n
    return out


def site_vector(changes: dict[str, Tensor], lay: Layout, noise_std: float = 0.0, gen=None) -> np.ndarray:
    """The site's masked vector before masking: its changes in the layout, plus (distributed DP) its share of
    the noise on *every* coordinate, the padding beyond its rank included, so that each coordinate of the sum
    carries the noise of all the round's sites as central DP's does (noise on its own rank only would leave
    the components only the largest ranks train with a fraction of it)."""
    vec = to_vector(changes, lay)
    if noise_std > 0:
        vec += torch.randn(vec.shape, generator=gen, dtype=torch.float64).numpy() * noise_std
    return vec


def from_vector(vec: np.ndarray, lay: Layout) -> dict[str, Tensor]:
    """The layout's tensors out of a flat vector (the protocol's sum)."""
    if vec.shape != (layout_size(lay),):
        raise ValueError(f"secure aggregation: the sum has shape {vec.shape}, the layout {layout_size(lay)}")
    out, at = {}, 0
    for name, shape in lay:
        n = math.prod(shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(vec[at : at + n])).float().reshape(shape)
        at += n
    return out


def protocol_weights(server, clients: list[int], max_weight: float, quantization: int) -> list[float]:
    """Each finishing site's weight as Flower's SecAgg+ applies it: the site's own example count (1 each
    under uniform weighting) over ``max_weight``, quantized to ``quantization`` levels (at most 1)."""
    if server.policy.weighting == "uniform":
        return [1.0 for _ in clients]
    q = quantization
    return [round(server.clients[k].num_examples / max_weight * q) / q for k in clients]


def survivors_weights(server, clients: list[int], max_weight: float, quantization: int) -> list[float]:
    """Each finishing site's share of the protocol's mean: its :func:`protocol_weights`, normalized over the
    sites that finished."""
    w = protocol_weights(server, clients, max_weight, quantization)
    total = sum(w)
    return [x / total for x in w]


def summed_update(
    server, plan, clients: list[int], mean: np.ndarray, lay: Layout, weights: list[float], distributed: bool
) -> SummedUpdates:
    """The round as one update at the largest rank (scale 1) from the protocol's mean of the survivors'
    changes (see module docstring); ``distributed``: DP's sum of noised changes on the base point instead."""
    tensors = from_vector(mean, lay)
    n = len(clients)
    base = base_point(server.state, server.context(plan, []))  # where the round's changes are added
    uploads = server.hook.for_round(plan.round).uploads
    if distributed:  # base + sum_k c_k (uniform: mean x n)
        start = {k: dict(A=f.A.clone(), B=f.B.clone()) for k, f in base.items()}
        scale_sum = float(n)
    else:  # sum_k w_k (reference_k padded) + sum_k w_k c_k
        start = {k: dict(A=torch.zeros_like(f.A), B=torch.zeros_like(f.B)) for k, f in base.items()}
        for k, w in zip(clients, weights, strict=True):
            ref = server.reference(plan.round, k, plan.starts[k])
            for key, f in ref.items():
                padded = server.strategy.at_rank(f.folded(), base[key])
                start[key]["A"] += w * padded.A
                start[key]["B"] += w * padded.B
        scale_sum = 1.0
    factors: Adapter = {}
    for key, f in base.items():
        A = start[key]["A"] + scale_sum * tensors[f"A.{key}"] if "A" in uploads else f.A.clone()
        B = start[key]["B"] + scale_sum * tensors[f"B.{key}"] if "B" in uploads else f.B.clone()
        factors[key] = LoraFactors(A, B, 1.0)
    # what did not travel because it is frozen and shared is the base point's (FFA-LoRA's A)
    factors = server.hook.for_round(plan.round).incoming(factors, base)
    if not distributed:
        # the plain round's update is at the finishing sites' largest rank (what no one trained is not in it:
        # the quantization would leave ~1e-16 there, and a server optimizer would step it)
        top = max(server.strategy.adapter_rank(server.clients[k].rank) for k in clients)
        factors = {k: LoraFactors(f.A[:top], f.B[:, :top], 1.0) for k, f in factors.items()}
    if distributed:  # DP's base point: the server's own dense modules
        dense_start = dict(server.state.dense)
    else:  # what each site measured its change from: its download (encoded: the decoded values)
        dense_start = {
            name: sum(w * plan.starts[k].dense[name] for k, w in zip(clients, weights, strict=True))
            for name in server.state.dense
        }
    dense = {name: t + scale_sum * tensors[f"dense.{name}"] for name, t in dense_start.items()}
    update = ClientUpdate(-1, 0, factors, dense, round=plan.round, token=plan.token)
    return SummedUpdates(clients=list(clients), update=update, contributors=n, reference=base)
