"""Per-FedAvg: a MAML-style local objective for personalization.

Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach" (NeurIPS 2020). Each
local step draws three batches D, D', D'':

* inner step: ``theta' = theta - alpha * grad f(theta; D)``
* FO:  ``theta <- theta - beta * grad f(theta'; D')``
* HF:  ``theta <- theta - beta * (I - alpha * H(theta; D'')) grad f(theta'; D')``,
  with the Hessian-vector product from a central difference of gradients
  (``(grad f(theta + d v) - grad f(theta - d v)) / 2d``), as in the paper.

Personalization = the global model plus one (or k) plain steps on the
client's own data, which is what the objective trains it to be good for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedllm.client.base import ClientAlgorithm, Params, backward, lm_loss


def _grads(model, params: Params, batch, accelerator) -> tuple[dict[str, Tensor], float]:
    for p in params.values():
        p.grad = None
    loss = lm_loss(model, batch, accelerator)
    backward(loss, accelerator)
    grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return grads, loss.item()


class PerFedAvg(ClientAlgorithm):
    """MAML-style local steps; the outer step size beta is ``client.lr`` (SGD).

    Server: any parameter-averaging strategy (the meta-model is averaged).
    """

    name = "perfedavg"

    def __init__(self, alpha: float = 1e-3, variant: str = "fo", fd_delta: float = 1e-3) -> None:
        if variant not in ("fo", "hf"):
            raise ValueError(f"client.perfedavg_variant = {variant!r}: expected fo or hf")
        super().__init__("sgd", alpha=alpha, variant=variant)
        self.alpha, self.variant, self.fd_delta = alpha, variant, fd_delta

    @classmethod
    def from_config(cls, client_cfg) -> PerFedAvg:
        return cls(alpha=client_cfg.perfedavg_alpha, variant=client_cfg.perfedavg_variant)

    def personal_lr(self, plan) -> float:
        return self.alpha  # the inner step the meta-objective trained for

    @torch.no_grad()
    def _shift(self, params: Params, direction: dict[str, Tensor], step: float) -> None:
        for k, p in params.items():
            p.add_(direction[k].to(p.device), alpha=step)

    def local_step(self, model, params, batches, plan, accelerator) -> float:
        start = {k: p.detach().clone() for k, p in params.items()}
        g_inner, loss = _grads(model, params, next(batches), accelerator)
        self._shift(params, g_inner, -self.alpha)
        g_outer, _ = _grads(model, params, next(batches), accelerator)
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(start[k])
        update = g_outer
        if self.variant == "hf":
            batch = next(batches)
            d = self.fd_delta
            self._shift(params, g_outer, d)
            g_plus, _ = _grads(model, params, batch, accelerator)
            self._shift(params, g_outer, -2 * d)
            g_minus, _ = _grads(model, params, batch, accelerator)
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(start[k])
            update = {k: g_outer[k] - self.alpha * (g_plus[k] - g_minus[k]) / (2 * d) for k in params}
        for k, p in params.items():
            p.grad = update[k].to(p.device)
        return loss
