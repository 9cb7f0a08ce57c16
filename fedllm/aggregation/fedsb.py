"""Fed-SB: every client trains one small r x r matrix between two fixed, data-derived bases.

Singhal et al., "Fed-SB: A Silver Bullet for Extreme Communication Efficiency and Performance in (Private)
Federated LoRA Fine-Tuning" (2025, code: CERT-Lab/fed-sb), on LoRA-SB (Ponkshe et al., 2024). The adapter is
``W = W0 + B R A``: ``B`` (out x r) and ``A`` (r x in) are fixed after an initialization that approximates
the first step of full fine-tuning, and only the ``r x r`` matrix ``R`` is trained. With ``B`` and ``A``
shared, ``sum_k p_k B R_k A = B (sum_k p_k R_k) A``: averaging R is the exact average of the clients'
updates, the upload is ``r^2`` per module whatever the number of clients, and the aggregate is a plain
weighted sum (central DP noises R; ``B`` and ``A`` have orthonormal columns and rows, so a change of R has
the norm of the change of the product it makes).

The initialization (LoRA-SB): the first step of full fine-tuning with Adam, ``-lr sign(g)`` with ``g``
the gradient of the loss at ``W0`` (Adam's first step is exactly that, up to its epsilon), truncated by
SVD to rank r: ``-lr sign(g) ~ U S V^T``, ``B = U``, ``A = V^T``, ``R = S``. The official code takes ``g``
centrally, summed over 50 training examples, before the federation starts. Here the federation takes it:
the first round is an **initialization round** in which each sampled client takes that one Adam step on a
dense copy of each target module's weight (``aggregation.fedsb.init_examples`` examples accumulated into
one step at ``aggregation.fedsb.init_lr``, the client's adapter frozen) and uploads it (``out x in`` per
module, once, counted); the server averages the steps (weights ``p_k``; under central DP clipped and
noised like any update) and takes the SVD of the average (post-processing). A round in which no client's
step arrived leaves the run uninitialized and the next round is an initialization round again. The model
after it is ``W0`` plus the rank-r part of the average first step, as LoRA-SB's; from the next round on,
every client downloads ``B``, ``A`` and ``R``, trains ``R`` and uploads it.

Heterogeneous ranks: ``B`` and ``A`` hold the ``r_max`` leading singular directions, ordered by energy; a
client of rank ``r_k`` trains the leading ``r_k x r_k`` block of R on the leading ``r_k`` directions and
uploads that block (``r_k^2``); the server puts it into the R the client downloaded, so the entries it did
not train stay at the global value (no client is averaged in where it had no say). The global model for
evaluation and export is the plain LoRA adapter ``A``, ``B R`` (``global_adapter``).

The official aggregation (``fed_sb/fed/fed_agg.py``, ``aggregate_models_fed_sb``) is the uniform mean of the
clients' R: ``aggregation.weighting=uniform`` here (tests/test_fedsb.py runs both on the same arrays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fedllm.aggregation.base import GlobalState, RoundContext, RoundResult, Strategy
from fedllm.aggregation.ffa import Frozen
from fedllm.checks import ClientFailure, Expected, as_float32
from fedllm.factors import Adapter, LoraFactors, unprefixed
from fedllm.options import chosen_key, chosen_option, opt
from fedllm.protocol import ClientHook, ClientUpdate, HookSession

STEP = "fedsb_step."  # a client's first Adam step on a module's dense weight (the initialization round)
CORE = "fedsb_R."  # the r x r matrix of a module: downloaded (the global one), trained, uploaded
RANK = "fedsb_rank"  # the bases' width (the federation's largest rank), kept in the state


@dataclass
class FedSBOptions:
    init_examples: int = opt(
        32,
        "examples each client of the initialization round accumulates into its one full-fine-tuning step "
        "(LoRA-SB's gradient estimate; the official code uses 50, centrally)",
        lambda x: x >= 1,
        "an integer >= 1",
    )
    init_lr: float = opt(
        1e-4,
        "the learning rate of that step, -lr sign(g): the scale of the initial B R A (its directions do not "
        "depend on it)",
        lambda x: x > 0,
        "> 0",
    )


class FedSBInit(Frozen):
    """The initialization round: one Adam step on a zero dense delta ``D`` of each module's weight,
    ``y = W0 x + B A x + D x`` (``B = 0``: the base), taken over ``init_examples`` examples; uploads ``D``."""

    def __init__(self, model: Any, adapter: str, init_examples: int, init_lr: float) -> None:
        super().__init__(model, adapter, "AB")
        self.init_examples, self.init_lr = init_examples, init_lr
        self.deltas: dict[str, torch.nn.Parameter] = {}
        for key, m in self.modules.items():
            w = m.lora_B[adapter].weight
            out_f, in_f = w.shape[0], m.lora_A[adapter].weight.shape[1]
            d = torch.nn.Parameter(torch.zeros(out_f, in_f, device=w.device, dtype=torch.float32))
            self.deltas[key] = d
            # the LoRA branch's input (after its dropout) is read where it enters A, and D x is added where
            # the branch leaves B: both modules are this adapter's own, so client-batched slots stay apart
            seen: dict[str, Tensor] = {}
            self.handles.append(
                m.lora_A[adapter].register_forward_pre_hook(
                    lambda _m, args, seen=seen: seen.update(x=args[0])
                )
            )
            scaling = float(m.scaling[adapter])
            self.handles.append(
                m.lora_B[adapter].register_forward_hook(
                    lambda _m, _args, out, seen=seen, d=d, s=scaling: (
                        out + F.linear(seen.pop("x").to(d.dtype), d).to(out.dtype) / s
                    )
                )
            )

    def shared_params(self) -> dict[str, torch.nn.Parameter]:
        return {f"{STEP}{k}": d for k, d in self.deltas.items()}

    def local_work(self, work: Any) -> Any:
        """One Adam step over ``init_examples`` examples at ``init_lr``, unclipped and undecayed: the step
        is ``-init_lr g / (|g| + eps)``, LoRA-SB's ``-lr sign(g)``."""
        accum = max(1, math.ceil(self.init_examples / work.batch_size))
        return replace(
            work,
            steps=1,
            grad_accum=accum,
            lr=self.init_lr,
            scheduler="constant",
            warmup_ratio=0.0,
            weight_decay=0.0,
            max_grad_norm=0.0,
        )

    def upload(self) -> dict[str, Tensor]:
        return {f"{STEP}{k}": d.detach().to("cpu", torch.float32).clone() for k, d in self.deltas.items()}


