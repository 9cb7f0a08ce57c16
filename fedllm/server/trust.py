"""What the server may believe: every update checked against what the server knows, then bounded.

A site can be buggy or hostile, and the server sees only what it sent and
what it was told once, at registration. So it believes nothing else a
client says:

* **who and how much**: the client id must be the one the message went to,
  the example count must be the one registered (partition or Flower
  handshake); weights come from the server's own counts (or are uniform) and
  may be capped per client;
* **what**: exactly the expected modules, at the shapes of the client's rank
  (and, for the dense modules and extras, the shapes the server knows), as
  finite floating-point tensors (half and double precision are cast to
  float32, integers refused); the scale must be the one the server assigned
  to that rank; extras are checked by the strategy and the algorithm that
  expect them; metrics are kept only when they are finite numbers;
* **how far**: the change is measured from what the server knows the client
  started from (its download, and a fresh initialization it derives from the
  round's seed), never from anything the client sends, and clipped to a
  multiple of the round's median change.

A failed check is that client's failure for the round (a one-line reason);
nothing a client sends raises out of the server. Flower's strategies check
replies apart from their math the same way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedllm.checks import ClientFailure, Expected, as_float32, finite_tensors
from fedllm.factors import Adapter, DenseDelta, LoraFactors

if TYPE_CHECKING:
    from fedllm.aggregation.base import GlobalState
    from fedllm.protocol import ClientUpdate


MAX_METRIC = 1e15  # beyond any real loss, step count or second; a mean of such numbers stays finite


def clean_metrics(metrics: Any) -> dict[str, float]:
    """The metrics that are finite numbers of a sane size; anything else a client sends is dropped."""
    if not isinstance(metrics, dict):
        return {}
    return {
        str(k)[:64]: float(v)
        for k, v in list(metrics.items())[:32]
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and abs(v) <= MAX_METRIC
    }


def accept_factors(factors: Any, exp: Expected, parts: tuple[str, ...] = ("A", "B")) -> Adapter:
    """The update's factors, checked module by module and given the server's scale for the client's rank."""
    if not isinstance(factors, dict):
        raise ClientFailure("its factors are not a mapping of modules")
    missing, extra = sorted(set(exp.modules) - set(factors)), sorted(set(factors) - set(exp.modules))
    if missing or extra:
        raise ClientFailure(
            f"its modules differ from the adapter's: {len(missing)} missing (e.g. {missing[:1]}), "
            f"{len(extra)} unknown (e.g. {extra[:1]})"
        )
    out = {}
    for key, (out_f, in_f) in exp.modules.items():
        f = factors[key]
        if not isinstance(f, LoraFactors):
            raise ClientFailure(f"{key}: not LoRA factors")
        try:
            scale = float(f.scale)
        except (TypeError, ValueError):
            raise ClientFailure(f"{key}: scale {f.scale!r} is not a number") from None
        if not math.isclose(scale, exp.scale, rel_tol=1e-6):
            raise ClientFailure(
                f"{key}: scale {scale!r}, but the server assigned {exp.scale} to rank {exp.rank}"
            )
        A = as_float32(f"{key}.A", f.A, (exp.rank, in_f)) if "A" in parts else None
        B = as_float32(f"{key}.B", f.B, (out_f, exp.rank)) if "B" in parts else torch.zeros(out_f, 0)
        # a factor the strategy's clients do not upload (FFA-LoRA's A) stays None: the strategy reads its own
        # reference for it, never a client's
        out[key] = LoraFactors(A, B, exp.scale)  # type: ignore[arg-type]
    return out


def accept_dense(dense: Any, exp: Expected) -> dict[str, Tensor]:
    """The update's fully trained modules: exactly the server's, at their shapes."""
    if not isinstance(dense, dict) or set(dense) != set(exp.dense):
        got = sorted(dense) if isinstance(dense, dict) else type(dense).__name__
        raise ClientFailure(f"its dense modules {got} are not the run's {sorted(exp.dense)}")
    return {k: as_float32(k, dense[k], shape) for k, shape in exp.dense.items()}


def upload_numel(update: ClientUpdate) -> int:
    """What an upload carried, as far as it can be counted (a malformed one counts what is readable)."""
    try:
        return update.numel()
    except Exception:
        return 0


def check_finite(state: GlobalState, merged: Adapter) -> None:
    factors = [*state.factors.values(), *merged.values()]
    tensors = [t for f in factors for t in ((f.D,) if isinstance(f, DenseDelta) else (f.A, f.B))]
    tensors += list(state.dense.values()) + [v for v in state.extras.values() if isinstance(v, Tensor)]
    if not finite_tensors(tensors):
        raise ValueError("the aggregate holds non-finite values")
