"""Whether a run trained on exactly the partition of a kept run and reproduces its held-out loss: the check
that adding a validation split changed nothing but what the design adds (docs/which-method.md).

    python scripts/check_same_partition.py RUN docs/results/which_method_smollm2/fedit/seed-0

The partitions (every client's size, categories, rank and train / test split) must be equal; the held-out
losses within ``--tolerance`` (floats differ across CPUs). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.run.reader import RunFolder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("kept", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.002)
    args = ap.parse_args()
    run, kept = RunFolder(args.run), RunFolder(args.kept)
    same_partition = run.partition() == kept.partition() and bool(kept.partition())
    a, b = run.summary().get("loss_after"), kept.summary().get("loss_after")
    a0, b0 = run.summary().get("loss_before"), kept.summary().get("loss_before")
    close = a is not None and b is not None and abs(a - b) <= args.tolerance
    verdict = "within" if close else "NOT within"
    print(f"partition {'equal' if same_partition else 'DIFFERS'}; held-out loss before round 1 {a0} here, "
          f"{b0} kept; after {a} here, {b} kept: {verdict} {args.tolerance}")  # fmt: skip
    print(json.dumps({"same_partition": same_partition, "loss_after": [a, b], "loss_before": [a0, b0],
                      "within_tolerance": close}))  # fmt: skip
    return 0 if same_partition and close else 1


if __name__ == "__main__":
    sys.exit(main())
