"""How many seeds a table needs: the paired per-seed spread of each row against the baseline in kept runs,
and the smallest number of seeds at which a paired t-test at family level 0.05 over m comparisons detects a
given difference with 80 % power (``fedllm.run.stats.detectable``, exact on the noncentral t).

    python scripts/power_analysis.py docs/results/which_method_smollm2 --baseline fedit \
        --rows flora flexlora florist floral fedsvd --effect 0.02 --m 5 7

Run before a table's runs, on an earlier table's runs, and written down with the design: the spread of a
later table (other rates, another model) may differ, so the design also says what it can detect at the spread
it will have. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.run.compare import run_metrics
from fedllm.run.reader import RunFolder
from fedllm.run.stats import detectable


def per_seed(out: Path, row: str, metric: str) -> dict[int, float]:
    """``metric`` of every finished run of ``row`` under ``out`` (``out/row/seed-s``), by seed."""
    got = {}
    for d in sorted((out / row).glob("seed-*")):
        if RunFolder(d).is_finished():
            v = run_metrics(d).get(metric)
            if v is not None:
                got[int(d.name.removeprefix("seed-"))] = float(v)
    return got


def seeds_needed(sd: float, effect: float, m: int, most: int = 400) -> int | None:
    """The fewest seeds (from 2) at which :func:`detectable` is at most ``effect`` (None past ``most``)."""
    for n in range(2, most + 1):
        if detectable(sd, n, m) <= effect:
            return n
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="a comparison's folder (OUT/<row>/seed-<s>)")
    ap.add_argument("--baseline", default="fedit")
    ap.add_argument("--rows", nargs="+", required=True, help="the rows of the family, against the baseline")
    ap.add_argument("--metric", default="heldout_loss")
    ap.add_argument("--effect", type=float, nargs="+", default=[0.02], help="differences to detect")
    ap.add_argument("--m", type=int, nargs="+", default=[5], help="family sizes (comparisons at once)")
    args = ap.parse_args()
    base = per_seed(args.out, args.baseline, args.metric)
    sds: dict[str, float] = {}
    for row in args.rows:
        vals = per_seed(args.out, row, args.metric)
        seeds = sorted(set(vals) & set(base))
        diffs = [vals[s] - base[s] for s in seeds]
        if len(diffs) >= 2:
            sds[row] = statistics.stdev(diffs)
            print(f"{row:<12} sd of {row} - {args.baseline} over seeds {seeds}: {sds[row]:.4f}")
    spread = {"median": statistics.median(sds.values()), "largest": max(sds.values())}
    table = {}
    for which, sd in spread.items():
        for effect in args.effect:
            for m in args.m:
                n = seeds_needed(sd, effect, m)
                table[f"{which} sd {sd:.4f}, effect {effect:g}, m {m}"] = n
                print(f"{which} sd {sd:.4f}: detect {effect:g} at 80 % power with m = {m}: {n} seeds")
    print(json.dumps({"metric": args.metric, "baseline": args.baseline, "sd": sds, "spread": spread,
                      "seeds_needed": table}))  # fmt: skip


if __name__ == "__main__":
    main()
