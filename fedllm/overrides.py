"""Reading settings into the typed config: YAML sections and dotted ``key=value`` overrides.

Each value is checked against the field's annotated type (with YAML 1.1's
quirks: ``1e-4`` is read as a string) before the config layer range-checks
it; an unknown key gets a "did you mean" from the known ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any

import yaml

from fedllm.config import SECTIONS, Config, ConfigError, valid_keys

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; run `fedllm run --help-config` for the list"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotated type, converting int -> float."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _coerce(key, value, arm)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {tp}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):  # YAML 1.1 reads "1e-4" as a string
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str | int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list | tuple):
            return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    elif origin is dict:
        kt, vt = typing.get_args(tp)
        if isinstance(value, dict):
            return {_coerce(f"{key} key", k, kt): _coerce(f"{key}[{k}]", v, vt) for k, v in value.items()}
    elif value is None and tp is type(None):
        return None
    raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in SECTIONS:
        raise _unknown(key)
    section = getattr(cfg, parts[0])
    fields = {f.name: f for f in dataclasses.fields(section)}
    if parts[1] not in fields:
        raise _unknown(key)
    hints = typing.get_type_hints(type(section))
    setattr(section, parts[1], _coerce(key, value, hints[parts[1]]))


def flatten(data: dict, prefix: str = "", where: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if not prefix and isinstance(v, dict):
            out.update(flatten(v, f"{key}.", where))
        elif not prefix:
            raise ConfigError(f"{where}'{key}' must be a section (mapping), got {v!r}")
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` with the value read as YAML (numbers, lists, booleans)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e})") from None
    return key.strip(), value


def apply_settings(cfg: Config, settings: dict[str, Any]) -> None:
    """Set every dotted key of ``settings`` on ``cfg`` (type-checked; unknown keys refused)."""
    for key, value in settings.items():
        set_key(cfg, key, value)
