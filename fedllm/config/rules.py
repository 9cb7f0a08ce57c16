"""The one table of refused combinations, written against declared capabilities, never against names.

A strategy declares what its aggregate is (``averages_parameters``, ``same_weights``, ``linear``,
``global_state``) and its client hook what it does on the client (``local_params``, ``frozen``,
``alternates``, ``sets_local_work``); a client algorithm declares what it needs
(``needs_parameter_averaging``, ``trains_local_params``, ``server_state_per_parameter``,
``plain_first_step``). Each :class:`~fedllm.options.Rule` below refuses one combination of those, with the
reason and what to change; a feature (``fedllm/features.py``: differential privacy) adds its own rules.
Then each method checks what it alone requires (``check_config``: FLoRAL's single rank, Fed-SB's Adam).
``fedllm run --help-config`` and the error a refused config gets are the user's view of this table.
"""

from __future__ import annotations

from typing import Any

from fedllm.aggregation import STRATEGIES
from fedllm.client import ALGORITHMS
from fedllm.features import FEATURES
from fedllm.options import Rule, chosen_key, chosen_option

# ``cfg`` below is a fedllm.config.Config (typed as Any: this table sits below the module that builds it)

_NO_PARAMETERS = {  # what a strategy's global state is when it is not persisting parameters
    "merged": "merges each round into the base and restarts its clients from fresh adapters (no global "
    "adapter to step)",
    "refactored": "re-factors the global product by SVD every round (the factors' difference is no step in "
    "a fixed parameter)",
    "per_client": "keeps every client's own adapter or router (no one global point)",
}


def _budget(cfg: Any) -> float:
    """The chosen strategy's download budget (0 when it has none: fedit, flexlora and florist own one)."""
    return float(chosen_option(cfg, "aggregation", "download_budget_mb", 0.0))


def _pair(cfg: Any) -> str:
    return f"client.algorithm = {cfg.client.algorithm} with aggregation.name = {cfg.aggregation.name}"


RULES: list[Rule] = [
    Rule(
        "state that refers to persisting parameters",
        lambda cfg, s, a: a.needs_parameter_averaging and not s.averages_parameters,
        lambda cfg, s, a: (
            f"{_pair(cfg)}: the algorithm needs a strategy that averages parameters (fedit, floral); this "
            "one changes the parameter space every round (merged, stacked or re-factorized updates), so the "
            "algorithm's state would refer to parameters that no longer exist"
        ),
    ),
    Rule(
        "one weight per client",
        lambda cfg, s, a: a.needs_parameter_averaging and not s.same_weights,
        lambda cfg, s, a: (
            f"{_pair(cfg)}: the algorithm keeps its server state as sum_k p_k c_k, but the strategy averages "
            "each parameter with weights of its own, so the state would correct towards another objective; "
            "use fedit"
        ),
    ),
    Rule(
        "client-only parameters",
        lambda cfg, s, a: s.hook.local_params and not a.trains_local_params,
        lambda cfg, s, a: (
            f"{_pair(cfg)}: the algorithm's objective covers the shared parameters only, and the strategy's "
            "clients also train parameters of their own (routers); use client.algorithm=sft, fedprox or "
            "scaffold"
        ),
    ),
    Rule(
        "frozen factors",
        lambda cfg, s, a: bool(s.hook.frozen or s.hook.alternates) and a.server_state_per_parameter,
        lambda cfg, s, a: (
            f"{_pair(cfg)}: the algorithm keeps server state for every trainable tensor, but the strategy "
            f"freezes {'/'.join(s.hook.frozen) or 'A or B (a different one each round)'} on the clients "
            "(not trained or sent); use "
            "client.algorithm=sft or fedprox"
        ),
    ),
    Rule(
        "a round whose step the strategy sets",
        lambda cfg, s, a: s.hook.sets_local_work and not a.plain_first_step,
        lambda cfg, s, a: (
            f"{_pair(cfg)}: the strategy's clients take one plain optimizer step in some rounds (Fed-SB's "
            "initialization: LoRA-SB's first Adam step), which the algorithm's steps are not; use "
            "client.algorithm=sft or fedprox"
        ),
    ),
    Rule(
        "download budget with whole tensors",
        lambda cfg, s, a: (
            _budget(cfg) > 0 and (bool(cfg.lora.trainable_modules) or a.server_state_per_parameter)
        ),
        lambda cfg, s, a: (
            f"{chosen_key(cfg, 'aggregation', 'download_budget_mb')} bounds the adapter's download, but "
            + (
                f"lora.trainable_modules = {cfg.lora.trainable_modules} travel whole"
                if cfg.lora.trainable_modules
                else f"client.algorithm = {cfg.client.algorithm}'s server state travels whole"
            )
            + ": set lora.trainable_modules=[] (and use client.algorithm=sft or fedprox)"
        ),
    ),
    Rule(
        "a server optimizer's clients start from the global factors",
        lambda cfg, s, a: cfg.aggregation.server_opt != "none" and _budget(cfg) > 0,
        lambda cfg, s, a: (
            f"aggregation.server_opt = {cfg.aggregation.server_opt} steps with the change from the global "
            f"factors, but {chosen_key(cfg, 'aggregation', 'download_budget_mb')} has clients start from "
            "part of them: set one of the two"
        ),
    ),
    Rule(
        "a server optimizer steps persisting parameters",
        lambda cfg, s, a: cfg.aggregation.server_opt != "none" and s.global_state != "parameters",
        lambda cfg, s, a: (
            f"aggregation.server_opt = {cfg.aggregation.server_opt} steps the global factors the clients "
            f"start from with the round's change, but aggregation.name = {cfg.aggregation.name} "
            + _NO_PARAMETERS[s.global_state]
            + "; use it with "
            + ", ".join(sorted(n for n, c in STRATEGIES.items() if c.global_state == "parameters"))
        ),
    ),
]


