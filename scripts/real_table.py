"""The strategies table of docs/real-parts.md from the runs finished so far, as a markdown table.

`fedllm compare` prints its paired table when every run of every seed is in; a table that spans sessions
is read before that. Here each variant is paired with FedIT over the seeds both have finished, so a row
says which seeds it holds.

    python scripts/real_table.py runs/real_table
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from fedllm.run.compare import describe, paired, run_metrics
from fedllm.run.reader import RunFolder

NAMES = [
    "fedit",
    "flora",
    "flexlora",
    "florist",
    "fedex",
    "hetlora",
    "fedsvd",
    "rolora",
    "local",
    "centralized",
]


def fmt(x: float, spec: str) -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


def main(root: Path) -> None:
    res: dict[str, dict[int, dict]] = {}
    for name in NAMES:
        res[name] = {}
        for seed in range(3):
            run = root / name / f"seed-{seed}"
            if run.is_dir() and RunFolder(run).is_finished():
                res[name][seed] = run_metrics(run)
    print("| method | seeds | held-out loss | vs FedIT [95 % CI] | Rouge-L | vs FedIT [95 % CI] "
          "| general agreement | down MB | run s (seeds 1, 2) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in NAMES:
        have = sorted(res[name])
        if not have:
            continue
        both = sorted(set(have) & set(res["fedit"]))
        row = [name, ",".join(map(str, have))]
        for metric, spec in (("heldout_loss", ".4f"), ("rouge_l", ".2f")):
            d = describe([res[name][s][metric] for s in have])
            row.append(f"{fmt(d['mean'], spec)} ± {fmt(d['std'], spec)}")
            if name == "fedit":
                row.append("—")
                continue
            p = paired([res[name][s][metric] for s in both], [res["fedit"][s][metric] for s in both])
            sign = "+" + spec
            interval = f"[{fmt(p['low'], sign)}, {fmt(p['high'], sign)}]"
            row.append(f"{fmt(p['diff'], sign)} {interval}" + ("" if p["excludes_zero"] else " (holds 0)"))
        g = describe([res[name][s]["general_agreement"] for s in have])
        row.append(f"{g['mean']:.1f} ± {g['std']:.1f}")
        down = [res[name][s]["down_mb"] for s in have]
        row.append("n/a" if None in down else f"{sum(down) / len(down) / 1e6:.1f}")
        row.append(" / ".join(f"{res[name][s]['wall_s']:.0f}" for s in have if s > 0))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/real_table"))
