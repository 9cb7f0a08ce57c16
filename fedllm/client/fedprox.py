"""FedProx: local SFT plus a proximal term towards the round's starting point.

Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020).
The local objective is ``f_k(theta) + mu/2 * ||theta - theta_global||^2`` over
the trainable LoRA (and dense) parameters; its gradient adds
``mu * (theta - theta_global)``. With ``mu = 0`` it is exactly plain SFT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedllm.client.base import ClientAlgorithm, OptimizerOptions, Params
from fedllm.options import nonneg, opt


@dataclass
class FedProxOptions(OptimizerOptions):
    mu: float = opt(0.01, "the proximal coefficient mu (0: plain SFT)", nonneg, ">= 0")


class FedProx(ClientAlgorithm):
    """SFT whose gradient is pulled towards the starting point by ``mu``.

    Server: any strategy; the client uploads only its adapter.
    """

    name = "fedprox"
    options = FedProxOptions

    def __init__(self, mu: float = 0.01, optimizer: str = "adamw") -> None:
        super().__init__(optimizer)
        self.mu = mu
        self.anchor: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, client_cfg) -> FedProx:
        o = cls.own_options(client_cfg)
        return cls(mu=o.mu, optimizer=o.optimizer)

    def begin(self, params: Params, state: dict[str, Any], download: dict) -> None:
        self.anchor = {k: p.detach().clone() for k, p in params.items()}

    def after_backward(self, params: Params) -> None:
        if self.mu:
            with torch.no_grad():
                for k, p in params.items():
                    prox = self.mu * (p - self.anchor[k])
                    p.grad = prox if p.grad is None else p.grad.add_(prox)
