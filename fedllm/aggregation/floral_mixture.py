"""FLoRAL mixture-of-LoRA layers on peft: C adaptors per module, a client router.

A client's FLoRAL adapter is one peft LoRA of rank ``C*r`` whose row/column
blocks are the C adaptors. A forward hook on ``lora_A`` multiplies block c of
its output by the router weight ``pi_c = softmax(logits / T)_c``, so the layer
computes ``sum_c pi_c * s * B_c A_c x`` exactly, and the router logits get
gradients. Baking the router into B (block c times pi_c) gives a plain LoRA of
rank ``C*r`` with the same forward: that is the personalized export.

Routers are shared by the whole model, or one per layer (``layers.N.``). The
router is the client's own: its parameters never leave the client; what the
server receives is, per target module, the probabilities its router gives
that module's adaptors, so each layer is weighted by its own router.

Options of the reference implementation (zeligism/FLoRAL):

* LoRA preconditioning replaces the adaptor gradients with
  ``(B^T B + eps I)^-1 grad A`` and ``grad B (A A^T + eps I)^-1`` per block;
* bias adaptors: C bias vectors per module, mixed by the router
  (``s * sum_c pi_c b_c`` added to the LoRA branch, peft's ``lora_bias``
  placement). The reference adds them only to layers that have a bias;
  here every target module gets them, since Llama's projections have none.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedllm.factors import Adapter, LoraFactors, lora_modules
from fedllm.protocol import HookSession


@dataclass
class MixtureOptions:
    """How a client's mixture is routed and trained (``aggregation.*`` of FLoRAL)."""

    num_adaptors: int
    temperature: float = 1.0
    noise: float = 1.0  # added to the logits while training: noise * U[0, 1) (the reference's), or * N(0, 1)
    noise_dist: str = "uniform"
    granularity: str = "client"  # one router per client, per transformer block, or per target module
    server_temperature: bool = (
        False  # upload softmax(logits / T) instead of softmax(logits) (the reference's)
    )
    stateful: bool = True
    router_lr: float = 1e-2
    router_optimizer: str = "same"  # a group of the local optimizer, or plain SGD of its own (the reference)
    precondition_eps: float = 0.0
    bias: bool = False


GRANULARITY = ("client", "block", "module")


def router_group(module_key: str, granularity: str) -> str:
    """The router a module's adaptors follow: the client's one router, its block's, or its own."""
    if granularity == "client":
        return "all"
    if granularity == "module":
        return module_key
    m = re.search(r"layers\.(\d+)\.", module_key)
    return f"layer{m.group(1)}" if m else module_key


def router_probs(logits: Tensor, temperature: float) -> Tensor:
    return torch.softmax(logits / temperature, dim=-1)


