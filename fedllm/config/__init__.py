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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedllm.aggregation import SERVER_OPTIMIZERS, STRATEGIES
from fedllm.aggregation.fedex import FedExOptions
from fedllm.aggregation.fedit import FedITOptions
from fedllm.aggregation.fedsa import FedSAOptions
from fedllm.aggregation.fedsb import FedSBOptions
from fedllm.aggregation.flexlora import FlexLoRAOptions
from fedllm.aggregation.flora import FloraOptions
from fedllm.aggregation.floral import FloralOptions
from fedllm.aggregation.florist import FloristOptions
from fedllm.aggregation.hetlora import HetLoRAOptions
from fedllm.aggregation.local import LocalOptions
from fedllm.aggregation.server_opt import FedAdagradOptions, FedAdamOptions, FedAvgMOptions, FedYogiOptions
from fedllm.client import ALGORITHMS
from fedllm.client.fedprox import FedProxOptions
from fedllm.client.perfedavg import PerFedAvgOptions
from fedllm.client.scaffold import ScaffoldOptions
from fedllm.client.sft import SFTOptions
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
from fedllm.options import CHOOSERS, chosen_key, chosen_method
from fedllm.privacy.options import PrivacyOptions
from fedllm.secagg.options import SecAggOptions
from fedllm.transport import TransportOptions

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


def _own(options: type, method: str) -> Any:
    """The field of a method's own options in its section (``aggregation.<method>``, ``client.<method>``)."""
    return dataclasses.field(default_factory=options, metadata={"method": method})


@dataclass
class AggregationConfig(AggregationSection):
    """``aggregation.*``: the strategy, the server's defences, and each strategy's and server optimizer's own
    options under its name. Written out so that a type checker reads ``cfg.aggregation.floral.router_lr``;
    :func:`_check_owned` fails at import when a registered method's options have no field here."""

    fedex: FedExOptions = _own(FedExOptions, "fedex")
    fedit: FedITOptions = _own(FedITOptions, "fedit")
    fedsa: FedSAOptions = _own(FedSAOptions, "fedsa")
    fedsb: FedSBOptions = _own(FedSBOptions, "fedsb")
    flexlora: FlexLoRAOptions = _own(FlexLoRAOptions, "flexlora")
    flora: FloraOptions = _own(FloraOptions, "flora")
    floral: FloralOptions = _own(FloralOptions, "floral")
    florist: FloristOptions = _own(FloristOptions, "florist")
    hetlora: HetLoRAOptions = _own(HetLoRAOptions, "hetlora")
    local: LocalOptions = _own(LocalOptions, "local")
    fedadagrad: FedAdagradOptions = _own(FedAdagradOptions, "fedadagrad")
    fedadam: FedAdamOptions = _own(FedAdamOptions, "fedadam")
    fedavgm: FedAvgMOptions = _own(FedAvgMOptions, "fedavgm")
    fedyogi: FedYogiOptions = _own(FedYogiOptions, "fedyogi")


@dataclass
class ClientConfig(ClientSection):
    """``client.*``: what every client algorithm uses, and each algorithm's own options under its name."""

    fedprox: FedProxOptions = _own(FedProxOptions, "fedprox")
    perfedavg: PerFedAvgOptions = _own(PerFedAvgOptions, "perfedavg")
    scaffold: ScaffoldOptions = _own(ScaffoldOptions, "scaffold")
    sft: SFTOptions = _own(SFTOptions, "sft")