def _hidden_sample(cfg: Any) -> str:
    return "; ".join(w for f in FEATURES if (w := f.hidden_sample(getattr(cfg, f.section), cfg)))


def _state_keepers(cfg: Any, s: Any, a: Any) -> list[str]:
    """What makes each client keep state between rounds, as the settings that turn it on."""
    out = [f"aggregation.name = {cfg.aggregation.name}"] if s.hook.keeps_state else []
    out += [f"client.algorithm = {cfg.client.algorithm}"] if a.keeps_state else []
    return out + [w for f in FEATURES if (w := f.client_state(getattr(cfg, f.section), cfg))]


# checked after the features' own rules: a combination they refuse for a reason of its own says that reason
SECRET_SAMPLE = Rule(
    "a secret sample leaves no per-client trace",
    lambda cfg, s, a: bool(_hidden_sample(cfg)) and bool(_state_keepers(cfg, s, a)),
    lambda cfg, s, a: (
        ", ".join(_state_keepers(cfg, s, a))
        + ": each client keeps state between rounds, which a simulation writes to the run folder per client "
        "and round and which changes only for the clients sampled, so it would reveal the sample; "
        + _hidden_sample(cfg)
        + ". Turn that state off (e.g. comm.error_feedback=false)"
    ),
)


def all_rules() -> list[Rule]:
    """The table above and every feature's rules, in the order they are checked."""
    return [*RULES, *(r for f in FEATURES for r in f.rules()), SECRET_SAMPLE]


def refusal(cfg: Any) -> str | None:
    """Why ``cfg`` cannot run (the first rule that applies), else None after each method's and feature's own
    checks (which raise ValueError)."""
    strategy, algorithm = STRATEGIES[cfg.aggregation.name], ALGORITHMS[cfg.client.algorithm]
    for rule in all_rules():
        if rule.applies(cfg, strategy, algorithm):
            return rule.why(cfg, strategy, algorithm)
    strategy.check_config(cfg)
    algorithm.check_config(cfg)
    for feature in FEATURES:
        feature.check_config(getattr(cfg, feature.section), cfg)
    return None