class MixtureSession(HookSession):
    """Hooks that turn a client's rank C*r adapter into its router-weighted mixture (see module docstring)."""

    def __init__(
        self,
        model: Any,
        adapter: str,
        spec: MixtureOptions,
        router: dict[str, Tensor] | None,
        biases: dict[str, Tensor] | None = None,
    ):
        self.spec = spec
        self.modules = lora_modules(model, adapter)
        self.adapter = adapter
        self.local_lr = spec.router_lr
        self.local_optimizer = spec.router_optimizer
        first = next(iter(self.modules.values())).lora_A[adapter].weight
        self.rank = first.shape[0] // spec.num_adaptors  # each adaptor's rank r (the adapter has C * r)
        groups = sorted({router_group(k, spec.granularity) for k in self.modules})
        device = next(iter(self.modules.values())).lora_A[adapter].weight.device
        self.logits = {
            g: torch.nn.Parameter(
                (router[g].clone() if router and g in router else torch.zeros(spec.num_adaptors)).to(
                    device, torch.float32
                )
            )
            for g in groups
        }
        # bias adaptors travel as their effective value s * b (s: the layer's LoRA scale), like folded factors
        self.biases, self._scales = {}, {key: float(m.scaling[adapter]) for key, m in self.modules.items()}
        if spec.bias:
            for key, m in self.modules.items():
                start = biases.get(key) if biases else None
                value = (
                    start / self._scales[key]
                    if start is not None
                    else torch.zeros(spec.num_adaptors, m.out_features)
                )
                self.biases[key] = torch.nn.Parameter(value.to(device, torch.float32))
        self._handles = []
        for key, module in self.modules.items():
            group = router_group(key, spec.granularity)
            self._handles.append(module.lora_A[adapter].register_forward_hook(self._scale_hook(group)))
            if spec.bias:
                self._handles.append(
                    module.lora_B[adapter].register_forward_hook(self._bias_hook(group, key))
                )
            if spec.precondition_eps > 0:
                self._handles += self._precondition(module)

    def weights(self, group: str, training: bool) -> Tensor:
        logits: Tensor = self.logits[group]
        if training and self.spec.noise > 0:
            draw = torch.rand_like if self.spec.noise_dist == "uniform" else torch.randn_like
            logits = logits + self.spec.noise * draw(logits)
        return router_probs(logits, self.spec.temperature)

    def _scale_hook(self, group: str) -> Callable[..., Tensor]:
        def hook(module: Any, inputs: Any, output: Tensor) -> Tensor:
            pi = self.weights(group, module.training).to(output.dtype)
            return output * pi.repeat_interleave(self.rank)

        return hook

    def _bias_hook(self, group: str, key: str) -> Callable[..., Tensor]:
        def hook(module: Any, inputs: Any, output: Tensor) -> Tensor:
            pi = self.weights(group, module.training).to(output.dtype)
            return output + pi @ self.biases[key].to(output.dtype)

        return hook

    def _precondition(self, module: Any) -> list[Any]:
        eps, r, c = self.spec.precondition_eps, self.rank, self.spec.num_adaptors
        wa, wb = module.lora_A[self.adapter].weight, module.lora_B[self.adapter].weight

        def grad_a(g: Tensor) -> Tensor:
            out = g.clone()
            for i in range(c):
                b = wb.detach()[:, i * r : (i + 1) * r].float()
                eye = torch.eye(r, device=g.device)
                out[i * r : (i + 1) * r] = torch.linalg.solve(
                    b.T @ b + eps * eye, g[i * r : (i + 1) * r].float()
                )
            return out

        def grad_b(g: Tensor) -> Tensor:
            out = g.clone()
            for i in range(c):
                a = wa.detach()[i * r : (i + 1) * r].float()
                eye = torch.eye(r, device=g.device)
                out[:, i * r : (i + 1) * r] = torch.linalg.solve(
                    a @ a.T + eps * eye, g[:, i * r : (i + 1) * r].float().T
                ).T
            return out

        return [wa.register_hook(grad_a), wb.register_hook(grad_b)]

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        """The router logits: trained on the client, never uploaded."""
        return {f"router.{g}": p for g, p in self.logits.items()}

    def shared_params(self) -> dict[str, torch.nn.Parameter]:
        """The bias adaptors: shared like the LoRA adaptors (uploaded and averaged per adaptor)."""
        return {f"bias.{k}": p for k, p in self.biases.items()}

    def module_probs(self, temperature: float | None = None) -> dict[str, Tensor]:
        """Each target module's noise-free router probabilities at ``temperature`` (default: the router's)."""
        temperature = self.spec.temperature if temperature is None else temperature
        with torch.no_grad():
            return {
                key: router_probs(self.logits[router_group(key, self.spec.granularity)], temperature)
                .detach()
                .cpu()
                for key in self.modules
            }

    def upload(self) -> dict[str, Tensor]:
        """What the server receives besides the factors: per-module router probabilities, and the bias
        adaptors.
        """
        # what the server weights adaptors by: softmax(logits), as the reference's server computes it, or
        # with the router's temperature (server_temperature)
        probs = self.module_probs(None if self.spec.server_temperature else 1.0)
        out = {f"router_probs.{k}": p for k, p in probs.items()}
        out.update({f"bias.{k}": self._scales[k] * b.detach().cpu() for k, b in self.biases.items()})
        return out

    def state(self) -> dict[str, Tensor]:
        """The router logits, by group: the client keeps them for its next round and its personalized
        model.
        """
        return {g: p.detach().cpu().clone() for g, p in self.logits.items()}

    def bake(self, factors: Adapter) -> tuple[Adapter, dict[str, Tensor]]:
        """A plain LoRA with this mixture's forward: the router folded into B (and into one bias per
        module).
        """
        probs = self.module_probs()
        out, biases = {}, {}
        for key, f in factors.items():
            pi = probs[key]
            out[key] = LoraFactors(f.A, f.B * pi.repeat_interleave(self.rank)[None, :], f.scale)
            if key in self.biases:
                biases[key] = self._scales[key] * (pi @ self.biases[key].detach().cpu())
        return out, biases

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
