"""The vocabulary of options and rules, below every method and the config layer.

A strategy, a client algorithm or a feature declares its own options next to its code, as peft's LoRA
variants declare their configs: a dataclass whose fields are made with :func:`opt` (a default, the help
text ``fedllm run --help-config`` prints, and a range check), named by the class attribute ``options``.
The config layer (``fedllm/config/``) collects them under the method's name (``aggregation.floral.*``,
``client.perfedavg.*``) and validates them; the method never imports the config layer.

A :class:`Rule` is one refused combination and why, written against the methods' declared capabilities
(class attributes such as ``Strategy.linear``), never against their names; ``fedllm/config/rules.py``
holds the table and each feature adds its own.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, check: typing.Callable[[Any], bool] | None = None, expect: str = "") -> Any:
    """A config field with help text and an optional range check."""
    meta = {"help": help, "check": check, "expect": expect}
    if isinstance(default, list | dict):
        kind, items = type(default), default
        return field(default_factory=lambda: kind(items), metadata=meta)
    return field(default=default, metadata=meta)


def one_of(*choices: str) -> tuple[typing.Callable[[Any], bool], str]:
    """The check and the expectation of an enumerated option: ``opt(x, help, *one_of("a", "b"))``."""
    return (lambda x: x in choices), "one of " + ", ".join(choices)


def positive(x: Any) -> bool:
    return bool(x > 0)


def fraction(x: Any) -> bool:
    return bool(0 < x <= 1)


def nonneg(x: Any) -> bool:
    return bool(x >= 0)


CHOOSERS = {"aggregation": "name", "client": "algorithm"}  # the key of each section that names its method


def chosen_method(cfg: Any, section: str) -> str:
    """The method a config chooses in ``section``: ``aggregation.name``'s strategy, ``client.algorithm``'s
    algorithm."""
    return str(getattr(getattr(cfg, section), CHOOSERS[section]))


def chosen_option(cfg: Any, section: str, name: str, default: Any) -> Any:
    """Option ``name`` of the method a config chooses in ``section`` (:func:`chosen_method`), or ``default``
    where that method has no such option: what a rule or a check that spans methods reads
    (``aggregation.fedit.robust`` when the strategy is fedit)."""
    return getattr(getattr(getattr(cfg, section), chosen_method(cfg, section), None), name, default)


def chosen_key(cfg: Any, section: str, name: str) -> str:
    """The dotted key of :func:`chosen_option` (``aggregation.fedit.robust``), for messages."""
    return f"{section}.{chosen_method(cfg, section)}.{name}"


@dataclass(frozen=True)
class Rule:
    """A combination the config layer refuses before any work starts.

    ``applies(cfg, strategy, algorithm)`` gets the config and the registered classes of its strategy and
    client algorithm; ``why(cfg, strategy, algorithm)`` is the one-line message (what to change).
    ``name`` says what the rule protects, for the docs' table of rules.
    """

    name: str
    applies: typing.Callable[[Any, Any, Any], bool]
    why: typing.Callable[[Any, Any, Any], str]
