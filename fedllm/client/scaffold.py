"""SCAFFOLD-style control variates on the LoRA parameters.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning" (ICML 2020); the SCAFFLSA analysis of federated linear stochastic
approximation shows that control variates remove the heterogeneity bias of
local training while keeping the linear speed-up in the number of clients.

Each local step uses the corrected gradient ``g - c_k + c``. After ``K``
steps with step size ``eta`` the client sets (option II)
``c_k+ = c_k - c + (theta_0 - theta_K) / (K * eta)`` and uploads
``delta c_k = c_k+ - c_k``; the server sets ``c += |S|/N * mean(delta c_k)``.
Controls of clients with smaller ranks are the leading rows/columns of the
server's (largest-rank) control, as with FedIT's zero-padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedllm.client.base import ClientAlgorithm, Params, accumulate
from fedllm.config import ConfigError


def _fit(t: Tensor, shape: torch.Size) -> Tensor:
    """Leading block of ``t`` in ``shape``, zero-padded where ``t`` is smaller."""
    out = torch.zeros(shape, dtype=t.dtype)
    region = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, shape, strict=True))
    out[region] = t[region]
    return out


class Scaffold(ClientAlgorithm):
    """Drift-corrected local steps with SGD (the setting of the analysis).

    Server: a strategy that averages parameters (FedIT); the control variate
    deltas travel as extra uploads and the server control as extra download.
    """

    name = "scaffold"

    def __init__(self) -> None:
        super().__init__("sgd")
        self.server_c: dict[str, Tensor] = {}
        self._start: dict[str, Tensor] = {}
        self._c: dict[str, Tensor] = {}
        self._ck: dict[str, Tensor] = {}

    @classmethod
    def check_config(cls, cfg) -> None:
        from fedllm.aggregation import STRATEGIES

        strategy = STRATEGIES[cfg.aggregation.name]
        if not strategy.averages_parameters:
            raise ConfigError(
                f"client.algorithm = scaffold needs a strategy that averages parameters (fedit); "
                f"aggregation.name = {cfg.aggregation.name} changes the parameter space every round "
                f"(merged, stacked or re-factorized updates), so control variates would refer to parameters "
                f"that no longer exist"
            )

    @classmethod
    def from_config(cls, client_cfg) -> Scaffold:
        return cls()

    def download_numel(self, params: Params) -> int:
        return sum(p.numel() for p in params.values()) if self.server_c else 0

    def begin(self, params: Params, state: dict[str, Any]) -> None:
        self._start = {k: p.detach().clone() for k, p in params.items()}
        self._c = {k: _fit(self.server_c[k], p.shape) if k in self.server_c else torch.zeros_like(p)
                   for k, p in params.items()}
        self._ck = {k: state.get(k, torch.zeros_like(p)) for k, p in params.items()}

    def local_step(self, model, params, batches, plan, accelerator) -> float:
        loss = accumulate(model, batches, plan, accelerator)
        with torch.no_grad():
            for k, p in params.items():
                correction = self._c[k].to(p.device) - self._ck[k].to(p.device)
                p.grad = correction if p.grad is None else p.grad.add_(correction)
        return loss

    def finish(self, params: Params, plan, state: dict[str, Any]) -> dict[str, Tensor]:
        denom = plan.steps * plan.lr
        new_ck = {k: self._ck[k] - self._c[k] + (self._start[k] - p.detach().cpu()) / denom for k, p in params.items()}
        deltas = {f"dc.{k}": new_ck[k] - self._ck[k] for k in params}
        state.clear()
        state.update(new_ck)  # c_k stays with the client
        return deltas

    def server_update(self, updates: list, num_clients: int) -> None:
        keys = {k for u in updates for k in u.extras if k.startswith("dc.")}
        for key in keys:
            name = key[3:]
            deltas = [u.extras[key] for u in updates if key in u.extras]
            shape = torch.Size(max(d.shape[i] for d in deltas) for i in range(deltas[0].dim()))
            mean = sum(_fit(d, shape) for d in deltas) / len(deltas)
            current = _fit(self.server_c[name], shape) if name in self.server_c else torch.zeros(shape)
            self.server_c[name] = current + (len(deltas) / num_clients) * mean

    def server_state(self) -> dict[str, Tensor]:
        return dict(self.server_c)

    def load_server_state(self, tensors: dict[str, Tensor]) -> None:
        self.server_c = dict(tensors)
