"""The checks that the server, the strategies and the client algorithms share, below all of them.

A strategy that expects extras in an update (FLoRAL's router statistics, FedSA-LoRA's shared B, Fed-SB's R)
and an algorithm's server half (SCAFFOLD's control variate) check them as the server checks the factors:
against what the server knows of the client (:class:`Expected`), as finite float32 tensors of known shapes
(:func:`as_float32`), a failure being that client's :class:`ClientFailure` with a one-line reason. They live
here, under ``fedllm/`` beside the factors, so that no strategy or algorithm imports the server
(``fedllm/server/trust.py`` is the server's own use of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


class ClientFailure(RuntimeError):
    """A client's update is unusable (raised, timed out, non-finite, mis-shaped, lying)."""


@dataclass
class Expected:
    """What the server expects of one client's update this round (all of it known before the reply)."""

    client_id: int
    num_examples: int
    rank: int  # the adapter's rank (FLoRAL: C * r)
    scale: float
    modules: dict[str, tuple[int, int]]  # module -> (out, in)
    dense: dict[str, torch.Size] = field(default_factory=dict)
    timeout_s: float = 0.0
    round: int | None = None  # the round the update must answer (None: not checked, plain use of the math)
    token: str | None = None  # and the token of that round's plan
    asked: dict[str, Any] = field(default_factory=dict)  # the strategy extras the client downloaded

    def param_shapes(self) -> dict[str, torch.Size]:
        """The client's trainable tensors by name (``<module>.A/.B`` and the dense modules), at its rank."""
        out = {}
        for key, (out_f, in_f) in self.modules.items():
            out[f"{key}.A"] = torch.Size((self.rank, in_f))
            out[f"{key}.B"] = torch.Size((out_f, self.rank))
        return {**out, **self.dense}


MAX_REASON = 300  # characters of a failure's reason kept in the log and in metrics.jsonl


def one_line(text: str) -> str:
    """A failure's reason as one short line (an exception's message can be pages long)."""
    first = " ".join(str(text).strip().splitlines()[:1]) if str(text).strip() else ""
    return first if len(first) <= MAX_REASON else first[: MAX_REASON - 3] + "..."


def as_float32(name: str, t: Any, shape: torch.Size | tuple | None = None) -> Tensor:
    """``t`` as a finite float32 tensor of ``shape``; ClientFailure naming ``name`` otherwise."""
    if not isinstance(t, Tensor):
        raise ClientFailure(f"{name} is not a tensor ({type(t).__name__})")
    if t.layout != torch.strided or t.is_quantized:
        raise ClientFailure(f"{name} is a {t.layout} tensor: expected a dense (strided) one")
    if not (t.is_floating_point() and not t.is_complex()):
        raise ClientFailure(f"{name} has dtype {t.dtype}: expected a floating-point tensor")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ClientFailure(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    out = t.detach().to("cpu", torch.float32, copy=True)  # the server's own copy (clipping scales it)
    if not torch.isfinite(out).all():
        raise ClientFailure(f"{name} holds non-finite values (or values beyond float32)")
    return out


def change_norm(parts: list[tuple[Tensor, Tensor]]) -> float:
    """The L2 norm of the change over ``(value, reference)`` pairs, in float64."""
    return math.sqrt(sum(float((v.double() - r.double()).pow(2).sum()) for v, r in parts))


def cap_weights(weights: list[float], cap: float) -> list[float]:
    """``weights`` (summing to 1) with none above ``cap``: the excess goes to the others in proportion.

    Water-filling: clients over the cap are fixed at it and the rest are
    renormalized, repeated until none is over. When ``cap`` is below 1/K no
    share can satisfy it; every client then weighs 1/K.
    """
    k = len(weights)
    if cap >= 1 or k == 0:
        return list(weights)
    if cap * k <= 1:
        return [1 / k] * k
    fixed: set[int] = set()
    out = list(weights)
    while True:
        free = [i for i in range(k) if i not in fixed]
        mass = 1 - cap * len(fixed)
        total = sum(weights[i] for i in free)
        out = [
            cap if i in fixed else (weights[i] / total * mass if total > 0 else mass / len(free))
            for i in range(k)
        ]
        over = {i for i in free if out[i] > cap * (1 + 1e-12)}
        if not over:
            return out
        fixed |= over


def finite_tensors(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def clip_(changes: list[Tensor], clip_norm: float) -> float:
    """Scale the change tensors in place to a joint L2 norm of at most ``clip_norm``; returns the norm they
    had."""
    norm = math.sqrt(sum(float(c.double().pow(2).sum()) for c in changes))
    if norm > clip_norm:
        for c in changes:
            c.mul_(clip_norm / norm)
    return norm