class FedSBCore(Frozen):
    """``y = W0 x + s B (R / s) A x``: the downloaded ``R``'s leading ``r_k x r_k`` block, trained
    (scale-free: the hook divides out the layer's LoRA scale, so R is in the server's units)."""

    def __init__(self, model: Any, adapter: str, cores: dict[str, Tensor]) -> None:
        super().__init__(model, adapter, "AB")
        self.cores: dict[str, torch.nn.Parameter] = {}
        for key, m in self.modules.items():
            lin = m.lora_A[adapter]
            r = lin.weight.shape[0]
            R = torch.nn.Parameter(cores[key][:r, :r].to(lin.weight.device, torch.float32).clone())
            self.cores[key] = R
            scaling = float(m.scaling[adapter])
            self.handles.append(
                lin.register_forward_hook(
                    lambda _m, _args, out, R=R, s=scaling: F.linear(out.to(R.dtype), R).to(out.dtype) / s
                )
            )

    def shared_params(self) -> dict[str, torch.nn.Parameter]:
        return {f"{CORE}{k}": R for k, R in self.cores.items()}

    def upload(self) -> dict[str, Tensor]:
        return {f"{CORE}{k}": R.detach().to("cpu", torch.float32).clone() for k, R in self.cores.items()}

    def bake(self, factors: Adapter) -> tuple[Adapter, dict[str, Tensor]]:
        """The model as a plain LoRA adapter at the layer's scale s: ``A``, ``B R / s``."""
        out = {}
        for k, f in factors.items():
            R = self.cores[k].detach().to("cpu", torch.float32)
            out[k] = LoraFactors(f.A, f.B @ R / f.scale, f.scale)
        return out, {}


