"""MMLU prompts, scoring against brute force, aggregation, data errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from eval.data import MMLUDataError, Question, load_questions
from eval.mmlu import Record, aggregate, build_context, evaluate, score_questions


def q(subject, i, text, answer=0):
    return Question(subject, i, text, ("w", "x", "y", "z"), answer)


def test_prompt_zero_shot_exact():
    ctx = build_context(q("high_school_biology", 0, "  What is a cell?  "), [])
    assert ctx == (
        "The following are multiple choice questions (with answers) about high school biology.\n\n"
        "What is a cell?\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    )


def test_prompt_five_shot_exact():
    shots = [q("anatomy", i, f"Shot {i}?", answer=i % 4) for i in range(5)]
    ctx = build_context(q("anatomy", 9, "Target?"), shots)
    expected = "The following are multiple choice questions (with answers) about anatomy.\n\n"
    for i in range(5):
        expected += f"Shot {i}?\nA. w\nB. x\nC. y\nD. z\nAnswer: {'ABCD'[i % 4]}\n\n"
    expected += "Target?\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    assert ctx == expected


def test_shots_dropped_when_too_long():
    class CharTok:
        def __call__(self, text, **kw):
            return {"input_ids": list(range(len(text)))}

    shots = [q("anatomy", i, "S" * 50) for i in range(5)]
    full = build_context(q("anatomy", 9, "T?"), shots)
    ctx = build_context(q("anatomy", 9, "T?"), shots, CharTok(), max_len=len(full) - 10)
    assert ctx.count("Answer:") < 6 and ctx.endswith("T?\nA. w\nB. x\nC. y\nD. z\nAnswer:")


@pytest.fixture(scope="module")
def tiny(builtin_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(builtin_base).eval(), AutoTokenizer.from_pretrained(builtin_base)


def brute_force(model, tokenizer, context, continuation):
    ctx = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    total = 0.0
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0], -1)
    for pos in range(len(ctx), len(whole)):
        total += logp[pos - 1, whole[pos]].item()
    return total


def test_scores_equal_brute_force(tiny):
    model, tok = tiny
    questions = load_questions("builtin", limit=3)
    records = score_questions(model, tok, questions, batch_size=5)
    for question, rec in zip(questions, records, strict=True):
        ctx = build_context(question, [])
        ref = [brute_force(model, tok, ctx, f" {letter}") for letter in "ABCD"]
        torch.testing.assert_close(torch.tensor(rec.loglikelihoods), torch.tensor(ref), rtol=1e-4, atol=1e-4)
        assert rec.predicted == max(range(4), key=lambda i: ref[i])


def test_full_continuation_path_matches_fast_path(tiny):
    model, tok = tiny
    questions = load_questions("builtin", limit=2)
    fast = score_questions(model, tok, questions, batch_size=4)

    class NoBatchedLetters:
        """Forces the slow path by making the letter look multi-token."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, text, add_special_tokens=True, **kw):
            out = self.inner(text, add_special_tokens=add_special_tokens, **kw)
            return out

    from eval import mmlu

    real = mmlu.continuation_ids

    def split(tokenizer, context, continuation):
        ctx, cont = real(tokenizer, context, continuation)
        return ctx[:-1], [ctx[-1], *cont]  # same sequence, two-token continuation

    mmlu.continuation_ids = split
    try:
        slow = score_questions(model, tok, questions, batch_size=3)
    finally:
        mmlu.continuation_ids = real
    # The slow path scores P(last ctx token) * P(letter): same argmax, shifted by a constant.
    for a, b in zip(fast, slow, strict=True):
        diff = torch.tensor(b.loglikelihoods) - torch.tensor(a.loglikelihoods)
        torch.testing.assert_close(diff, diff[0].expand(4), rtol=1e-4, atol=1e-4)
        assert a.predicted == b.predicted


def test_aggregation_hand_made():
    recs = [
        Record("abstract_algebra", 0, 1, 1, [0] * 4),  # stem, right
        Record("abstract_algebra", 1, 2, 0, [0] * 4),  # stem, wrong
        Record("philosophy", 0, 3, 3, [0] * 4),  # humanities, right
        Record("econometrics", 0, 0, 0, [0] * 4),  # social_sciences, right
        Record("virology", 0, 1, 2, [0] * 4),  # other, wrong
    ]
    out = aggregate(recs)
    assert out["accuracy"] == pytest.approx(3 / 5)
    assert out["categories"] == {"humanities": 1.0, "other": 0.0, "social_sciences": 1.0, "stem": 0.5}
    assert out["subjects"]["abstract_algebra"] == 0.5


