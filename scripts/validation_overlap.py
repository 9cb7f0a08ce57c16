"""How many of the tuning seeds' validation chats are among the table seeds' held-out test chats.

Each seed's validation split is drawn from what that seed's own sample leaves unused, so it never touches
that seed's clients or test chats; but the table's seeds draw other samples, whose test chats can be among
the conversations a tuning seed left unused. Those chats then take part in a choice (the rate) and in the
table's primary endpoint. This counts them, by source (a chat's parts and copies share one), so the design
page can say how many there are (docs/which-method.md).

    python scripts/validation_overlap.py --config configs/compare_sharegpt_smollm2.yaml \
        --tune-seeds 1000 1001 --table-seeds 0 1 2 3 4 5 6 7 8 9 --validation-size 64

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def sources(config: str, seed: int, split: str, size: int) -> set[str]:
    """The sources (:attr:`Example.group`, else the instruction) of seed ``seed``'s ``split`` chats."""
    from fedllm.config import load_config
    from fedllm.federation_data import load_partitions

    cfg = load_config(
        config, [f"federation.seed={seed}", f"data.validation_size={size}", f"eval.split={split}"]
    )
    return {e.group or e.instruction for e in load_partitions(cfg).eval_examples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/compare_sharegpt_smollm2.yaml")
    ap.add_argument("--tune-seeds", type=int, nargs="+", default=[1000, 1001])
    ap.add_argument("--table-seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--validation-size", type=int, default=64)
    args = ap.parse_args()
    validation = {s: sources(args.config, s, "validation", args.validation_size) for s in args.tune_seeds}
    test = {s: sources(args.config, s, "test", args.validation_size) for s in args.table_seeds}
    every_test = set().union(*test.values())
    shared = {
        str(v): {str(t): len(chats & test[t]) for t in args.table_seeds if chats & test[t]}
        for v, chats in validation.items()
    }
    total = sum(len(chats & every_test) for chats in validation.values())
    n_val = sum(len(chats) for chats in validation.values())
    print(f"{total} of the {n_val} validation sources (tuning seeds {args.tune_seeds}) are among the "
          f"{len(every_test)} test sources of table seeds {args.table_seeds}; by seed: {shared}")  # fmt: skip
    print(json.dumps({"shared": total, "validation_sources": n_val, "test_sources": len(every_test),
                      "by_seed": shared, "config": args.config}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
