"""Typed run configuration: YAML + dotted ``key=value`` overrides, validated once.

Configs are parsed into dataclasses here and nowhere else; algorithm code takes plain arguments. The
general sections are ``fedllm/config/sections.py``'s; every strategy and client algorithm declares its own
options next to its code (``options``) and they are collected here under its name, as peft collects its
LoRA variants' configs: ``aggregation.floral.router_lr``, ``client.perfedavg.variant``; a cross-cutting
feature (``fedllm/features.py``) adds a section of its own. Every field carries help text (``fedllm run
--help-config``) and a range check, and ``fedllm/config/rules.py`` refuses the combinations that cannot
work, so a bad value fails before any model is loaded. A key of the old flat layout
(``aggregation.router_lr``) is refused with the key that replaced it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from fedllm.aggregation import SERVER_OPTIMIZERS, STRATEGIES
from fedllm.client import ALGORITHMS
from fedllm.config.overrides import coerce, parse_override
from fedllm.config.sections import (
    AggregationSection,
    ClientSection,
    DataConfig,
    EvalConfig,
    FederationConfig,
    FlowerConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
)
from fedllm.features import FEATURES

__all__ = [
    "AggregationConfig",
    "ClientConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FederationConfig",
    "FlowerConfig",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "apply_settings",
    "config_from_text",
    "config_to_text",
    "flat_config",
    "help_text",
    "load_config",
    "save_config",
    "set_key",
    "token_modules",
    "valid_keys",
    "validate",
]


class ConfigError(ValueError):
    """A config problem; the message names the field and what was expected."""


def _with_methods(base: type, registry: dict[str, type], name: str) -> type:
    """``base`` plus one sub-section per registered method that declares ``options``, named after it."""
    extra = [
        (method, cls.options, dataclasses.field(default_factory=cls.options, metadata={"method": method}))
        for method, cls in sorted(registry.items())
        if cls.options is not None
    ]
    cls = dataclasses.make_dataclass(name, extra, bases=(base,))
    cls.__module__ = __name__  # picklable, and named where it is built
    return cls


AggregationConfig = _with_methods(
    AggregationSection, {**STRATEGIES, **SERVER_OPTIMIZERS}, "AggregationConfig"
)
ClientConfig = _with_methods(ClientSection, ALGORITHMS, "ClientConfig")

_SECTIONS: list[tuple[str, type]] = [
    ("model", ModelConfig),
    ("lora", LoraConfig),
    ("data", DataConfig),
    ("federation", FederationConfig),
    ("client", ClientConfig),
    ("aggregation", AggregationConfig),
    ("eval", EvalConfig),
    ("output", OutputConfig),
    ("flower", FlowerConfig),
    *((f.section, f.options) for f in FEATURES),
]


def _to_dict(self) -> dict:
    return dataclasses.asdict(self)


Config = dataclasses.make_dataclass(
    "Config",
    [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in _SECTIONS],
    namespace={"to_dict": _to_dict, "__doc__": "A whole run's configuration: one dataclass per section."},
)
Config.__module__ = __name__


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _fields(cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """``{name: (type, field)}`` of a section class (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _leaves(cls: type, prefix: str) -> typing.Iterator[tuple[str, Any, dataclasses.Field]]:
    """Every dotted key under a section, with its type and field (sub-sections walked into)."""
    for name, (tp, f) in _fields(cls).items():
        if _is_section(tp):
            yield from _leaves(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", tp, f


def valid_keys() -> list[str]:
    """Every dotted key a config may set."""
    return [key for name, cls in _SECTIONS for key, _, _ in _leaves(cls, f"{name}.")]


# keys renamed after runs were written with them: read under the new name (run folders must keep loading)
RENAMED = {"aggregation.florist.download_budget_mb": "aggregation.download_budget_mb"}


def legacy_keys() -> dict[str, str]:
    """The flat keys of the layout before methods owned their options, each with the key that replaced it:
    ``aggregation.<field>`` and ``aggregation.<method>_<field>`` (``client.`` alike)."""
    out = {}
    for section, registry in (("aggregation", STRATEGIES), ("client", ALGORITHMS)):
        for method, cls in registry.items():
            for f in dataclasses.fields(cls.options) if cls.options is not None else ():
                for old in (f"{section}.{f.name}", f"{section}.{method}_{f.name}"):
                    out.setdefault(old, f"{section}.{method}.{f.name}")
    return out


def choices(key: str) -> list[str] | None:
    """The valid values of an enumerated key (registries for strategies and algorithms), else None."""
    if key == "aggregation.name":
        return sorted(STRATEGIES)
    if key == "aggregation.server_opt":
        return ["none", *sorted(SERVER_OPTIMIZERS)]
    if key == "client.algorithm":
        return sorted(ALGORITHMS)
    for k, _, f in _leaves(Config, ""):
        if k == key:
            expect = f.metadata.get("expect", "")
            return (
                [c.strip() for c in expect[len("one of ") :].split(",")]
                if expect.startswith("one of ")
                else None
            )
    return None


def help_text() -> str:
    """One line per option: key, default, help and, for enumerated keys, the valid values."""
    lines = []
    for key, _, f in _leaves(Config, ""):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        valid = choices(key)
        valid_text = "; one of " + ", ".join(valid) if valid else ""
        lines.append(f"{key} (default {default!r}{valid_text}): {f.metadata['help']}")
    return "\n".join(lines)


def _check_fields_together(cfg) -> None:
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
    if cfg.federation.client_batch > 1 and cfg.lora.trainable_modules:
        raise ConfigError(
            f"federation.client_batch = {cfg.federation.client_batch} with lora.trainable_modules = "
            f"{cfg.lora.trainable_modules}: clients trained together would share one copy of those modules; "
            "set lora.trainable_modules=[] or federation.client_batch=1"
        )
    if cfg.data.label_shift_groups and cfg.data.dataset not in ("builtin", "testbed"):
        raise ConfigError(
            "data.label_shift_groups works on the built-in data only (data.dataset=builtin or testbed)"
        )
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
    moved = legacy_keys().get(key)
    if moved is not None:
        return ConfigError(
            f"config key '{key}' is now '{moved}' (each strategy's and algorithm's options live under its "
            "name)"
        )
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; run `fedllm run --help-config` for the list"
    return ConfigError(f"unknown config key '{key}'{hint}")


def set_key(cfg, key: str, value: Any) -> None:
    """Set one dotted key (type-checked; an unknown key is refused with the closest known one, an old flat
    key with the key that replaced it; a key renamed since a run was made is read under its new name, so
    that older run folders still load)."""
    key = RENAMED.get(key, key)
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        sub = _fields(type(obj)).get(part)
        if sub is None or not _is_section(sub[0]):
            raise _unknown(key)
        obj = getattr(obj, part)
    if obj is cfg or name not in (fields := _fields(type(obj))) or _is_section(fields[name][0]):
        raise _unknown(key)
    try:
        setattr(obj, name, coerce(key, value, fields[name][0]))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def apply_settings(cfg, settings: dict[str, Any]) -> None:
    """Set every dotted key of ``settings`` on ``cfg``."""
    for key, value in settings.items():
        set_key(cfg, key, value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None):
    """Build a validated config from an optional YAML file and ``key=value`` overrides (then the client
    algorithm's preset, ``client.preset``, for the keys neither sets)."""
    cfg = Config()
    explicit: set[str] = set()
    if path is not None:
        from data_prep.schema import read_text

        path = Path(path)
        text = read_text(path, "a YAML config file (see configs/)", ConfigError)
        explicit |= _apply_yaml(cfg, text, str(path))
    try:
        settings = dict(parse_override(text) for text in overrides or [])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    apply_settings(cfg, settings)
    apply_preset(cfg, explicit | set(settings))
    validate(cfg)
    return cfg


def apply_preset(cfg, explicit: set[str]) -> None:
    """``client.preset=paper``: the client algorithm's paper settings (its ``paper_preset``: optimizer,
    schedule, clip) for every key the config does not set itself."""
    if cfg.client.preset != "paper" or cfg.client.algorithm not in ALGORITHMS:
        return
    for key, value in ALGORITHMS[cfg.client.algorithm].paper_preset.items():
        if key not in explicit:
            set_key(cfg, key, value)


def config_from_text(text: str, name: str = "<resolved config>"):
    """A validated config from YAML text (e.g. the resolved config a Flower site receives)."""
    cfg = Config()
    apply_preset(cfg, _apply_yaml(cfg, text, name))
    validate(cfg)
    return cfg


def config_to_text(cfg) -> str:
    """The resolved config as YAML: what ``config.yaml`` holds and :func:`config_from_text` reads back."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def flat_config(cfg) -> dict[str, Any]:
    """``{"section.key": value}`` (``section.method.key`` for a method's options) of a config: what resumes
    compare, trackers log and digests cover."""
    out = {}
    for key, _, _ in _leaves(type(cfg), ""):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = obj
    return out


def _settings_of(data: dict, cls: type, prefix: str, where: str) -> dict[str, Any]:
    """The dotted settings of a YAML mapping for section class ``cls`` (sub-sections nested as mappings)."""
    out: dict[str, Any] = {}
    fields = _fields(cls)
    for name, value in data.items():
        key = f"{prefix}{name}"
        sub = fields.get(str(name))
        if sub is not None and _is_section(sub[0]):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}'{key}' must be a section (mapping), got {value!r}")
            out.update(_settings_of(value, sub[0], f"{key}.", where))
        else:
            out[key] = value
    return out


def _apply_yaml(cfg, text: str, name: str) -> set[str]:
    """The settings of config file ``name`` (its YAML ``text``) applied to ``cfg``; returns their keys."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {name} is not valid YAML: {e}") from None
    if not data:
        return set()
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name} must hold a mapping of sections")
    sections = dict(_SECTIONS)
    settings: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{name}: '{section}' must be a section (mapping), got {values!r}")
        if section not in sections:
            raise _unknown(f"{section}.{next(iter(values), '')}")
        settings.update(_settings_of(values, sections[section], f"{section}.", f"{name}: "))
    apply_settings(cfg, settings)
    return set(settings)


def validate(cfg) -> None:
    """Range checks of every field, then checks that span fields, then the table of refused
    combinations (``fedllm/config/rules.py``) and each method's own checks."""
    for key, _, f in _leaves(type(cfg), ""):
        check = f.metadata.get("check")
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if check is not None and not check(obj):
            raise ConfigError(f"{key} = {obj!r} is invalid: expected {f.metadata['expect']}")
    _check_fields_together(cfg)
    registries: list[tuple[str, Any]] = [
        ("aggregation.name", STRATEGIES),
        ("client.algorithm", ALGORITHMS),
        ("aggregation.server_opt", {"none": None, **SERVER_OPTIMIZERS}),
    ]
    for key, registry in registries:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) not in registry:
            raise ConfigError(
                f"{key} = {getattr(getattr(cfg, section), name)!r} is unknown; valid choices: "
                f"{', '.join(sorted(registry))}"
            )
    from fedllm.config.rules import refusal

    try:
        why = refusal(cfg)
    except ValueError as e:  # a method's own check
        raise ConfigError(str(e)) from None
    if why is not None:
        raise ConfigError(why)


def save_config(cfg, path: Path) -> None:
    """Write the resolved config as YAML (atomically, via the checkpoint helper)."""
    from fedllm.files import atomic_write_text

    atomic_write_text(path, config_to_text(cfg))


TOKEN_INDEXED = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")


def token_modules(cfg) -> list[str]:
    """The shared dense modules whose rows are indexed by token ids: the rows a client changes are the
    tokens of its data, so sharing them across organizations reveals those tokens."""
    return [m for m in cfg.lora.trainable_modules if m.split(".")[-1] in TOKEN_INDEXED]