def test_evaluate_metric_module_loads_offline():
    import evaluate

    metric = evaluate.load(str(Path(__file__).parent.parent / "eval" / "mmlu_metric"))
    out = metric.compute(predictions=[1, 0, 3, 0, 2], references=[1, 2, 3, 0, 1],
                         subjects=["abstract_algebra", "abstract_algebra", "philosophy", "econometrics", "virology"])
    assert out["accuracy"] == pytest.approx(3 / 5)
    assert out["category/stem"] == 0.5 and out["category/other"] == 0.0


def test_metric_table_matches_reference():
    import importlib.util

    from eval.subjects import mmlu_subjects

    spec = importlib.util.spec_from_file_location("m", Path(__file__).parent.parent / "eval/mmlu_metric/mmlu_metric.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mmlu_subjects() == mod.SUBJECT_CATEGORIES


def write_csv_release(root: Path, rows_by_split: dict[str, dict[str, list[list[str]]]]):
    for split, subjects in rows_by_split.items():
        d = root / "data" / split
        d.mkdir(parents=True, exist_ok=True)
        for subject, rows in subjects.items():
            with (d / f"{subject}_{split}.csv").open("w", newline="") as fh:
                csv.writer(fh).writerows(rows)


def test_local_layouts(tmp_path):
    rows = [["What is 1+1?", "1", "2", "3", "4", "B"], ["Q2?", "a", "b", "c", "d", "D"]]
    write_csv_release(tmp_path / "csv", {"test": {"anatomy": rows}, "dev": {"anatomy": rows[:1]}})
    qs = load_questions(str(tmp_path / "csv"))
    assert [x.answer for x in qs] == [1, 3] and qs[0].subject == "anatomy"
    assert len(load_questions(str(tmp_path / "csv"), "dev")) == 1

    jl = tmp_path / "jsonl"
    jl.mkdir()
    (jl / "test.jsonl").write_text(json.dumps({"question": "Q", "subject": "virology",
                                               "choices": ["a", "b", "c", "d"], "answer": 2}) + "\n")
    assert load_questions(str(jl))[0].answer == 2

    import pyarrow as pa
    import pyarrow.parquet as pq

    pqdir = tmp_path / "hub" / "all"
    pqdir.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"question": "Q", "subject": "astronomy", "choices": ["a", "b", "c", "d"],
                                          "answer": 3}] * 3), pqdir / "test-00000-of-00001.parquet")
    qs = load_questions(str(tmp_path / "hub"), limit=2)
    assert len(qs) == 2 and qs[1].index == 1


def test_bad_data_errors(tmp_path):
    write_csv_release(tmp_path / "a", {"test": {"anatomy": [["Q", "1", "2", "3", "B"]]}})
    with pytest.raises(MMLUDataError, match=r"anatomy_test.csv, row 1: expected question, 4 choices"):
        load_questions(str(tmp_path / "a"))
    write_csv_release(tmp_path / "b", {"test": {"anatomy": [["Q", "1", "2", "3", "4", "E"]]}})
    with pytest.raises(MMLUDataError, match=r"anatomy_test.csv, row 1: answer 'E' is outside 0-3"):
        load_questions(str(tmp_path / "b"))
    with pytest.raises(MMLUDataError, match=r"no 'dev' split found"):
        load_questions(str(tmp_path / "b"), "dev")
    jl = tmp_path / "c"
    jl.mkdir()
    (jl / "test.jsonl").write_text(json.dumps({"question": "Q", "subject": "s", "choices": ["a", "b", "c"],
                                               "answer": 1}) + "\n")
    with pytest.raises(MMLUDataError, match=r"test.jsonl, line 1: expected 4 choices, got 3"):
        load_questions(str(jl))
    (jl / "test.jsonl").write_text(json.dumps({"question": "Q", "subject": "s", "choices": list("abcd"),
                                               "answer": 7}) + "\n")
    with pytest.raises(MMLUDataError, match=r"line 1: answer 7 is outside 0-3"):
        load_questions(str(jl))
    with pytest.raises(MMLUDataError, match=r"subject\(s\) \['nope'\] not found"):
        load_questions("builtin", subjects=["nope"])


def test_builtin_evaluate_end_to_end(tiny):
    model, tok = tiny
    result, records = evaluate(model, tok, "builtin", shots=2, limit=4, batch_size=8)
    assert result["n"] == len(records) == 4 * 5  # 4 per benchmark skill
    assert set(result["categories"]) == {"stem", "humanities"}
