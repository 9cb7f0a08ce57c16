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

With ``client.scaffold.optimizer=adamw`` the corrected gradient goes through
AdamW instead of SGD, as OpenFedLLM does: a practical variant outside the
analysis (``sum_t eta_t`` then only approximates the step taken).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedllm.checks import as_float32, change_norm
from fedllm.client.base import ClientAlgorithm, Params
from fedllm.options import one_of, opt
from fedllm.protocol import AlgorithmServer


@dataclass
class ScaffoldOptions:
    optimizer: str = opt(
        "sgd",
        "SCAFFOLD's optimizer: sgd (the analysed setting) or adamw (the corrected gradient through AdamW, as "
        "OpenFedLLM does)",
        *one_of("sgd", "adamw"),
    )


def _at_rank(name: str, shape: torch.Size, rank: int) -> torch.Size:
    """The shape of tensor ``name`` (``<module>.A`` / ``.B`` / dense) for an adapter of rank ``rank``."""
    out = list(shape)
    if name.endswith(".A"):
        out[0] = rank
    elif name.endswith(".B"):
        out[1] = rank
    return torch.Size(out)


def _fit(t: Tensor, shape: torch.Size) -> Tensor:
    """Leading block of ``t`` in ``shape``, zero-padded where ``t`` is smaller."""
    out = torch.zeros(shape, dtype=t.dtype)
    region = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, shape, strict=True))
    out[region] = t[region]
    return out


SCALE = "scale"  # in a download: the server's scale of this client's last taken change of c_k


class ScaffoldServer(AlgorithmServer):
    """The server control variate ``c``, kept at the largest adapter rank, and its example-weighted update.

    Every client downloads its own leading block of ``c`` (rows of A, columns
    of B), so ``c = sum_k p_k c_k`` holds at every rank, whichever clients a
    round samples.
    """

    def __init__(self) -> None:
        self.c: dict[str, Tensor] = {}
        self.shapes: dict[str, torch.Size] = {}
        self.scales: dict[int, float] = {}  # how the server scaled each client's last taken change (1: not)
        self._round_scales: dict[int, float] = {}

    @classmethod
    def from_config(cls, client_cfg) -> ScaffoldServer:
        return cls()

    def bind(self, param_shapes: dict[str, torch.Size]) -> None:
        self.shapes = dict(param_shapes)

    def download(self, rank: int, client_id: int | None = None) -> dict[str, Tensor]:
        """``c`` fitted to a client of adapter rank ``rank`` (nothing before the first update: c = 0), and
        how the server scaled that client's last taken change of c_k when it clipped it."""
        out = {k: _fit(t, _at_rank(k, t.shape, rank)) for k, t in self.c.items()}
        if client_id is not None and self.scales.get(client_id, 1.0) != 1.0:
            out[SCALE] = torch.tensor(self.scales[client_id])
        return out

    def accept_extras(self, extras: dict[str, Tensor], exp) -> dict[str, Tensor]:
        """``dc.<name>`` for every trainable tensor of the client, at the client's rank, finite."""
        return {
            f"dc.{k}": as_float32(f"dc.{k}", extras.get(f"dc.{k}"), s) for k, s in exp.param_shapes().items()
        }

    def clip(self, updates: list, ratio: float) -> int:
        """Scale each client's control-variate change to at most ``ratio`` x the round's median."""
        if not updates:
            return 0
        norms = [change_norm([(t, torch.zeros_like(t)) for t in u.extras.values()]) for u in updates]
        cap = ratio * float(torch.tensor(norms).median())
        clipped = 0
        self._round_scales = {}
        for u, n in zip(updates, norms, strict=True):
            if n > cap > 0:
                u.extras = {k: t * (cap / n) if k.startswith("dc.") else t for k, t in u.extras.items()}
                self._round_scales[u.client_id] = cap / n
                clipped += 1
        return clipped

    def update(self, updates: list, population_weights: dict[int, float]) -> None:
        """``c += sum_{k in S} p_k delta c_k``: keeps ``c = sum_k p_k c_k`` over all clients (a clipped
        client's scale is remembered: its next download tells it, and it scales its own c_k alike)."""
        for u in updates:
            self.scales[u.client_id] = self._round_scales.get(u.client_id, 1.0)
        self._round_scales = {}
        for name, shape in self.shapes.items():
            current = self.c.get(name, torch.zeros(shape))
            step = sum(
                population_weights[u.client_id] * _fit(u.extras[f"dc.{name}"], shape)
                for u in updates
                if f"dc.{name}" in u.extras
            )
            self.c[name] = current + step

    def state_dict(self) -> dict[str, Tensor]:
        scales = {f"{SCALE}.{k}": torch.tensor(s) for k, s in self.scales.items() if s != 1.0}
        return {**self.c, **scales}

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        self.c = {k: t for k, t in tensors.items() if not k.startswith(SCALE)}
        self.scales = {
            int(k.rsplit(".", 1)[1]): float(t) for k, t in tensors.items() if k.startswith(f"{SCALE}.")
        }