@dataclass
class Config:
    """A whole run's configuration: one dataclass per section (the features' sections last)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    federation: FederationConfig = dataclasses.field(default_factory=FederationConfig)
    client: ClientConfig = dataclasses.field(default_factory=ClientConfig)
    aggregation: AggregationConfig = dataclasses.field(default_factory=AggregationConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    flower: FlowerConfig = dataclasses.field(default_factory=FlowerConfig)
    privacy: PrivacyOptions = dataclasses.field(default_factory=PrivacyOptions)
    secagg: SecAggOptions = dataclasses.field(default_factory=SecAggOptions)
    comm: TransportOptions = dataclasses.field(default_factory=TransportOptions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_owned(section: type, registry: dict[str, Any], where: str) -> None:
    """Every registered method that declares options has its field in ``section``, of that type (and no field
    names a method that is not registered): a new strategy, algorithm or feature fails here, at import, with
    what to add, instead of its options silently missing from every config."""
    hints = typing.get_type_hints(section)
    own = {f.name for f in dataclasses.fields(section) if "method" in f.metadata}
    for method, cls in registry.items():
        options = getattr(cls, "options", None)
        if options is not None and hints.get(method) is not options:
            raise TypeError(
                f"{where}: {method}'s options {options.__name__} have no field "
                f"'{method}: {options.__name__}' in {section.__name__} (fedllm/config/__init__.py); add it"
            )
    stale = own - {m for m, c in registry.items() if getattr(c, "options", None) is not None}
    if stale:
        raise TypeError(f"{section.__name__} has fields for no registered method: {sorted(stale)}")


_check_owned(AggregationConfig, {**STRATEGIES, **SERVER_OPTIMIZERS}, "aggregation")
_check_owned(ClientConfig, ALGORITHMS, "client")


def _check_features(config: type, features: list[Any]) -> None:
    """Every feature's section is a field of ``config`` of its options' type (as :func:`_check_owned`)."""
    hints = typing.get_type_hints(config)
    for feature in features:
        if hints.get(feature.section) is not feature.options:
            raise TypeError(
                f"feature section '{feature.section}' ({feature.options!r}) has no field in Config "
                "(fedllm/config/__init__.py); add it"
            )


_check_features(Config, FEATURES)

_SECTIONS: list[tuple[str, type]] = list(typing.get_type_hints(Config).items())


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _fields(cls: type) -> dict[str, tuple[Any, dataclasses.Field[Any]]]:
    """``{name: (type, field)}`` of a section class (annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _leaves(cls: type, prefix: str) -> typing.Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """Every dotted key under a section, with its type and field (sub-sections walked into)."""
    for name, (tp, f) in _fields(cls).items():
        if _is_section(tp):
            yield from _leaves(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", tp, f


def valid_keys() -> list[str]:
    """Every dotted key a config may set."""
    return [key for name, cls in _SECTIONS for key, _, _ in _leaves(cls, f"{name}.")]


@dataclass(frozen=True)
class Moved:
    """A key that moved from a general section into the options of the methods that use it
    (``aggregation.robust`` -> ``aggregation.fedit.robust``). The old key still loads, as the chosen method's
    option, with a FutureWarning (run folders and configs written before the move keep working); under a
    method that does not own it, its default is ignored, and another value is refused where the old key was
    refused too (``refused_elsewhere``) and ignored with a warning where it did nothing."""

    section: str  # the section whose chosen method owns it: aggregation (aggregation.name) or client
    owners: tuple[str, ...]
    default: Any
    refused_elsewhere: bool


MOVED: dict[str, Moved] = {
    "aggregation.robust": Moved("aggregation", ("fedit",), "none", True),
    "aggregation.trim_fraction": Moved("aggregation", ("fedit",), 0.1, False),
    "aggregation.download_budget_mb": Moved("aggregation", ("fedit", "flexlora", "florist"), 0.0, True),
    "federation.catchup_window": Moved("aggregation", ("fedex", "flora", "florist"), 8, False),
    "client.optimizer": Moved("client", ("fedprox", "sft"), "adamw", False),
}


def _keys(section: str, methods: typing.Iterable[str], name: str) -> str:
    """``section.<method>.name`` of each method, for a message."""
    return ", ".join(f"{section}.{m}.{name}" for m in methods)


class MovedKeyWarning(FutureWarning):
    """A config set a key that moved into its method's options (:data:`MOVED`); it was read as the new key."""


def _moved_to(cfg: Config, old: str, value: Any, warn: bool) -> tuple[str, Any] | None:
    """The key an old, moved key's ``value`` now sets under ``cfg``'s chosen method, and the value (None:
    nothing to set); refuses it where the chosen method cannot take it, and says when it is ignored."""
    m = MOVED[old]
    name = old.rsplit(".", 1)[1]
    try:
        value = coerce(old, value, type(m.default))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    method = chosen_method(cfg, m.section)
    chooser = f"{m.section}.{CHOOSERS[m.section]}"
    owners = _keys(m.section, m.owners, name)
    if method in m.owners:
        return chosen_key(cfg, m.section, name), value
    if value == m.default:
        return None
    if m.refused_elsewhere:
        raise ConfigError(
            f"config key '{old}' = {value!r} is now {owners}; {chooser} = {method} has no such option"
        )
    if warn:
        warnings.warn(
            f"config key '{old}' = {value!r} did nothing for {chooser} = {method} and is ignored; it is now "
            f"{owners}",
            MovedKeyWarning,
            stacklevel=4,
        )
    return None


def _get(cfg: Config, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg``."""
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def legacy_keys() -> dict[str, str]:
    """The flat keys of the layout before methods owned their options, each with the key that replaced it:
    ``aggregation.<field>`` and ``aggregation.<method>_<field>`` (``client.`` alike)."""
    out: dict[str, str] = {}
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
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        valid = choices(key)
        valid_text = "; one of " + ", ".join(valid) if valid else ""
        lines.append(f"{key} (default {default!r}{valid_text}): {f.metadata['help']}")
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
    if key in MOVED:
        m = MOVED[key]
        name = key.rsplit(".", 1)[1]
        return ConfigError(
            f"config key '{key}' is now "
            + _keys(m.section, m.owners, name)
            + " (the option of the methods that use it)"
        )
    section, _, rest = key.partition(".")
    method, _, name = rest.partition(".")
    registries: dict[str, dict[str, Any]] = {
        "aggregation": {**STRATEGIES, **SERVER_OPTIMIZERS},
        "client": ALGORITHMS,
    }
    registry = registries.get(section, {})
    if method in registry and name and "." not in name:
        owners = [
            m
            for m, c in sorted(registry.items())
            if c.options and name in {f.name for f in dataclasses.fields(c.options)}
        ]
        if owners:
            return ConfigError(
                f"unknown config key '{key}': {method} has no option '{name}'; it is an option of "
                + _keys(section, owners, name)
            )
    moved = legacy_keys().get(key)
    if moved is not None:
        return ConfigError(
            f"config key '{key}' is now '{moved}' (each strategy's and algorithm's options live under its "
            "name)"
        )
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; run `fedllm run --help-config` for the list"
    return ConfigError(f"unknown config key '{key}'{hint}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set one dotted key (type-checked; an unknown key is refused with the closest known one, an old flat
    key with the key that replaced it; a key that moved into a method's options: :func:`_apply_layers`)."""
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


def _apply_layers(cfg: Config, layers: list[tuple[dict[str, Any], bool]]) -> set[str]:
    """Each layer's settings in order (a config file, then the overrides: a later layer's value wins); returns
    the keys set. A key that moved into its method's options (:data:`MOVED`) is resolved last, under the
    method every layer together chooses (an old key in a file follows an ``aggregation.name`` given as an
    override). Where a layer also sets the new key, the later layer wins; within one layer an old key at its
    default gives way, and two different values are refused. A layer marked ``True`` is a config fedllm wrote
    itself (a run folder's ``config.yaml``): its old keys load without a warning."""
    layer_of: dict[str, int] = {}
    moved: list[tuple[int, str, Any, bool]] = []
    for i, (settings, written) in enumerate(layers):
        for key, value in settings.items():
            if key in MOVED:
                moved.append((i, key, value, written))
            else:
                set_key(cfg, key, value)
                layer_of[key] = i
    for i, old, raw, written in moved:
        if (got := _moved_to(cfg, old, raw, warn=not written)) is None:
            continue
        new, value = got
        j = layer_of.get(new)
        if j is not None and (j > i or (j == i and value == MOVED[old].default)):
            continue  # the new key, set by a later layer (or beside the old one left at its default)
        if j == i and value != _get(cfg, new):
            raise ConfigError(
                f"config keys '{old}' = {value!r} and '{new}' = {_get(cfg, new)!r}: set only '{new}'"
            )
        if value != MOVED[old].default and not written:
            warnings.warn(
                f"config key '{old}' is now '{new}'; it was read as that", MovedKeyWarning, stacklevel=3
            )
        set_key(cfg, new, value)
        layer_of[new] = i
    return set(layer_of)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, written: bool = False
) -> Config:
    """Build a validated config from an optional YAML file and ``key=value`` overrides (then the client
    algorithm's preset, ``client.preset``, for the keys neither sets). ``written``: the file is a config
    fedllm wrote itself (a run folder's resolved ``config.yaml``), whose keys of an older layout load
    silently (the user did not type them)."""
    cfg = Config()
    layers: list[tuple[dict[str, Any], bool]] = []
    if path is not None:
        from data_prep.schema import read_text

        path = Path(path)
        text = read_text(path, "a YAML config file (see configs/)", ConfigError)
        layers.append((_yaml_settings(text, str(path)), written))
    try:
        layers.append((dict(parse_override(text) for text in overrides or []), False))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    apply_preset(cfg, _apply_layers(cfg, layers))
    validate(cfg)
    return cfg


def apply_preset(cfg: Config, explicit: set[str]) -> None:
    """``client.preset=paper``: the client algorithm's paper settings (its ``paper_settings()``: optimizer,
    schedule, clip) for every key the config does not set itself."""
    if cfg.client.preset != "paper" or cfg.client.algorithm not in ALGORITHMS:
        return
    for key, value in ALGORITHMS[cfg.client.algorithm].paper_settings().items():
        if key not in explicit:
            set_key(cfg, key, value)


def config_from_text(text: str, name: str = "<resolved config>") -> Config:
    """A validated config from YAML text (e.g. the resolved config a Flower site receives)."""
    cfg = Config()
    apply_preset(cfg, _apply_layers(cfg, [(_yaml_settings(text, name), True)]))
    validate(cfg)
    return cfg


def config_to_text(cfg: Config) -> str:
    """The resolved config as YAML: what ``config.yaml`` holds and :func:`config_from_text` reads back."""
    text: str = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    return text


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"section.key": value}`` (``section.method.key`` for a method's options) of a config: what resumes
    compare, trackers log and digests cover."""
    return {key: _get(cfg, key) for key, _, _ in _leaves(type(cfg), "")}


def _settings_of(data: dict[str, Any], cls: type, prefix: str, where: str) -> dict[str, Any]:
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


def _yaml_settings(text: str, name: str) -> dict[str, Any]:
    """The dotted settings of config file ``name`` (its YAML ``text``)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {name} is not valid YAML: {e}") from None
    if not data:
        return {}
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
    return settings


def validate(cfg: Config) -> None:
    """Range checks of every field, then checks that span fields, then the table of refused
    combinations (``fedllm/config/rules.py``) and each method's own checks."""
    for key, _, f in _leaves(type(cfg), ""):
        check = f.metadata.get("check")
        obj = _get(cfg, key)
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


CLIP_ACROSS_ORGANIZATIONS = 2.0  # aggregation.clip_norm_ratio=auto where the sites are other organizations


def settle_clip(cfg: Config, organizations: bool) -> float:
    """Settle ``aggregation.clip_norm_ratio: auto`` in place and return the ratio the server uses: off where
    one job runs every client (the operator's own code and data: a clip only changes the method from its
    paper), :data:`CLIP_ACROSS_ORGANIZATIONS` where the clients are other organizations' sites, whose updates
    the server cannot vouch for."""
    if cfg.aggregation.clip_norm_ratio == "auto":
        cfg.aggregation.clip_norm_ratio = CLIP_ACROSS_ORGANIZATIONS if organizations else 0.0
    return float(cfg.aggregation.clip_norm_ratio)


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically, via the checkpoint helper)."""
    from fedllm.files import atomic_write_text

    atomic_write_text(path, config_to_text(cfg))


TOKEN_INDEXED = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")


def token_modules(cfg: Config) -> list[str]:
    """The shared dense modules whose rows are indexed by token ids: the rows a client changes are the
    tokens of its data, so sharing them across organizations reveals those tokens."""
    return [m for m in cfg.lora.trainable_modules if m.split(".")[-1] in TOKEN_INDEXED]
