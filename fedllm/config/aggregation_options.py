"""The server's options (``aggregation.*``): every strategy's knobs and the server's defences.

Split from :mod:`fedllm.config.sections`; ``fedllm run --help-config`` lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedllm.options import _fraction, _nonneg, _positive, opt


@dataclass
class AggregationConfig:
    name: str = opt(
        "fedit", "server strategy (one file each in fedllm/aggregation/; 'local' is the local-only baseline)"
    )
    tau: float = opt(0.9, "FLoRIST: energy fraction of singular values kept", _fraction, "in (0, 1]")
    fedsa_share_b_every: int = opt(
        0,
        "FedSA-LoRA: clients also upload their B every N-th round, and the global model is the global A with "
        "their mean B (0: B never leaves a client, the paper's protocol; the global model is then the base)",
        lambda x: x >= 0,
        "an integer >= 0",
    )
    hetlora_prune_gamma: float = opt(
        0.0,
        "HetLoRA: local rank self-pruning's decay factor gamma (a client whose last components' norm fell "
        "keeps floor(gamma r) of them; 0: off, every client keeps its rank)",
        lambda x: x == 0 or 0 < x < 1,
        "0 (off) or in (0, 1)",
    )
    hetlora_prune_lambda: float = opt(
        0.01, "HetLoRA: weight of the norm penalty on the components self-pruning may drop", _nonneg, ">= 0"
    )
    fixed_rank: int = opt(
        0,
        "FLoRIST: keep exactly this rank instead of using tau (0: use tau)",
        _nonneg,
        "an integer >= 1, or 0 to use tau",
    )
    num_adaptors: int = opt(2, "FLoRAL: adaptors C per target module", _positive, "an integer >= 1")
    router_temperature: float = opt(1.0, "FLoRAL: softmax temperature of the router", _positive, "> 0")
    router_lr: float = opt(1e-2, "FLoRAL: learning rate of the router logits", _positive, "> 0")
    router_noise: float = opt(
        1.0,
        "FLoRAL: scale of the noise added to the router logits while training (the reference's: 1.0)",
        _nonneg,
        ">= 0",
    )
    router_noise_dist: str = opt(
        "uniform",
        "FLoRAL: the router noise's distribution: uniform (U[0, 1), the reference's) or gaussian (N(0, 1))",
        lambda x: x in ("uniform", "gaussian"),
        "one of uniform, gaussian",
    )
    router_granularity: str = opt(
        "client",
        "FLoRAL: one router per client (the reference's default), per transformer block, or per target "
        "module "
        "(the reference's per-layer routers)",
        lambda x: x in ("client", "block", "module"),
        "one of client, block, module",
    )
    router_server_temperature: bool = opt(
        False,
        "FLoRAL: the server weights adaptors by softmax(logits / router_temperature) instead of "
        "softmax(logits) "
        "(the reference's server ignores the temperature)",
    )
    stateful_routers: bool = opt(True, "FLoRAL: keep routers across rounds (else re-learn each round)")
    precondition_eps: float = opt(0.0, "FLoRAL: LoRA preconditioning epsilon (0: off)", _nonneg, ">= 0")
    bias_adaptors: bool = opt(False, "FLoRAL: also C bias adaptors per target module, mixed by the router")
    flexlora_split: str = opt(
        "us",
        "FlexLoRA: how a client's truncated SVD U S V^T is split into its factors: 'us' "
        "(B = U S, A = V^T, as the reference) or 'sqrt' (B = U sqrt(S), A = sqrt(S) V^T)",
        lambda x: x in ("us", "sqrt"),
        "one of us, sqrt",
    )
    clip_norm_ratio: float = opt(
        2.0,
        "clip each update's change (measured from what the server knows the client started from) to this "
        "multiple of the round's median change, so one client cannot move the model more than a few honest "
        "ones do (0: off)",
        lambda x: x == 0 or x >= 1,
        "0 or a value >= 1",
    )
    robust: str = opt(
        "none",
        "robust aggregate of the averaging strategies (fedit): the coordinate-wise median or trimmed mean of "
        "the clients' tensors instead of the weighted mean (weights are then ignored)",
        lambda x: x in ("none", "median", "trimmed_mean"),
        "one of none, median, trimmed_mean",
    )
    trim_fraction: float = opt(
        0.1,
        "with robust=trimmed_mean: the share of clients dropped at each end of every coordinate",
        lambda x: 0 <= x < 0.5,
        "in [0, 0.5)",
    )
