"""Reading settings: YAML sections, dotted ``key=value`` overrides, and values checked against a field's type.

Schema-free: the config layer (``fedllm/config/__init__.py``) owns the fields and
turns the ``ValueError`` s raised here into errors that name the key. Values
are read as YAML, with YAML 1.1's quirks handled (``1e-4`` is read as a
string, and is a float here).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import yaml

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _list_hint(key: str, value: Any) -> str:
    """How to write a list on the command line, when a value looks like one written without brackets."""
    if isinstance(value, str) and "," in value:
        return f" (write lists in brackets: {key}=[{value.strip()}])"
    return ""


def coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotated type ``tp`` (int -> float allowed); ValueError naming
    ``key``.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return coerce(key, value, arm)
            except ValueError:
                continue
        raise ValueError(f"{key}: expected {tp}, got {value!r}")
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
        if isinstance(value, str) and "," in value:
            raise ValueError(f"{key}: expected a list, got {value!r}{_list_hint(key, value)}")
        if isinstance(value, str | int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list | tuple):
            return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    elif origin is dict:
        kt, vt = typing.get_args(tp)
        if isinstance(value, dict):
            return {coerce(f"{key} key", k, kt): coerce(f"{key}[{k}]", v, vt) for k, v in value.items()}
    elif value is None and tp is type(None):
        return None
    raise ValueError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def flatten(data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of a YAML mapping of sections (``where`` prefixes error messages)."""
    out: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"{where}'{section}' must be a section (mapping), got {values!r}")
        out.update({f"{section}.{k}": v for k, v in values.items()})
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` with the value read as YAML (numbers, lists, booleans)."""
    if "=" not in text:
        raise ValueError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override '{text}': value is not valid YAML ({e})") from None
    return key.strip(), value