class FedSBClient(ClientHook):
    """Trains nothing of the LoRA factors (they travel empty both ways but the bases' download): the
    initialization round's dense step, then R."""

    uploads: ClassVar[tuple[str, ...]] = ()
    sets_local_work = True  # the initialization round's one Adam step
    params_outside_model = True  # R (and the initialization's dense step) live in the hook's sessions
    frozen: ClassVar[tuple[str, ...]] = ("A", "B")  # the server's view of both is the bases it sent
    # trained like the adapter: clipped and noised with it
    shared_extras: ClassVar[tuple[str, ...]] = (STEP, CORE)
    init_examples = 32
    init_lr = 1e-4

    def start_factors(self, download: Adapter | None, fresh: Adapter) -> Adapter:
        """The downloaded bases ``A`` and ``B`` as they are (no dead direction to revive: R carries the
        product), or ``fresh`` (the initialization round: its ``B = 0`` makes the model the base)."""
        return dict(download) if download else fresh

    def session(
        self, model: Any, adapter: str, state: dict[str, Tensor], extras: dict[str, Tensor], view: str
    ) -> HookSession | None:
        cores = unprefixed(extras, CORE)
        if cores:
            return FedSBCore(model, adapter, cores)
        if view == "train":
            return FedSBInit(model, adapter, self.init_examples, self.init_lr)
        return None  # before the initialization: the client's model is the base (its fresh B is zero)


