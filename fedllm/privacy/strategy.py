"""The server side of DP-FedAvg: a wrapper around any linear strategy, as Flower's
``DifferentialPrivacyServerSideFixedClipping`` wraps a strategy.

Central mode: each update's change, measured from the reference the server passes (what that client
started from, derived by the server, never what it claims), is clipped to ``C``; the inner strategy
aggregates the clipped updates with uniform weights ``1/m`` over the ``m`` clients sampled (a sampled client
that failed contributes no change, so the denominator does not depend on who failed); Gaussian noise of
standard deviation ``sigma C / m`` is added to every coordinate the inner strategy computed from the uploads
(``hook.uploads``: FedIT's A and B, FFA-LoRA's B) and to the dense modules. That is
``global + (sum_k clip(change_k) + N(0, (sigma C)^2)) / m`` exactly when the inner aggregate is a weighted
sum of the uploads, which a strategy declares with ``linear = True`` (the config refuses the others).
A client's change covers its leading ``r_k`` components; the wrapper hands the inner strategy every
update at the largest rank, the components a client does not train left at the base point.

Local mode: the sites noised their own updates; the inner strategy aggregates them as it always does.

Distributed mode (with secure aggregation, ``fedllm/secagg``): each site clips its change to C and adds
its share ``N(0, (sigma C)^2 / m)`` of the noise; the server sees only the sum, which carries
``N(0, (sigma C)^2)`` when all ``m`` sampled sites finish; the wrapper divides by ``m`` and adds the shares
of the sites that did not (:meth:`DPStrategy._distributed`). Accounted twice: as central mode against
whoever sees only the released models (the server following the protocol: its sample secret, its top-up
added), and against the server itself, which draws the sample and sees who took part (no amplification) and
whose top-up protects no one from itself: the Gaussian of the finishing sites' noise composed over every
round (``against_server``, ``epsilon_server`` in each row).

In both modes the wrapper accounts: ``round_report`` gives the epsilon spent after a round, and
``run_summary`` the run's guarantee, which the round row, the summary, the printed summary, the model card
and ``fedllm compare`` show without knowing what they show.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedllm.aggregation.base import (
    ClientUpdate,
    GlobalState,
    RoundContext,
    RoundResult,
    StrategyWrapper,
    base_point,
)
from fedllm.checks import clip_
from fedllm.factors import LoraFactors
from fedllm.protocol import seeded_generator as generator

SERVER_PRECISION = "dp_server_precision"  # distributed DP: sum of 1 / (sigma^2 n_r / m_r) over the rounds


class DPStrategy(StrategyWrapper):
    """``inner`` with user-level DP (see module docstring); everything but aggregation and reporting is the
    inner strategy's own (its name, client side, downloads, global model), delegated explicitly by
    :class:`~fedllm.aggregation.base.StrategyWrapper` as Flower's DP wrappers do."""

    def __init__(
        self,
        inner,
        *,
        mode: str,
        clip_norm: float,
        noise_multiplier: float,
        noise_seed: int,
        epsilon_after: Callable[[int], float],
        summary: Callable[[int], dict[str, Any]],
        report_clip_stats: bool = False,
        against_server: Any = None,
    ) -> None:
        super().__init__(inner)
        self.mode = mode
        self.clip_norm, self.noise_multiplier, self.noise_seed = clip_norm, noise_multiplier, noise_seed
        self.epsilon_after, self.summary, self.report_clip_stats = epsilon_after, summary, report_clip_stats
        # distributed mode: the guarantee against the server, from the sites' own noise of the rounds so far
        # (``SERVER_PRECISION``: sum over rounds of 1 / (sigma^2 n_r / m_r), the composed Gaussian)
        self.against_server = against_server
        self.server_precision = 0.0

    # ------------------------------------------------------------------ aggregation
    def aggregate(
        self,
        updates: list[ClientUpdate],
        state: GlobalState,
        weights: list[float] | None = None,
        context: RoundContext | None = None,
    ) -> RoundResult:
        if self.mode == "distributed":
            return self._distributed(updates, state, context)
        if self.mode != "central":
            return self.inner.aggregate(updates, state, weights, context)
        if context is None:
            raise ValueError("central DP needs the round's context (references, sample size)")
        m = max(context.sampled, len(updates))
        base = base_point(state, context)
        clipped, norms = [], []
        for u, ref in zip(updates, context.references, strict=True):
            moved, norm = self._clipped(u, ref, base, state, self.inner.client_extras(state, u.client_id))
            clipped.append(moved)
            norms.append(norm)
        weights = [1.0 / m] * len(clipped)
        if len(clipped) < m:  # the sampled clients that sent nothing: no change, at their share
            shared = self.inner.shared_extras(clipped[0]) if clipped else {}
            start = self.inner.client_extras(state, -1)
            rest = ClientUpdate(-1, 0, dict(base), dict(state.dense))
            rest.extras = {k: start.get(k, torch.zeros_like(t)) for k, t in shared.items()}
            clipped.append(rest)
            weights.append((m - len(updates)) / m)
        result = self.inner.combine(clipped, state, weights, context)
        self._add_noise(result.state, context.round, m)
        result.state = self.inner.release(result.state)  # post-processing of the noised sum (FedSVD's SVD)
        if self.report_clip_stats:  # exact functions of the data: outside the guarantee (docs/privacy.md)
            result.info["dp_clipped"] = sum(n > self.clip_norm * (1 + 1e-4) for n in norms)
            result.info["dp_update_norm_median"] = float(torch.tensor(norms).median()) if norms else 0.0
        return result

    def _distributed(
        self, updates: list[ClientUpdate], state: GlobalState, context: RoundContext | None
    ) -> RoundResult:
        """Distributed mode: one update, secure aggregation's ``base + sum_k (clip(change_k) + z_k)`` over
        the ``n`` sites that finished, each ``z_k`` a share ``N(0, (sigma C)^2 / m)`` its site added; the
        result is central mode's ``base + (sum + N(0, (sigma C)^2)) / m``: the server adds the shares of the
        ``m - n`` sampled sites that did not finish (a round with dropouts then trusts the server for that
        part of the noise; its row says how much, ``dp_server_noise_share``)."""
        if context is None or context.contributors is None or len(updates) != 1:
            raise ValueError("distributed DP aggregates secure aggregation's one sum of the round's uploads")
        n = context.contributors
        m = max(context.sampled, n)
        rest = ClientUpdate(-1, 0, base_point(state, context), dict(state.dense))
        result = self.inner.combine([updates[0], rest], state, [1.0 / m, (m - 1.0) / m], context)
        share = (m - n) / m
        if share > 0:
            self._add_noise(result.state, context.round, m, share**0.5)
        result.state = self.inner.release(result.state)
        result.info["dp_server_noise_share"] = share
        # against the server only the n finishing sites' noise counts (its top-up is its own): this round is
        # a Gaussian of multiplier sigma sqrt(n / m) on the site's change, composed with the earlier rounds
        if self.against_server is not None:
            # the larger of the state's count and this process's: a round the server rolled back (an
            # aggregate that failed) was still unmasked, so it stays counted
            prev = max(float(state.extras.get(SERVER_PRECISION, 0.0)), self.server_precision)
            self.server_precision = prev + self.against_server.precision(n)
        if math.isfinite(self.server_precision) and self.server_precision > 0:
            result.state.extras[SERVER_PRECISION] = self.server_precision
        return result

    def _clipped(
        self, u: ClientUpdate, ref, base, state: GlobalState, download: dict[str, Tensor]
    ) -> tuple[ClientUpdate, float]:
        """``u`` as base + its clipped change, at the largest rank (scale folded); and the change's norm.
        The change covers the strategy's shared extras too (Fed-SB's R), measured from what the client
        downloaded under the same name (``download``; else from zero)."""
        parts: list[Tensor] = []
        for k, f in u.factors.items():
            r = ref[k].with_scale(f.scale)
            parts += [(f.A - r.A).double(), ((f.B - r.B) * f.scale).double()]
        parts += [(t - state.dense[k]).double() for k, t in u.dense.items()]
        shared = self.inner.shared_extras(u)
        starts = {k: download.get(k, torch.zeros_like(t)) for k, t in shared.items()}
        parts += [(t - starts[k]).double() for k, t in shared.items()]
        norm = clip_(parts, self.clip_norm)
        it = iter(parts)
        factors = {}
        for k, f in u.factors.items():
            da, db = next(it).float(), next(it).float()
            A, B = base[k].A.clone(), base[k].B.clone()
            A[: f.rank] += da
            B[:, : f.rank] += db
            factors[k] = LoraFactors(A, B, 1.0)
        dense = {k: state.dense[k] + next(it).float() for k in u.dense}
        extras = dict(u.extras)
        extras.update({k: starts[k] + next(it).float() for k in shared})
        return ClientUpdate(u.client_id, u.num_examples, factors, dense, extras, dict(u.metrics)), norm

    def _add_noise(self, state: GlobalState, round_idx: int, m: int, part: float = 1.0) -> None:
        """N(0, (part sigma C / m)^2) on every released coordinate the uploads determine, in a fixed order."""
        std = part * self.noise_multiplier * self.clip_norm
        gen = generator(self.noise_seed, round_idx, 0)

        def noisy(t: Tensor) -> Tensor:
            return t + torch.randn(t.shape, generator=gen) * std / m

        uploads = self.inner.client_hook().for_round(round_idx).uploads
        state.factors = {
            k: LoraFactors(
                noisy(f.A) if "A" in uploads else f.A, noisy(f.B) if "B" in uploads else f.B, f.scale
            )
            for k, f in state.factors.items()
        }
        state.dense = {k: noisy(t) for k, t in state.dense.items()}
        prefixes = self.inner.client_hook().shared_extras
        if prefixes:  # the strategy's shared parameters its combination made of the uploads (Fed-SB's R)
            state.extras = {
                k: noisy(v) if k.startswith(prefixes) and isinstance(v, Tensor) else v
                for k, v in state.extras.items()
            }

    # ------------------------------------------------------------------ reporting
    def round_report(self, round_idx: int) -> dict[str, Any]:
        """The epsilon spent once round ``round_idx``'s result is released (skipped rounds count); under
        distributed DP also the epsilon against the server (``epsilon_server``)."""
        out = {"epsilon": self.epsilon_after(round_idx)}
        if self.against_server is not None:
            out["epsilon_server"] = self.against_server.report(self.server_precision)["epsilon"]
        return out

    def run_summary(self, rounds: int) -> dict[str, Any]:
        out = self.summary(rounds)
        if self.against_server is not None:  # the run's own rounds (dropouts count), not the plan's
            server = self.against_server.report(self.server_precision)
            out["privacy"] = {**out["privacy"], "against_server": server}
            out["metrics"] = {**out["metrics"], "epsilon_server": server["epsilon"]}
            out["guarantees"] = [*out["guarantees"], server["line"]]
        return out
