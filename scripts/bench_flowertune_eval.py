"""Throughput of fedllm's FlowerTune evaluation against FlowerTune's loop, on the same questions.

The baseline is what FlowerTune's general-NLP and medical code does: one ``model.generate`` per question,
greedy, with the question's budget. fedllm's ``generate_batched`` gives each question the same budget
and runs length-sorted, left-padded batches. Both run here, in one process, on the built-in model and
the local sample copies (``data_prep.flowertune_samples``); the answers must be identical (greedy), and
the ratio is the loop's time over the batched time. Each side is timed best-of-``--repeats`` over
``--copies`` copies of the questions (sub-second timings are mostly noise).

    python scripts/bench_flowertune_eval.py [--batch-size 16] [--repeats 3]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from data_prep.flowertune_samples import write_all
from eval import flowertune as ft


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copies", type=int, default=4, help="each question this many times (longer timings)")
    p.add_argument("--protocols", default=",".join(ft.BENCHMARKS))
    args = p.parse_args()
    from fedllm.config import ModelConfig
    from fedllm.model.modeling import load_base

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    model, tokenizer = load_base(ModelConfig(name="builtin"), "cpu")
    where = {
        "flowertune-general-nlp": "mmlu",
        "flowertune-medical": "medical",
        "flowertune-finance": "finance",
    }
    out: dict = {"machine": cpu_name(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        files = write_all(Path(tmp))
        for protocol in args.protocols.split(","):
            items = ft.load_items(protocol, str(files[where[protocol]]), list(ft.BENCHMARKS[protocol]))
            items = [
                ft.Item(**{**vars(it), "index": it.index + c * len(items)})
                for c in range(args.copies)
                for it in items
            ]
            by: dict[str, list] = {}
            for it in items:
                by.setdefault(it.benchmark, []).append(it)
            for group in by.values():
                ft.set_budgets(
                    group, tokenizer, protocol, ft.REFERENCE_BATCH[protocol], ft.FINANCE_MAX_LENGTH
                )

            def best(fn):
                times, res = [], None
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    res = fn()
                    times.append(time.perf_counter() - t0)
                return min(times), res

            t_loop, loop = best(lambda: ft.generate_one_by_one(model, tokenizer, items))  # noqa: B023
            t_batch, batched = best(lambda: ft.generate_batched(model, tokenizer, items, args.batch_size))  # noqa: B023
            same_text = sum(a[0] == b[0] for a, b in zip(loop, batched, strict=True))
            same_answer = sum(
                ft.score(it, a[0], a[1]).extracted == ft.score(it, b[0], b[1]).extracted
                for it, a, b in zip(items, loop, batched, strict=True)
            )
            out[protocol] = {
                "questions": len(items),
                "loop_s": round(t_loop, 3),
                "batched_s": round(t_batch, 3),
                "speedup": round(t_loop / t_batch, 2),
                "identical_generations": same_text,
                "identical_answers": same_answer,
            }
            print(
                f"{protocol}: {len(items)} questions, loop {t_loop:.2f} s, batched {t_batch:.2f} s "
                f"({t_loop / t_batch:.1f}x), identical generations {same_text}/{len(items)}, answers "
                f"{same_answer}/{len(items)}"
            )
    out["batch_size"] = args.batch_size
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
