"""A comparison's variants: what each is, and the config each of its runs resolves to (loaded once).

A variant is a name and config overrides (``name:key=value,key=value``). Every run of a comparison is one
variant at one seed (and, while tuning, at one point of its grid): :class:`Planned` holds that run's
settled config, loaded once here and read by the staleness check, the digest, the base's build and the
run itself, so the config package is walked once per run, not once per use.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedllm import __version__

NOT_NUMBERS = ("output.", "flower.")  # config keys that change neither the trajectory nor the numbers


@dataclass
class Variant:
    name: str
    overrides: list[str] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """``name`` or ``name:key=value,key=value`` (a value may not contain a comma: use a config file for
    lists).
    """
    name, _, rest = text.partition(":")
    if not name.isidentifier():
        raise ValueError(
            f"--variant {text!r}: the name before ':' must be an identifier, "
            "e.g. fedit:aggregation.name=fedit"
        )
    overrides = [o for o in rest.split(",") if o] if rest else []
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"--variant {text!r}: {o!r} is not key=value")
    return Variant(name, overrides)


def numbers_config(cfg: Any) -> dict[str, Any]:
    """The config keys that decide a run's numbers (all but :data:`NOT_NUMBERS`)."""
    from fedllm.config import flat_config

    return {k: v for k, v in flat_config(cfg).items() if not k.startswith(NOT_NUMBERS)}


def config_digest(cfg: Any) -> str:
    """A short digest of :func:`numbers_config` and the fedllm version."""
    text = json.dumps({"config": numbers_config(cfg), "version": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def settled(cfg: Any) -> Any:
    """``cfg`` with what a run settles before it starts settled the same way here (``auto`` mixed precision
    on this machine, the clip of a one-job run), so a finished run's config.yaml compares equal."""
    from fedllm.config import settle_clip
    from fedllm.model.precision import resolve

    resolve(cfg)
    settle_clip(cfg, organizations=False)
    return cfg


@dataclass
class Planned:
    """One run of a comparison: its variant (``name``), seed, folder, the overrides it is started with
    (the seed's last) and its settled config."""

    name: str
    seed: int
    run_dir: Path
    overrides: list[str]
    cfg: Any

    @property
    def label(self) -> str:
        return f"{self.name} seed {self.seed}"


def plan(
    config: str | None, name: str, overrides: list[str], seeds: list[int], folder: Path
) -> list[Planned]:
    """The runs of one variant (``overrides`` after the comparison's common ones) over ``seeds``, in
    ``folder/seed-<s>``, each config loaded and settled once."""
    from fedllm.config import load_config

    return [
        Planned(
            name,
            s,
            folder / f"seed-{s}",
            [*overrides, f"federation.seed={s}"],
            settled(load_config(config, [*overrides, f"federation.seed={s}"])),
        )
        for s in seeds
    ]


def variant_digest(config: str | None, overrides: list[str]) -> str:
    """The variant's config digest: its config without a comparison's seed (one digest for every seed)."""
    from fedllm.config import load_config

    return config_digest(settled(load_config(config, overrides)))
