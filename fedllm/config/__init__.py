"""Typed run configuration: YAML + dotted ``key=value`` overrides, validated once.

Configs are parsed into the dataclasses of ``fedllm/config/sections.py`` here and nowhere else; algorithm code
takes plain arguments. Every field carries help text (``fedllm run --help-config``
prints it) and a range check, so a bad value fails before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from fedllm.config.overrides import coerce, flatten, parse_override
from fedllm.config.sections import (  # noqa: F401  (the sections are part of the config API)
    SECTIONS,
    AggregationConfig,
    ClientConfig,
    Config,
    DataConfig,
    EvalConfig,
    FederationConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
)


class ConfigError(ValueError):
    """A config problem; the message names the field and what was expected."""


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def valid_keys() -> list[str]:
    """Every dotted key a config may set."""
    return [f"{s}.{f.name}" for s, cls in _section_classes().items() for f in dataclasses.fields(cls)]


def choices(key: str) -> list[str] | None:
    """The valid values of an enumerated key (registries for strategies and algorithms), else None."""
    from fedllm.aggregation import STRATEGIES
    from fedllm.client import ALGORITHMS

    if key == "aggregation.name":
        return sorted(STRATEGIES)
    if key == "client.algorithm":
        return sorted(ALGORITHMS)
    section, name = key.split(".")
    f = {f.name: f for f in dataclasses.fields(_section_classes()[section])}[name]
    expect = f.metadata.get("expect", "")
    return [c.strip() for c in expect[len("one of ") :].split(",")] if expect.startswith("one of ") else None


def help_text() -> str:
    """One line per option: key, default, help and, for enumerated keys, the valid values."""
    lines = []
    for section, cls in _section_classes().items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            valid = choices(f"{section}.{f.name}")
            lines.append(
                f"{section}.{f.name} (default {default!r}{'; one of ' + ', '.join(valid) if valid else ''})"
                f": {f.metadata['help']}"
            )
    return "\n".join(lines)


def _check_fields_together(cfg: Config) -> None:
    """Checks that span fields of the config alone (registries aside)."""
    if not cfg.lora.ranks and not cfg.lora.rank_distribution:
        raise ConfigError("lora.ranks is empty: give at least one rank (an integer >= 1)")
    for r in list(cfg.lora.ranks) + list(cfg.lora.rank_distribution):
        if r < 1:
            raise ConfigError(f"lora.ranks: rank {r} is invalid: every rank must be an integer >= 1")
    if cfg.lora.rank_distribution:
        probs = list(cfg.lora.rank_distribution.values())
        if any(p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
            raise ConfigError(f"lora.rank_distribution: probabilities {probs} must be >= 0 and sum to 1")
    if cfg.data.label_shift_groups and cfg.data.dataset != "builtin":
        raise ConfigError("data.label_shift_groups works on the built-in data only (data.dataset=builtin)")
    if not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty: name at least one linear module, e.g. q_proj")
    for i, s in enumerate(cfg.client.local_steps_per_client):
        if s < 1:
            raise ConfigError(
                f"client.local_steps_per_client[{i}] = {s} is invalid: expected an integer >= 1"
            )
    if cfg.federation.clients_per_round > cfg.federation.num_clients:
        raise ConfigError(
            f"federation.clients_per_round = {cfg.federation.clients_per_round} exceeds "
            f"federation.num_clients = {cfg.federation.num_clients}"
        )
    if cfg.federation.min_clients > cfg.federation.num_clients:
        raise ConfigError(
            f"federation.min_clients = {cfg.federation.min_clients} exceeds "
            f"federation.num_clients = {cfg.federation.num_clients}"
        )


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; run `fedllm run --help-config` for the list"
    return ConfigError(f"unknown config key '{key}'{hint}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set one dotted key (type-checked; an unknown key is refused with the closest known one)."""
    section_name, _, name = key.partition(".")
    if section_name not in SECTIONS or "." in name:
        raise _unknown(key)
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        raise _unknown(key)
    try:
        setattr(section, name, coerce(key, value, hints[name]))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def apply_settings(cfg: Config, settings: dict[str, Any]) -> None:
    """Set every dotted key of ``settings`` on ``cfg``."""
    for key, value in settings.items():
        set_key(cfg, key, value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated :class:`Config` from an optional YAML file and ``key=value`` overrides."""
    cfg = Config()
    if path is not None:
        from data_prep.schema import read_text

        path = Path(path)
        text = read_text(path, "a YAML config file (see configs/)", ConfigError)
        _apply_yaml(cfg, text, str(path))
    try:
        settings = dict(parse_override(text) for text in overrides or [])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    apply_settings(cfg, settings)
    validate(cfg)
    return cfg


def config_from_text(text: str, name: str = "<resolved config>") -> Config:
    """A validated :class:`Config` from YAML text (e.g. the resolved config a Flower site receives)."""
    cfg = Config()
    _apply_yaml(cfg, text, name)
    validate(cfg)
    return cfg


def config_to_text(cfg: Config) -> str:
    """The resolved config as YAML: what ``config.yaml`` holds and :func:`config_from_text` reads back."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"section.key": value}`` of a config: what resumes compare, trackers log and digests cover."""
    return {f"{s}.{k}": v for s, values in cfg.to_dict().items() for k, v in values.items()}


def _apply_yaml(cfg: Config, text: str, name: str) -> None:
    """The settings of config file ``name`` (its YAML ``text``) applied to ``cfg``."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {name} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name} must hold a mapping of sections")
    try:
        settings = flatten(data, where=f"{name}: ")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    apply_settings(cfg, settings)


def validate(cfg: Config) -> None:
    """Range checks of every field, then checks that span fields (the strategy's and algorithm's own too)."""
    for section, cls in _section_classes().items():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            check = f.metadata.get("check")
            value = getattr(obj, f.name)
            if check is not None and not check(value):
                raise ConfigError(
                    f"{section}.{f.name} = {value!r} is invalid: expected {f.metadata['expect']}"
                )
    _check_fields_together(cfg)
    from fedllm.aggregation import STRATEGIES
    from fedllm.client import ALGORITHMS

    for key, registry in (("aggregation.name", STRATEGIES), ("client.algorithm", ALGORITHMS)):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) not in registry:
            raise ConfigError(
                f"{key} = {getattr(getattr(cfg, section), name)!r} is unknown; valid choices: "
                f"{', '.join(sorted(registry))}"
            )
    from fedllm.privacy import check_config as check_privacy

    try:
        check_privacy(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    strategy, algorithm = STRATEGIES[cfg.aggregation.name], ALGORITHMS[cfg.client.algorithm]
    if algorithm.needs_parameter_averaging and not strategy.averages_parameters:
        raise ConfigError(
            f"client.algorithm = {cfg.client.algorithm} needs a strategy that averages parameters (fedit, "
            f"floral); aggregation.name = {cfg.aggregation.name} changes the parameter space every round "
            "(merged, stacked or re-factorized updates), so control variates would refer to parameters that "
            "no longer exist"
        )
    if algorithm.needs_parameter_averaging and not strategy.same_weights:
        raise ConfigError(
            f"client.algorithm = {cfg.client.algorithm} keeps its control variate as sum_k p_k c_k, but "
            f"aggregation.name = {cfg.aggregation.name} averages each parameter with weights of its own "
            "(FLoRAL: "
            "p(k|c) per adaptor), so the variate would correct towards another objective; use fedit"
        )
    if strategy.hook.local_params and not algorithm.trains_local_params:
        raise ConfigError(
            f"client.algorithm = {cfg.client.algorithm} cannot run with aggregation.name = "
            f"{cfg.aggregation.name}: its meta-objective covers the shared parameters only, and the "
            "strategy's clients also train parameters of their own (FLoRAL's routers); use "
            "client.algorithm=sft, fedprox or scaffold"
        )
    if cfg.aggregation.robust != "none" and not strategy.supports_robust:
        robust = sorted(n for n, s in STRATEGIES.items() if s.supports_robust)
        raise ConfigError(
            f"aggregation.robust = {cfg.aggregation.robust} replaces a plain average, which "
            f"aggregation.name = {cfg.aggregation.name} does not compute; use it with {', '.join(robust)}"
        )
    try:
        strategy.check_config(cfg)
        algorithm.check_config(cfg)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically, via the checkpoint helper)."""
    from fedllm.run.checkpoint import atomic_write_text

    atomic_write_text(path, config_to_text(cfg))


TOKEN_INDEXED = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")


def token_modules(cfg: Config) -> list[str]:
    """The shared dense modules whose rows are indexed by token ids: the rows a client changes are the
    tokens of its data, so sharing them across organizations reveals those tokens."""
    return [m for m in cfg.lora.trainable_modules if m.split(".")[-1] in TOKEN_INDEXED]
