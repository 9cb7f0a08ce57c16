"""Small local copies of FlowerTune's datasets in their published layouts, for tests and checks offline.

No Hub here: the leaderboard's configs and evaluation protocols are exercised on these files, which have
the fields, file names and folder layouts of the real ones (the four training sets' parquet files; the
original MMLU CSV release that lukaemon/mmlu reads; PubMedQA, MedMCQA, MedQA, CareQA, FPB, FiQA and TFNS
as the Hub or their releases publish them). The texts are synthetic and seeded; the questions are the
built-in benchmark's, whose words the built-in model reads, set under real MMLU subject names.

``python -m data_prep.flowertune_samples DIR`` writes them all under DIR.
"""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

TRAIN_FILES = {
    "general-nlp": "alpaca-gpt4.parquet",
    "finance": "fingpt-sentiment-train.parquet",
    "medical": "medical-meadow-medical-flashcards.parquet",
    "code": "code-alpaca-20k.parquet",
}
MMLU_SUBJECTS = {  # two subjects of each category the leaderboard scores, one of "other"
    "stem": ["abstract_algebra", "college_physics"],
    "social_sciences": ["econometrics", "sociology"],
    "humanities": ["formal_logic", "philosophy"],
    "other": ["virology"],
}
WORDS = ["market", "profit", "loss", "growth", "shares", "revenue", "debt", "outlook", "bank", "stock"]
TONES = {"positive": "rose sharply", "negative": "fell sharply", "neutral": "stayed the same"}


