"""Per-FedAvg: a MAML-style local objective for personalization.

Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach" (NeurIPS 2020). Each
local step draws three batches D, D', D'':

* inner step: ``theta' = theta - alpha * grad f(theta; D)``
* FO:  ``theta <- theta - beta * grad f(theta'; D')``
* HF:  ``theta <- theta - beta * (I - alpha * H(theta; D'')) grad f(theta'; D')``,
  with the Hessian-vector product from a central difference of gradients
  (``(grad f(theta + d v) - grad f(theta - d v)) / 2d``), as in the paper. Both
  gradients of the difference see the same dropout masks (one RNG state), or
  the quotient would measure the masks' difference instead of the curvature.

Steps are plain SGD: ``beta`` is ``client.sgd_lr`` and ``alpha`` is
``client.perfedavg.alpha`` (default: ``beta``). Every gradient averages
``client.grad_accum`` micro-batches. Personalization = the global model plus
one (or k) steps of size alpha on the client's own data, which is what the
objective trains it to be good for. As in the paper nothing is clipped: not
the inner step, not the personalization step (the same alpha step the
meta-objective trained for), and not the meta-gradient unless
``client.perfedavg.clip_meta`` asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fedllm.client.base import ClientAlgorithm, Params, accumulate
from fedllm.options import nonneg, one_of, opt, positive


@dataclass
class PerFedAvgOptions:
    variant: str = opt("fo", "first-order (fo) or Hessian-free (hf) meta-gradient", *one_of("fo", "hf"))
    alpha: float = opt(0.0, "the inner step size alpha (0: the same as client.sgd_lr)", nonneg, ">= 0")
    fd_delta: float = opt(
        1e-3, "HF: the finite-difference step of the Hessian-vector product", positive, "> 0"
    )
    clip_meta: bool = opt(
        False,
        "clip the meta-gradient to client.max_grad_norm (the paper clips nothing; its inner and "
        "personalization steps are never clipped)",
    )


def _rng_state() -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class PerFedAvg(ClientAlgorithm):
    """MAML-style local steps with SGD.

    Server: any parameter-averaging strategy (the meta-model is averaged).
    """

    name = "perfedavg"
    plain_first_step = False
    options = PerFedAvgOptions
    trains_local_params = False  # the meta-objective is over the shared parameters only (no FLoRAL routers)

    def __init__(
        self, alpha: float = 0.0, variant: str = "fo", fd_delta: float = 1e-3, clip_meta: bool = False
    ) -> None:
        if variant not in ("fo", "hf"):
            raise ValueError(f"client.perfedavg.variant = {variant!r}: expected fo or hf")
        super().__init__("sgd")
        self.alpha, self.variant, self.fd_delta, self.clip_meta = alpha, variant, fd_delta, clip_meta

    @classmethod
    def from_config(cls, client_cfg) -> PerFedAvg:
        o = cls.own_options(client_cfg)
        return cls(alpha=o.alpha, variant=o.variant, fd_delta=o.fd_delta, clip_meta=o.clip_meta)

    def inner_lr(self, work) -> float:
        return self.alpha or work.sgd_lr

    def personal_lr(self, work) -> float:
        return self.inner_lr(work)  # the inner step the meta-objective trained for

    def step_clip(self, work) -> float:
        """The meta-gradient is clipped only with ``client.perfedavg.clip_meta`` (the paper clips nothing)."""
        return work.max_grad_norm if self.clip_meta else 0.0

    def personal_clip(self, work) -> float:
        """Personalization is the unclipped inner step alpha, the one the meta-objective trained for."""
        return 0.0

    def _grads(
        self,
        model,
        params: Params,
        batches: Iterator[dict[str, Tensor]],
        work,
        accelerator,
    ) -> tuple[dict[str, Tensor], float]:
        """Gradient of the mean loss over ``grad_accum`` micro-batches, and that loss."""
        for p in params.values():
            p.grad = None
        total = accumulate(model, batches, work, accelerator)
        grads = {
            k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for k, p in params.items()
        }
        for p in params.values():
            p.grad = None
        return grads, total

    @torch.no_grad()
    def _shift(self, params: Params, direction: dict[str, Tensor], step: float) -> None:
        for k, p in params.items():
            p.add_(direction[k].to(p.device), alpha=step)

    def local_step(self, model, params, batches, work, accelerator) -> float:
        alpha = self.inner_lr(work)
        start = {k: p.detach().clone() for k, p in params.items()}
        g_inner, loss = self._grads(model, params, batches, work, accelerator)
        self._shift(params, g_inner, -alpha)
        g_outer, _ = self._grads(model, params, batches, work, accelerator)
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(start[k])
        update = g_outer
        if self.variant == "hf":
            hvp_batches = [next(batches) for _ in range(work.grad_accum)]  # D'' for both sides
            d = self.fd_delta
            rng = _rng_state()  # the same dropout masks on both sides of the difference
            self._shift(params, g_outer, d)
            g_plus, _ = self._grads(model, params, iter(hvp_batches), work, accelerator)
            _set_rng_state(rng)
            self._shift(params, g_outer, -2 * d)
            g_minus, _ = self._grads(model, params, iter(hvp_batches), work, accelerator)
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(start[k])
            update = {k: g_outer[k] - alpha * (g_plus[k] - g_minus[k]) / (2 * d) for k in params}
        for k, p in params.items():
            p.grad = update[k].to(p.device)
        return loss
