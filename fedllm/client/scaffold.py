"""SCAFFOLD-style control variates on the LoRA parameters.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning" (ICML 2020); the SCAFFLSA analysis of federated linear stochastic
approximation shows that control variates remove the heterogeneity bias of
local training while keeping the linear speed-up in the number of clients.

The objective is ``sum_k p_k f_k`` with ``p_k = n_k / n`` (``n``: the examples
of all clients), the one the server's example-weighted average of the models
descends. Each local step uses the corrected gradient ``g - c_k + c``. After
``K`` steps of sizes ``eta_1..eta_K`` the client sets (option II)
``c_k+ = c_k - c + (theta_0 - theta_K) / sum_t eta_t`` and uploads
``delta c_k = c_k+ - c_k``; the server keeps ``c = sum_k p_k c_k`` over all
clients by adding ``sum_{k in S} p_k delta c_k``. (Weighting ``c`` uniformly
while averaging the models by ``p_k``, as the paper's equal-size setting
does, would converge to the minimizer of ``(1/N) sum f_k`` instead.) Controls
of clients with smaller ranks are the leading rows/columns of the server's
(largest-rank) control, as with FedIT's zero-padding.

With ``client.scaffold_optimizer=adamw`` the corrected gradient goes through
AdamW instead of SGD, as OpenFedLLM does: a practical variant outside the
analysis (``sum_t eta_t`` then only approximates the step taken).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedllm.client.base import ClientAlgorithm, Params, accumulate
from fedllm.protocol import AlgorithmServer


def _fit(t: Tensor, shape: torch.Size) -> Tensor:
    """Leading block of ``t`` in ``shape``, zero-padded where ``t`` is smaller."""
    out = torch.zeros(shape, dtype=t.dtype)
    region = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, shape, strict=True))
    out[region] = t[region]
    return out


class ScaffoldServer(AlgorithmServer):
    """The server control variate ``c``, kept at the largest rank, and its example-weighted update."""

    def __init__(self) -> None:
        self.c: dict[str, Tensor] = {}

    @classmethod
    def from_config(cls, client_cfg) -> ScaffoldServer:
        return cls()

    def download(self, rank: int) -> dict[str, Tensor]:
        """``c`` fitted to a client of adapter rank ``rank``: the leading rows of A, columns of B (empty at
        first).
        """
        out = {}
        for k, t in self.c.items():
            shape = list(t.shape)
            if k.endswith(".A"):
                shape[0] = rank
            elif k.endswith(".B"):
                shape[1] = rank
            out[k] = _fit(t, torch.Size(shape))
        return out

    def update(self, updates: list, population_examples: int) -> None:
        """``c += sum_{k in S} (n_k / n) delta c_k``: keeps ``c = sum_k p_k c_k`` over all clients."""
        keys = {k for u in updates for k in u.extras if k.startswith("dc.")}
        for key in keys:
            name = key[3:]
            mine = [u for u in updates if key in u.extras]
            shape = torch.Size(
                max(u.extras[key].shape[i] for u in mine) for i in range(mine[0].extras[key].dim())
            )
            step = sum((u.num_examples / population_examples) * _fit(u.extras[key], shape) for u in mine)
            current = _fit(self.c[name], shape) if name in self.c else torch.zeros(shape)
            self.c[name] = current + step

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.c)

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        self.c = dict(tensors)


class Scaffold(ClientAlgorithm):
    """Drift-corrected local steps (SGD by default, the setting of the analysis).

    Server: a strategy that averages parameters (FedIT); the control variate
    deltas travel as extra uploads and the server control as extra download.
    """

    name = "scaffold"
    server_half = ScaffoldServer
    needs_parameter_averaging = True

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self._start: dict[str, Tensor] = {}
        self._c: dict[str, Tensor] = {}
        self._ck: dict[str, Tensor] = {}

    @classmethod
    def from_config(cls, client_cfg) -> Scaffold:
        return cls(optimizer=client_cfg.scaffold_optimizer)

    def begin(self, params: Params, state: dict[str, Any], download: dict[str, Tensor]) -> None:
        self._start = {k: p.detach().clone() for k, p in params.items()}
        self._c = {
            k: _fit(download[k], p.shape) if k in download else torch.zeros_like(p) for k, p in params.items()
        }
        self._ck = {k: state.get(k, torch.zeros_like(p)) for k, p in params.items()}

    def local_step(self, model, params, batches, plan, accelerator) -> float:
        loss = accumulate(model, batches, plan, accelerator)
        with torch.no_grad():
            for k, p in params.items():
                correction = self._c[k].to(p.device) - self._ck[k].to(p.device)
                p.grad = correction if p.grad is None else p.grad.add_(correction)
        return loss

    def finish(
        self, params: Params, plan, state: dict[str, Any], step_sizes: list[float]
    ) -> dict[str, Tensor]:
        travelled = sum(step_sizes)  # sum_t eta_t: the schedule's real steps, not K * peak lr
        new_ck = {
            k: self._ck[k] - self._c[k] + (self._start[k] - p.detach().cpu()) / travelled
            for k, p in params.items()
        }
        deltas = {f"dc.{k}": new_ck[k] - self._ck[k] for k in params}
        state.clear()
        state.update(new_ck)  # c_k stays with the client
        return deltas