def _write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def training_rows(domain: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` records with the fields of FlowerTune's ``domain`` training set."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if domain == "general-nlp":  # flwrlabs/alpaca-gpt4: instruction, input, output, text
            inst, inp, out = f"Is {a} larger than {b} ?", "", "yes" if a > b else "no"
            rows.append({"instruction": inst, "input": inp, "output": out, "text": f"{inst} {out}"})
        elif domain == "finance":  # flwrlabs/fingpt-sentiment-train: input, output, instruction
            tone = rng.choice(list(TONES))
            rows.append({
                "input": f"The {rng.choice(WORDS)} of the company {TONES[tone]} in quarter {i % 4 + 1}.",
                "output": tone,
                "instruction": "What is the sentiment of this news? Please choose an answer from "
                "{negative/neutral/positive}.",
            })  # fmt: skip
        elif domain == "medical":  # flwrlabs/medical-meadow-medical-flashcards: input, output, instruction
            rows.append({
                "input": f"What is the normal dose number {a} of drug {b}?",
                "output": f"The dose is {a + b} units.",
                "instruction": "Answer this question truthfully",
            })  # fmt: skip
        else:  # flwrlabs/code-alpaca-20k: instruction, input, output
            rows.append({
                "instruction": f"Write a function that adds {a} to its argument.",
                "input": "" if i % 2 else f"x = {b}",
                "output": f"def add(x):\n    return x + {a}",
            })  # fmt: skip
    return rows


def write_training_sets(root: Path, n: int = 120) -> dict[str, Path]:
    """The four training sets as parquet files under ``root``; returns domain -> file."""
    out = {}
    for seed, (domain, name) in enumerate(TRAIN_FILES.items()):
        _write_parquet(root / name, training_rows(domain, n, seed))
        out[domain] = root / name
    return out


def write_mmlu(root: Path, per_subject: int = 8, seed: int = 0) -> Path:
    """The original MMLU CSV release (what lukaemon/mmlu reads): ``data/test/<subject>_test.csv``."""
    from data_prep import builtin_skills

    qs = builtin_skills.benchmark()
    rng = random.Random(seed)
    rng.shuffle(qs)
    k = 0
    for subjects in MMLU_SUBJECTS.values():
        for s in subjects:
            path = root / "data" / "test" / f"{s}_test.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", newline="", encoding="utf-8") as fh:
                w = csv.writer(fh)
                for j in range(per_subject):
                    q = qs[k]
                    k += 1
                    text = q["question"]
                    if j % 3 == 1:  # FlowerTune adds a "?" to a question ending in neither "?" nor "."
                        text = text.rstrip(" ?")
                    elif j % 3 == 2:
                        text = text.rstrip(" ?") + "."
                    w.writerow([text, *q["choices"], "ABCD"[q["answer"]]])
    return root


def write_medical(root: Path, n: int = 16, seed: int = 0) -> Path:
    """PubMedQA, MedMCQA, MedQA and CareQA in their Hub layouts under ``root/<benchmark>/``."""
    rng = random.Random(seed)
    opts = lambda: [f"drug {rng.randint(1, 99)}" for _ in range(4)]  # noqa: E731
    pub = []
    for i in range(n):
        pub.append({
            "QUESTION": f"Does drug {i} lower the risk of fever" + ("?" if i % 2 else ""),
            "CONTEXTS": [f"We studied {rng.randint(10, 99)} patients.", "The drug was given daily."],
            "LABELS": ["METHODS", "RESULTS"], "MESHES": ["Fever"], "YEAR": "2001",
            "reasoning_required_pred": "yes", "reasoning_free_pred": "yes",
            "final_decision": ["yes", "no", "maybe"][i % 3], "LONG_ANSWER": "It did.", "pubid": str(1000 + i),
        })  # fmt: skip
    _write_jsonl(root / "pubmedqa" / "test.jsonl", pub)
    _write_jsonl(
        root / "medmcqa" / "validation.jsonl",
        [{"id": f"q{i}", "question": f"Which drug treats case {i}", "exp": "", "cop": i % 4,
          "opa": o[0], "opb": o[1], "opc": o[2], "opd": o[3], "subject_name": "Pharmacology",
          "topic_name": None, "choice_type": "single"} for i, o in ((i, opts()) for i in range(n))],
    )  # fmt: skip
    medqa = []
    for i in range(n):
        o = opts()
        medqa.append({
            "meta_info": "step1", "question": f"A patient of {20 + i} years has a cough. Which drug is best?",
            "answer_idx": "ABCD"[i % 4], "answer": o[i % 4],
            "options": [{"key": k, "value": v} for k, v in zip("ABCD", o, strict=True)],
        })  # fmt: skip
    _write_jsonl(root / "medqa" / "test.jsonl", medqa)
    _write_jsonl(
        root / "careqa" / "test.jsonl",
        [{"exam_id": 1, "question": f"Which drug is used in case {i}.", "op1": o[0], "op2": o[1],
          "op3": o[2], "op4": o[3], "cop": i % 4 + 1, "year": 2020, "category": "Medicine",
          "unique_id": f"u{i}"} for i, o in ((i, opts()) for i in range(n))],
    )  # fmt: skip
    return root


def write_finance(root: Path, n: int = 64, seed: int = 0) -> Path:
    """FPB (the release's Sentences_50Agree.txt), FiQA (train / validation / test) and TFNS (the release's
    sent_valid.csv) under ``root/<benchmark>/``."""
    rng = random.Random(seed)
    tones = list(TONES)

    def sentence(tone: str) -> str:
        return f"Shares of the {rng.choice(WORDS)} company {TONES[tone]} today"

    fpb = root / "fpb" / "Sentences_50Agree.txt"
    fpb.parent.mkdir(parents=True, exist_ok=True)
    fpb.write_text(
        "".join(f"{sentence(t)} .@{t}\r\n" for t in (rng.choice(tones) for _ in range(n))),
        encoding="iso-8859-1",
    )
    for split, m in (("train", n // 2), ("validation", n // 4), ("test", n // 4)):
        rows = []
        for i in range(m):
            score = rng.uniform(-1, 1)
            tone = "negative" if score < -0.1 else "neutral" if score < 0.1 else "positive"
            rows.append({
                "sentence": sentence(tone), "snippets": "['x']", "target": "company",
                "sentiment_score": score, "aspects": "['Corporate']",
                "format": "post" if i % 2 else "headline", "label": 0,
            })  # fmt: skip
        _write_jsonl(root / "fiqa" / f"{split}.jsonl", rows)
    tfns = root / "tfns" / "sent_valid.csv"
    tfns.parent.mkdir(parents=True, exist_ok=True)
    with tfns.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        for i in range(n // 4):
            label = i % 3  # 0 bearish (negative), 1 bullish (positive), 2 neutral
            w.writerow([f"$XYZ {sentence(['negative', 'positive', 'neutral'][label])} https://t.co/x", label])
    return root


def write_all(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    return {
        **{f"train-{k}": v for k, v in write_training_sets(root / "train").items()},
        "mmlu": write_mmlu(root / "mmlu"),
        "medical": write_medical(root / "medical"),
        "finance": write_finance(root / "finance"),
    }


if __name__ == "__main__":
    for name, path in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "flowertune-samples")).items():
        print(f"{name:<20} {path}")
