"""FLoRA: stacking-based heterogeneous LoRA aggregation.

Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with
Heterogeneous Low-Rank Adaptations" (NeurIPS 2024). Stacking
``B = [B_1 .. B_K]`` and ``A = [p_1 A_1; ..; p_K A_K]`` gives
``B @ A = sum_k p_k s_k B_k A_k`` exactly: no cross-term error, any mix of
ranks. The stacked update is merged into the base; the download grows with
the sum of the round's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.aggregation.base import GlobalState, MergingOptions, MergingStrategy, RoundContext, RoundResult
from fedllm.factors import add_to_residual, stack
from fedllm.protocol import ClientUpdate


@dataclass
class FloraOptions(MergingOptions):
    """FLoRA's options: the merges kept for catch-ups."""


class FLoRA(MergingStrategy):
    """Stack the clients' factors and merge the exact weighted sum into the base.

    Client: merges the broadcast stacked update into its base weights, then
    trains a freshly initialized LoRA of its own rank.
    """

    name = "flora"
    averages_parameters = False
    options = FloraOptions

    def aggregate_factors(
        self,
        updates: list[ClientUpdate],
        weights: list[float],
        state: GlobalState,
        context: RoundContext | None = None,
    ) -> RoundResult:
        merged = {key: stack([u.factors[key] for u in updates], weights) for key in updates[0].factors}
        return RoundResult(
            GlobalState({}, add_to_residual(state.residual, merged), extras=dict(state.extras)), merged
        )
