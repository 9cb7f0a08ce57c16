"""Copy a comparison's finished runs without their checkpoints: what another machine needs to resume it.

``fedllm compare`` reuses a run whose folder holds its ``config.yaml`` and ``summary.json`` with the same
settings; the rest of a finished run (checkpoints, adapters, client states) is hundreds of megabytes on a
real model and not needed for the table. This copies, for every finished run under SRC
(``SRC/<variant>/seed-<s>``), its small files (config, metrics, summary, answers, partition, run info, the
base's general answers) and the run's log, plus the comparison's own table files, into DEST, each written
atomically. A long table then spans machines and sessions:

    python scripts/keep_runs.py runs/real_table docs/results/real_table      # commit what finished
    cp -r docs/results/real_table runs/ && fedllm compare ... --output-dir runs/real_table   # continue

Unfinished runs are left out (the comparison runs them again). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.files import atomic_write_bytes
from fedllm.run.reader import CONFIG, GENERAL_REFERENCE, GENERATIONS, INFO, PARTITION, ROWS, SUMMARY

SMALL = (CONFIG, ROWS, SUMMARY, GENERATIONS, PARTITION, INFO, GENERAL_REFERENCE)
TABLES = ("compare.json", "compare.md", "compare.csv", "compare.png")
TUNING = ("tuning/tuning.json", "tuning/tuning.md", "tuning/drift.png")  # a tuned comparison's choice


def runs_under(src: Path) -> list[Path]:
    """Every run folder of a comparison: ``<variant>/seed-<s>`` and, tuned,
    ``tuning/<variant>/<point>/seed-<s>`` (never the superseded ones, kept apart under ``.superseded``)."""
    return sorted(
        p for p in src.rglob("seed-*") if p.is_dir() and ".superseded" not in p.relative_to(src).parts
    )


def keep(src: Path, dest: Path) -> dict:
    kept, skipped = [], []
    for run in runs_under(src):
        if not (run / SUMMARY).exists():
            skipped.append(str(run.relative_to(src)))
            continue
        rel = run.relative_to(src)
        for name in SMALL:
            if (run / name).is_file():
                atomic_write_bytes(dest / rel / name, (run / name).read_bytes())
        log = run.with_name(run.name + ".log")
        if log.is_file():
            atomic_write_bytes(dest / rel.parent / log.name, log.read_bytes())
        kept.append(str(rel))
    for name in (*TABLES, *TUNING):
        if (src / name).is_file():
            atomic_write_bytes(dest / name, (src / name).read_bytes())
    return {"kept": kept, "unfinished": skipped, "dest": str(dest)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="a fedllm compare --output-dir")
    p.add_argument("dest", type=Path)
    args = p.parse_args()
    if not args.src.is_dir():
        raise SystemExit(f"{args.src}: no such folder")
    out = keep(args.src, args.dest)
    print(f"kept {len(out['kept'])} finished runs in {args.dest}; left {len(out['unfinished'])} unfinished")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