class Scaffold(ClientAlgorithm):
    """Drift-corrected local steps (SGD by default, the setting of the analysis).

    Server: a strategy that averages parameters (FedIT); the control variate
    deltas travel as extra uploads and the server control as extra download.
    """

    name = "scaffold"
    plain_first_step = False
    server_half = ScaffoldServer
    options = ScaffoldOptions
    paper_preset = {
        "client.scheduler": "constant",
        "client.warmup_ratio": 0.0,
        "client.max_grad_norm": 0.0,
    }
    server_state_per_parameter = True
    uploads_extras = True
    keeps_state = True
    needs_parameter_averaging = True

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self._start: dict[str, Tensor] = {}
        self._c: dict[str, Tensor] = {}
        self._ck: dict[str, Tensor] = {}

    @classmethod
    def check_config(cls, cfg) -> None:
        ranks = sorted(set(cfg.lora.ranks) | set(cfg.lora.rank_distribution))
        if cfg.lora.use_rslora and len(ranks) > 1:
            raise ValueError(
                f"client.algorithm = scaffold with lora.use_rslora and mixed ranks {ranks}: each rank's B "
                "then "
                "has another scale (alpha / sqrt(r)), so the control variates of different ranks mix units "
                "while the model is averaged with the scale folded in; use one rank, or lora.use_rslora=false"
            )

    def begin(self, params: Params, state: dict[str, Any], download: dict[str, Tensor]) -> None:
        """The start, c and c_k on the model's device (the download and the client state are on the CPU)."""
        self._start = {k: p.detach().clone() for k, p in params.items()}
        self._c = {
            k: (_fit(download[k], p.shape) if k in download else torch.zeros(p.shape)).to(p.device, p.dtype)
            for k, p in params.items()
        }
        self._ck = {k: state.get(k, torch.zeros(p.shape)).to(p.device, p.dtype) for k, p in params.items()}

    def correct(self, params: Params) -> None:
        """The corrected gradient ``g - c_k + c`` (after the clip of ``g``)."""
        with torch.no_grad():
            for k, p in params.items():
                correction = self._c[k] - self._ck[k]
                p.grad = correction.clone() if p.grad is None else p.grad.add_(correction)

    def settle(self, old, new, download):
        """c_k as the server counted it: when the server scaled this client's change of c_k (its clip of
        control-variate changes), the client takes the same scaled change, so ``c = sum_k p_k c_k`` holds."""
        scale = float(download.get(SCALE, torch.tensor(1.0)))
        if scale == 1.0:
            return new
        return {
            k: old.get(k, torch.zeros_like(v)) + scale * (v - old.get(k, torch.zeros_like(v)))
            for k, v in new.items()
        }

    def finish(
        self, params: Params, work, state: dict[str, Any], step_sizes: list[float]
    ) -> dict[str, Tensor]:
        """The new c_k and its change, computed on the model's device and read out to the CPU."""
        travelled = sum(step_sizes)  # sum_t eta_t: the schedule's real steps, not K * peak lr
        new_ck = {
            k: self._ck[k] - self._c[k] + (self._start[k] - p.detach()) / travelled for k, p in params.items()
        }
        deltas = {f"dc.{k}": (new_ck[k] - self._ck[k]).float().cpu() for k in params}
        state.clear()
        state.update({k: v.float().cpu() for k, v in new_ck.items()})  # c_k stays with the client
        return deltas
