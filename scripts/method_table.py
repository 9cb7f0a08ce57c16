"""The comparison's table from the runs finished so far: every row over the seeds all rows have, with the
family-corrected paired differences of ``fedllm compare`` (against the baseline and against the best
federated row, Holm p-values, Bonferroni intervals, the smallest detectable difference), the identity that
made the rows, and the clipped updates counted in each row.

`fedllm compare` writes its table when every run of every seed is in; a table that spans sessions is read
before that:

    python scripts/method_table.py runs/which_method_smollm2 --reference local centralized flexlora_clip2

A run made by other code than the rest is named and left out. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.run.compare import format_corrected, run_metrics, summarize
from fedllm.run.identity import differences
from fedllm.run.reader import RunFolder

METRICS = [
    "heldout_loss",
    "rouge_l",
    "general_agreement",
    "client_loss_personal",
    "client_loss_own_trained",
    "client_loss_global",
    "accuracy",
    "down_mb",
    "up_mb",
    "wall_s",
]


def contrast(results: dict, a: str, b: str, metric: str) -> dict | None:
    """A pre-registered paired contrast (a family of one): ``a - b`` over the seeds both have."""
    from fedllm.run.stats import correct, paired_test

    if a not in results or b not in results:
        return None
    seeds = sorted(s for s in results[a] if s in results[b])
    va, vb = [results[a][s].get(metric) for s in seeds], [results[b][s].get(metric) for s in seeds]
    if len(seeds) < 2 or any(v is None for v in va + vb):
        return None
    return vars(correct([paired_test(f"{a} - {b}", va, vb)])[0])


def clipped(run: Path) -> int:
    """The updates the server clipped over the run's rounds (``agg_clipped`` of its rows)."""
    return sum(int(r.get("agg_clipped", 0) or 0) for r in RunFolder(run).rows())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the comparison's folder (OUT/<variant>/seed-<s>)")
    ap.add_argument("--baseline", default="fedit")
    ap.add_argument("--reference", nargs="*", default=[], help="rows never taken as the best (references)")
    ap.add_argument("--metrics", nargs="*", default=METRICS)
    ap.add_argument(
        "--contrast", nargs="*", default=[], help="pre-registered paired contrasts A:B (each a family of one)"
    )
    ap.add_argument(
        "--figure", type=Path, help="also draw the corrected differences against the baseline (PNG)"
    )
    args = ap.parse_args()

    runs = {p.parent.name: {} for p in sorted(args.out.glob("*/seed-*"))}
    for run in sorted(args.out.glob("*/seed-*")):
        if RunFolder(run).is_finished():
            runs[run.parent.name][int(run.name.split("-")[1])] = run
    identities = {str(run): RunFolder(run).identity() or {} for per in runs.values() for run in per.values()}
    # the identity most rows share; "the same" as fedllm compare reads it (a docs-only commit: the same code)
    common = max(identities.values(), key=lambda i: sum(not differences(j, i) for j in identities.values()),
                 default=None)  # fmt: skip
    other = sorted(r for r, i in identities.items() if common is None or differences(i, common))
    for r in other:
        print(f"left out (made by other code or data than the rest): {r}", file=sys.stderr)
        variant, seed = Path(r).parent.name, int(Path(r).name.split("-")[1])
        runs[variant].pop(seed, None)
    names = [args.baseline, *sorted(n for n in runs if n != args.baseline)]
    names = [n for n in names if runs.get(n)]
    seeds = sorted(set.intersection(*(set(runs[n]) for n in names))) if names else []
    results = {n: {s: run_metrics(runs[n][s]) for s in seeds} for n in names}
    summary = summarize(results, [r for r in args.reference if r in results]) if seeds else {}
    identity = common or {}
    src = identity.get("source", {})
    print(f"seeds {seeds} (finished in every row); rows: {', '.join(f'{n} ({len(runs[n])})' for n in names)}")
    print(f"identity: source {src.get('digest')} (commit {src.get('commit')}), token cache v"
          f"{identity.get('tokens')}, model {identity.get('model')}, data {identity.get('data')}, precision "
          f"{identity.get('precision')}, libraries {identity.get('libraries')}")  # fmt: skip
    clips = {n: [clipped(runs[n][s]) for s in sorted(runs[n])] for n in names}
    print("clipped updates per run: " + "; ".join(f"{n} {c}" for n, c in clips.items()))
    if len(seeds) >= 2:
        print(format_corrected(summary, args.metrics))
    if args.figure and len(seeds) >= 2:
        from fedllm.run.compare import plot_corrected

        drawn = plot_corrected(
            summary, args.figure, args.metrics, [r for r in args.reference if r in results]
        )
        print(f"figure: {args.figure}" if drawn else "figure: none (no metric has an interval)")
    contrasts = {}
    for pair in args.contrast:
        a, _, b = pair.partition(":")
        for metric in args.metrics:
            c = contrast(results, a, b, metric)
            if c is not None:
                contrasts[f"{pair} {metric}"] = c
                verdict = "excludes 0" if c["low"] > 0 or c["high"] < 0 else "holds 0"
                print(f"contrast {a} - {b}, {metric}: {c['diff']:+.4g} [{c['low']:+.4g}, {c['high']:+.4g}] "
                      f"({verdict}; p {c['p']:.3f}, {c['n']} seeds)")  # fmt: skip
    print(json.dumps({"seeds": seeds, "identity": identity, "clipped": clips, "summary": summary,
                      "contrasts": contrasts}))  # fmt: skip


if __name__ == "__main__":
    main()