class FedSB(Strategy):
    """Average the clients' R (exact: the bases are shared); the first round's dense steps make the bases."""

    name = "fedsb"
    hook = FedSBClient
    linear = True  # the new R (and the initialization's step) is the weighted sum of the uploaded ones
    averages_parameters = False  # the client trains R, not its LoRA factors: no per-factor client state
    options = FedSBOptions

    @classmethod
    def sums_uploads(cls, cfg: Any) -> bool:
        """Its sum is of R and the initialization's steps, which travel as extras: not the secure layout's
        factors and dense modules (not built)."""
        return False

    def __init__(self, init_examples: int = 32, init_lr: float = 1e-4) -> None:
        self.init_examples, self.init_lr = init_examples, init_lr

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        optimizer = chosen_option(cfg, "client", "optimizer", "adamw")
        if optimizer != "adamw":
            raise ValueError(
                f"aggregation.name = fedsb initializes with one Adam step (LoRA-SB's -lr sign(g)): set "
                f"{chosen_key(cfg, 'client', 'optimizer')}=adamw (got {optimizer})"
            )
        if cfg.comm.download != "float32":
            raise ValueError(
                f"aggregation.name = fedsb needs its bases B and A exact on every client (R is averaged on "
                f"them): comm.download = {cfg.comm.download} would quantize them; use float32"
            )

    @classmethod
    def from_options(cls, options: FedSBOptions) -> FedSB:
        return cls(options.init_examples, options.init_lr)

    def client_hook(self) -> ClientHook:
        hook = FedSBClient()
        hook.init_examples, hook.init_lr = self.init_examples, self.init_lr
        return hook

    def accept_extras(self, extras: dict[str, Tensor], exp: Expected) -> dict[str, Tensor]:
        """The initialization round: a dense step per module (``out x in``). After it: the client's
        ``r_k x r_k`` block of each R, put into the R it downloaded (``exp.asked``)."""
        asked = unprefixed(exp.asked, CORE)
        prefix = CORE if asked else STEP
        got = unprefixed(extras, prefix)
        if set(got) != set(exp.modules):
            what = "R" if asked else "initialization step"
            raise ClientFailure(
                f"its {what} tensors cover {len(got)} modules, not the adapter's {len(exp.modules)}"
            )
        out = {}
        for key, (out_f, in_f) in exp.modules.items():
            name = f"{prefix}{key}"
            if not asked:
                out[name] = as_float32(name, got[key], (out_f, in_f))
                continue
            r = exp.rank
            block = as_float32(name, got[key], (r, r))
            full = asked[key].detach().to("cpu", torch.float32).clone()
            full[:r, :r] = block
            out[name] = full
        return out

    def extras_numel(self, exp: Expected) -> int:
        """The initialization round's dense steps (``out x in`` per module), or the client's R blocks."""
        if unprefixed(exp.asked, CORE):
            return int(len(exp.modules) * exp.rank * exp.rank)
        return sum(out_f * in_f for out_f, in_f in exp.modules.values())

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        extras = {k: v for k, v in state.extras.items() if not k.startswith((STEP, CORE))}
        prefix = CORE if any(k.startswith(CORE) for k in updates[0].extras) else STEP
        if prefix == STEP:  # the bases' width: the federation's largest rank
            extras[RANK] = (
                context.max_rank if context else max(f.rank for u in updates for f in u.factors.values())
            )
        for key in updates[0].factors:
            name = f"{prefix}{key}"
            extras[name] = self.average([u.extras[name] for u in updates], weights)
        return RoundResult(GlobalState(dict(state.factors), dict(state.residual), extras=extras))

    def release(self, state: GlobalState) -> GlobalState:
        """After the initialization round: the averaged step's rank-``r_max`` SVD, ``U S V^T``, as the bases
        ``B = U``, ``A = V^T`` and ``R = diag(S)`` (the product is the truncated step)."""
        steps = unprefixed(state.extras, STEP)
        if not steps:
            return state
        factors, extras = {}, {k: v for k, v in state.extras.items() if not k.startswith(STEP)}
        rank = int(state.extras[RANK])
        for key, step in steps.items():
            u, s, vh = torch.linalg.svd(step, full_matrices=False)  # in its own dtype (float32 on a server)
            k = min(rank, s.numel())
            A = step.new_zeros(rank, step.shape[1])
            B = step.new_zeros(step.shape[0], rank)
            A[:k], B[:, :k] = vh[:k].to(step.dtype), u[:, :k].to(step.dtype)
            R = step.new_zeros(rank, rank)
            R[:k, :k] = torch.diag(s[:k]).to(step.dtype)
            factors[key] = LoraFactors(A, B, 1.0)
            extras[f"{CORE}{key}"] = R
        return GlobalState(factors, state.residual, state.dense, extras)

    def client_factors(self, state: GlobalState, rank: int, scale: float, client_id: int) -> Adapter | None:
        """The bases' leading ``rank`` directions, as they are (the client's hook divides its LoRA scale
        out); None before the initialization round."""
        if not state.factors:
            return None
        return {
            k: LoraFactors(f.A[:rank].clone(), f.B[:, :rank].clone(), scale) for k, f in state.factors.items()
        }

    def client_extras(self, state: GlobalState, client_id: int) -> dict[str, Tensor]:
        """The global R of every module (the client trains its leading block)."""
        return {k: v for k, v in state.extras.items() if k.startswith(CORE)}

    def global_adapter(self, state: GlobalState) -> Adapter:
        """The plain LoRA adapter of the global model: ``A`` and ``B R`` (scale 1)."""
        return {
            k: LoraFactors(f.A, f.B @ state.extras[f"{CORE}{k}"], 1.0)
            for k, f in state.factors.items()
            if f"{CORE}{k}" in state.extras
        }
