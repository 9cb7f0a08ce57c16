"""Split a config's data into one folder per Flower site, for a deployment on one machine.

``scripts/run_flower_local.sh`` calls this before it starts the SuperNodes: each
site gets ``OUT/site-K/data.jsonl`` (its partition of the run's data, in
fedllm's own jsonl format, which any site would point ``data-path`` at) and
``OUT/site-K/node-config`` (its SuperNode's ``--node-config``), and the
resolved config goes to ``OUT/config.yaml``. Prints the number of sites.

    python scripts/flower_sites.py OUT [CONFIG|default] [--bound] [key=value ...]

``--bound``: each site holds its node key (``OUT/site-K/node-key``) and the federation's registry
(``OUT/registry.txt``); then, in a run with ``flower.secure_aggregation=true``, each site is pinned to it
(``secure-aggregation='required'``: it refuses a plain train message, so no server can have its update in
the clear by asking for a plain round). An unbound site cannot be pinned (a pinned site needs the registry
to check its neighbours' keys).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.config import Config, ConfigError, load_config, save_config
from fedllm.federation_data import load_partitions
from fedllm.files import atomic_write_text
from fedllm.flower.identity import refuse_token_modules


def write_site_partitions(cfg: Config, out: Path) -> list[Path]:
    """The run's partition, one folder per site with its examples as jsonl; the resolved config beside."""
    paths = []
    for k, examples in enumerate(load_partitions(cfg).clients):
        path = Path(out) / f"site-{k}" / "data.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        records = (
            {"instruction": e.instruction, "input": e.input, "response": e.response, "category": e.category}
            for e in examples
        )
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    save_config(cfg, Path(out) / "config.yaml")
    return paths


def node_config(out: Path, k: int, bound: bool, secure: bool) -> str:
    """Site ``k``'s ``--node-config``: its client id, data and state folder; bound, its node key and the
    registry; bound and secure, pinned to secure aggregation."""
    site = Path(out).resolve() / f"site-{k}"
    parts = [f"client-id={k}", f"data-path='{site / 'data.jsonl'}'", f"state-dir='{site / 'state'}'"]
    if bound:
        parts += [f"sign-key='{site / 'node-key'}'", f"registry='{Path(out).resolve() / 'registry.txt'}'"]
        if secure:
            parts.append("secure-aggregation='required'")  # Flower's node config wants a text quoted
    return " ".join(parts)


def main(argv: list[str]) -> int:
    bound = "--bound" in argv
    argv = [a for a in argv if a != "--bound"]
    out, config, overrides = Path(argv[0]), (argv[1] if len(argv) > 1 else "default"), argv[2:]
    try:
        cfg = load_config(None if config == "default" else config, overrides)
        refuse_token_modules(cfg)  # before any site starts: the ServerApp would refuse it too
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k, path in enumerate(write_site_partitions(cfg, out)):
        text = node_config(out, k, bound, bool(cfg.flower.secure_aggregation))
        atomic_write_text(path.parent / "node-config", text + "\n")
    if cfg.flower.secure_aggregation and not bound:
        print(
            "warning: secure aggregation on unbound sites (no node keys, no registry): each site keeps only "
            "the checks of a single message; it cannot be pinned, check its neighbours' keys, or sign the "
            "round's statement (docs/trust.md)",
            file=sys.stderr,
        )
    print(cfg.federation.num_clients)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
