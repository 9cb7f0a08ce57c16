"""Plain supervised fine-tuning: the local step of FedAvg / FedIT.

McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017), with the alpaca-style instruction loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.client.base import ClientAlgorithm, OptimizerOptions


@dataclass
class SFTOptions(OptimizerOptions):
    """SFT's options: its local optimizer."""


class SFT(ClientAlgorithm):
    """Minimize the response-token loss on the client's data with AdamW."""

    name = "sft"
    options = SFTOptions
    changes_gradients = False
