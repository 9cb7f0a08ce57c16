"""`fedllm eval` against lm-evaluation-harness on the same model, questions and prompts: speed and agreement.

Runs bench_mmlu.py (fedllm's own paths: prefix reuse vs one forward per question), which also writes its
model (a 24M-parameter Llama, GQA 8/4, byte-level BPE with BOS, random weights) and its questions (the
built-in benchmark in MMLU's schema, 4 subjects x 60) to a folder; then scores them k-shot with batch 16 in
float32 twice, each in its own process on the same cores:

* lm-evaluation-harness (``lm_eval --model hf``), one local task per subject with the harness's ``mmlu``
  template (description, "A. .. D." choices, "Answer:", first-n dev shots), from the Python given by
  ``--lm-eval-python`` (a separate venv: ``pip install "lm_eval[hf]==0.4.13"``);
* ``fedllm eval`` with prefix reuse (its default).

It reports both wall times, both log-likelihood phases (lm-eval: its progress bar over requests; fedllm:
questions per second of its scoring loop), prediction agreement and the largest |dLL| over all
question-choice pairs. Timings are from this machine and run only. Last line: one JSON object.

    python scripts/compare_lm_eval.py --lm-eval-python /tmp/lmeval-venv/bin/python [--shots 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TASK = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder}/{subject}_test.jsonl
    dev: {folder}/{subject}_dev.jsonl
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
output_type: multiple_choice
description: "The following are multiple choice questions (with answers) about {name}.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. \
{{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path) -> list[str]:
    """One harness task per subject (as the harness's mmlu group), on per-subject test/dev files."""
    tasks = []
    for split in ("test", "dev"):
        by_subject: dict[str, list[str]] = {}
        for line in (folder / f"{split}.jsonl").read_text().splitlines():
            by_subject.setdefault(json.loads(line)["subject"], []).append(line)
        for subject, lines in by_subject.items():
            (folder / f"{subject}_{split}.jsonl").write_text("\n".join(lines) + "\n")
            if split == "test":
                task = f"fedllm_mmlu_{subject}"
                (folder / f"{task}.yaml").write_text(
                    TASK.format(task=task, folder=folder, subject=subject, name=subject.replace("_", " "))
                )
                tasks.append(task)
    return sorted(tasks)


def run_timed(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{proc.stderr[-4000:]}")
    return proc, time.perf_counter() - t0


def harness_phase_s(stderr: str) -> float | None:
    """Seconds of lm-eval's log-likelihood progress bar ("Running loglikelihood requests")."""
    times = re.findall(r"100%\|[^|]*\|\s*\d+/\d+ \[(\d+):(\d+)<", stderr)
    return int(times[-1][0]) * 60 + int(times[-1][1]) if times else None


def harness_scores(out: Path) -> dict[tuple[str, str], list[float]]:
    """(subject, index in the subject) -> the four log-likelihoods, from --log_samples."""
    scores = {}
    for path in out.rglob("samples_*.jsonl"):
        for line in path.read_text().splitlines():
            s = json.loads(line)
            scores[(s["doc"]["subject"], int(s["doc_id"]))] = [float(r[0]) for r in s["filtered_resps"]]
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval-python", required=True, help="python of a venv with lm_eval[hf]==0.4.13")
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--per-subject", type=int, default=60)
    args = p.parse_args()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_ALLOW_CODE_EVAL": "0",
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        bench, _ = run_timed(
            [
                sys.executable,
                str(ROOT / "scripts" / "bench_mmlu.py"),
                "--shots",
                str(args.shots),
                "--per-subject",
                str(args.per_subject),
                "--no-naive",
                "--threads",
                str(args.threads),
                "--batch-size",
                str(args.batch_size),
                "--export",
                str(folder),
            ],
            env,
        )
        tasks = write_tasks(folder)
        lm, lm_wall = run_timed(
            [
                args.lm_eval_python,
                "-m",
                "lm_eval",
                "--model",
                "hf",
                "--model_args",
                f"pretrained={folder / 'model'},dtype=float32",
                "--tasks",
                ",".join(tasks),
                "--include_path",
                str(folder),
                "--num_fewshot",
                str(args.shots),
                "--batch_size",
                str(args.batch_size),
                "--device",
                "cpu",
                "--log_samples",
                "--output_path",
                str(folder / "lm_eval_out"),
            ],
            env,
        )
        ours, our_wall = run_timed(
            [
                sys.executable,
                "-m",
                "fedllm.cli",
                "eval",
                "--model",
                str(folder / "model"),
                "--data",
                str(folder),
                "--shots",
                str(args.shots),
                "--batch-size",
                str(args.batch_size),
                "--output",
                str(folder / "fedllm.json"),
            ],
            env,
        )
        theirs = harness_scores(folder / "lm_eval_out")
        records = json.loads((folder / "fedllm.json").read_text())
    mine = {(r["subject"], r["index"]): r["loglikelihoods"] for r in records["records"]}
    assert set(mine) == set(theirs), f"different questions: {len(mine)} vs {len(theirs)}"

    def pred(s):
        return max(range(4), key=lambda c: s[c])

    agree = sum(pred(mine[k]) == pred(theirs[k]) for k in mine)
    max_dll = max(abs(a - b) for k in mine for a, b in zip(mine[k], theirs[k], strict=True))
    n = len(mine)
    lm_phase = harness_phase_s(lm.stderr)
    scored = re.findall(r"scored \d+ questions in ([\d.]+) s", ours.stderr + ours.stdout)
    our_phase = float(scored[-1]) if scored else None
    result = {
        "questions": n,
        "shots": args.shots,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "lm_eval_wall_s": lm_wall,
        "fedllm_wall_s": our_wall,
        "wall_ratio": lm_wall / our_wall,
        "lm_eval_loglikelihood_s": lm_phase,
        "fedllm_scoring_s": our_phase,
        "scoring_ratio": lm_phase / our_phase if lm_phase and our_phase else None,
        "same_predictions": agree,
        "max_abs_dll": max_dll,
        "bench_mmlu": json.loads(bench.stdout.strip().splitlines()[-1]),
    }  # reuse vs single, same model
    print(
        f"{n} questions, {args.shots}-shot: lm-eval {lm_wall:.1f} s (log-likelihood phase {lm_phase} s), "
        f"fedllm {our_wall:.1f} s (scoring {our_phase and round(our_phase, 1)} s); same prediction on "
        f"{agree}/{n}, "
        f"max |dLL| {max_dll:.1e}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
