"""Each variant's chosen value recomputed, read-only, from nothing but the kept tuning runs of a comparison
(``OUT/tuning/<variant>/<point>/seed-<s>``), with the same rule ``fedllm compare --tune`` applied; beside it,
what the comparison recorded (``OUT/tuning/tuning.json``), whether the two agree, the rows within a margin of
the best one (the design's "close to the best" rule) and the matched-drift reading against the baseline.

    python scripts/tuning_choice.py runs/which_method_tuned_smollm2 --baseline fedit \
        --candidates fedex hetlora rolora --references local centralized --close 0.02

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.run.compare import format_tuning
from fedllm.run.compare.summary import matched_drift
from fedllm.run.compare.tuning import record_from_folders


def best_score(t: dict) -> float | None:
    """The score of a variant's chosen point (its mean over every tuning seed)."""
    return next((p["mean"] for p in t["points"] if p["tag"] == t["chosen_tag"]), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the comparison's folder (its tuning runs under OUT/tuning)")
    ap.add_argument("--metric", default="validation_loss")
    ap.add_argument("--baseline", default="fedit")
    ap.add_argument("--candidates", nargs="*", default=[], help="rows that join the table only when close")
    ap.add_argument("--references", nargs="*", default=[], help="rows that are never the best")
    ap.add_argument("--close", type=float, default=0.02, help="the margin of 'close to the best'")
    args = ap.parse_args()
    record = record_from_folders(args.out / "tuning", args.metric)
    print(format_tuning(record))
    kept_path = args.out / "tuning" / "tuning.json"
    kept = json.loads(kept_path.read_text()) if kept_path.is_file() else None
    agree = None
    if kept is not None:
        mine = {n: t["chosen"] for n, t in record["variants"].items()}
        theirs = {n: t["chosen"] for n, t in kept["variants"].items()}
        agree = mine == theirs
        print(f"\nrecomputed choices {'agree' if agree else 'DIFFER'} with {kept_path}")
        for n in sorted(set(mine) | set(theirs)):
            if mine.get(n) != theirs.get(n):
                print(f"  {n}: recomputed {mine.get(n)}, recorded {theirs.get(n)}")
    scores = {n: best_score(t) for n, t in record["variants"].items()}
    federated = {n: s for n, s in scores.items() if n not in args.references and s is not None}
    best = min(federated, key=lambda n: federated[n]) if federated else None
    joins = {
        n: scores[n] is not None and best is not None and scores[n] - federated[best] <= args.close
        for n in args.candidates
    }
    if best is not None:
        print(f"\nbest federated row on {args.metric}: {best} ({federated[best]:.4f}); within {args.close}:")
        for n, j in joins.items():
            s = scores[n]
            gap = "n/a" if s is None else f"{s - federated[best]:+.4f}"
            print(f"  {n}: {gap} -> {'joins the table' if j else 'stays out'}")
    drift = matched_drift(record, args.baseline)
    if drift:
        print(f"\nat matched drift against {args.baseline} (descriptive):")
        for n, d in drift.items():
            print(
                f"  {n}: {d['reading']}"
                + (f", mean difference {d['mean_diff']:+.4f}" if "mean_diff" in d else "")
            )
    chosen = {n: t["chosen"] for n, t in record["variants"].items()}
    print(json.dumps({"chosen": chosen, "scores": scores, "agrees_with_record": agree, "best": best,
                      "joins": joins, "matched_drift": drift}))  # fmt: skip


if __name__ == "__main__":
    main()
