"""MMLU prompts, scoring against brute force, aggregation, data errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from eval.mmlu import Record, aggregate, build_context, evaluate, score_questions
from eval.mmlu_data import MMLUDataError, Question, load_questions


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


class CharTok:
    """One token per character (no BOS): lengths are readable."""

    def __call__(self, text, add_special_tokens=True, **kw):
        return {"input_ids": [ord(c) for c in text]}


def test_overflow_cuts_from_the_left_as_the_harness_or_drops_shots():
    from eval.mmlu import prompt_items

    shots = {"anatomy": [q("anatomy", i, "S" * 50) for i in range(5)]}
    question = q("anatomy", 9, "T?")
    full = build_context(question, shots["anatomy"])
    L = len(full) - 10
    (item,), used, cut = prompt_items(CharTok(), [question], shots, 5, L)  # truncate, the default
    # lm-evaluation-harness feeds (context + " A")[-(L + 1):][:-1] (here " A" is 2 tokens, so the space too)
    harness = [ord(c) for c in (full + " A")][-(L + 1) :][:-1]
    assert item.ids + item.continuations[0][:-1] == harness and len(harness) == L
    assert used == [5] and cut == [11]
    (item,), used, cut = prompt_items(CharTok(), [question], shots, 5, L, overflow="drop_shots")
    assert used[0] < 5 and cut == [0] and len(item.ids) + 1 <= L
    assert "".join(map(chr, item.ids)).endswith("T?\nA. w\nB. x\nC. y\nD. z\nAnswer:")


@pytest.fixture(scope="module")
def tiny(builtin_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(builtin_base).eval(), AutoTokenizer.from_pretrained(
        builtin_base
    )


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
    out = metric.compute(
        predictions=[1, 0, 3, 0, 2],
        references=[1, 2, 3, 0, 1],
        subjects=["abstract_algebra", "abstract_algebra", "philosophy", "econometrics", "virology"],
    )
    assert out["accuracy"] == pytest.approx(3 / 5)
    assert out["category/stem"] == 0.5 and out["category/other"] == 0.0


def test_metric_table_matches_reference():
    import importlib.util

    from eval.subjects import mmlu_subjects

    spec = importlib.util.spec_from_file_location(
        "m", Path(__file__).parent.parent / "eval/mmlu_metric/mmlu_metric.py"
    )
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
    (jl / "test.jsonl").write_text(
        json.dumps({"question": "Q", "subject": "virology", "choices": ["a", "b", "c", "d"], "answer": 2})
        + "\n"
    )
    assert load_questions(str(jl))[0].answer == 2

    import pyarrow as pa
    import pyarrow.parquet as pq

    pqdir = tmp_path / "hub" / "all"
    pqdir.mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(
            [{"question": "Q", "subject": "astronomy", "choices": ["a", "b", "c", "d"], "answer": 3}] * 3
        ),
        pqdir / "test-00000-of-00001.parquet",
    )
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
    (jl / "test.jsonl").write_text(
        json.dumps({"question": "Q", "subject": "s", "choices": ["a", "b", "c"], "answer": 1}) + "\n"
    )
    with pytest.raises(MMLUDataError, match=r"test.jsonl, line 1: expected 4 choices, got 3"):
        load_questions(str(jl))
    (jl / "test.jsonl").write_text(
        json.dumps({"question": "Q", "subject": "s", "choices": list("abcd"), "answer": 7}) + "\n"
    )
    with pytest.raises(MMLUDataError, match=r"line 1: answer 7 is outside 0-3"):
        load_questions(str(jl))
    with pytest.raises(MMLUDataError, match=r"subject\(s\) \['nope'\] not found"):
        load_questions("builtin", subjects=["nope"])


def test_builtin_evaluate_end_to_end(tiny):
    model, tok = tiny
    result, records = evaluate(model, tok, "builtin", shots=2, limit=4, batch_size=8)
    assert result["n"] == len(records) == 4 * 5  # 4 per benchmark skill
    assert set(result["categories"]) == {"stem", "humanities"}


# ---- prefix reuse: the same scores as the full path, on every tokenizer shape ----


def _reuse_and_full(model, tok, questions, dev, k, batch_size=5):
    reused = score_questions(model, tok, questions, dev, k, batch_size=batch_size, reuse=True)
    full = score_questions(model, tok, questions, dev, k, batch_size=batch_size, reuse=False)
    for a, b in zip(reused, full, strict=True):
        assert a.predicted == b.predicted
        torch.testing.assert_close(
            torch.tensor(a.loglikelihoods), torch.tensor(b.loglikelihoods), rtol=0, atol=1e-4
        )
    return reused


def _builtin_dev(k):
    return {
        s: [q for q in load_questions("builtin", "dev") if q.subject == s][:k]
        for s in {q.subject for q in load_questions("builtin", limit=1)}
    }


@pytest.mark.parametrize("k", [0, 2])
def test_prefix_reuse_equals_full_scoring_on_the_builtin_base(tiny, k):
    model, tok = tiny
    questions = load_questions("builtin", limit=6)
    records = _reuse_and_full(model, tok, questions, _builtin_dev(k), k)
    assert {r.shots for r in records} == {k}  # (2 shots fit the built-in base's 128 tokens)


def test_prefix_reuse_with_an_adapter(tiny, builtin_base):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(builtin_base),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]),
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    _reuse_and_full(model, tiny[1], load_questions("builtin", limit=4), _builtin_dev(2), 2)


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A byte-level BPE with BOS whose merges cross whitespace, and a random Llama (GQA)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # no whitespace pre-split, so merges span words: "Answer: C\n\nZebra" becomes one token, " A".." D" stay
    # one
    corpus = [
        "The following are multiple choice questions (with answers) about zoology.\n\n"
        + "".join(
            f"Which animal is striped?\nA. cat\nB. zebra\nC. dog\nD. cow\nAnswer: {x}\n\n" for x in "ABD"
        )
        + "Answer: C\n\nZebra" * 6
    ] * 200 + [" A B C D" * 20] * 200
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(fast),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
    ).eval()
    return model, fast


def test_prefix_reuse_with_a_bpe_tokenizer_and_a_question_crossing_the_boundary(bpe_model):
    """A question whose first token merges with the prompt's "\\n\\n" does not share the prefix: scored in
    full.
    """
    from eval.mmlu import prompt_items
    from eval.scoring import shared_prefix

    model, tok = bpe_model

    def q(i, text):
        return Question("zoology", i, text, ("cat", "zebra", "dog", "cow"), i % 4)

    dev = {"zoology": [q(100 + i, f"Which animal number {i} is striped?") for i in range(3)]}
    questions = [q(i, f"Which animal {i} is striped?") for i in range(6)] + [q(6, "Zebra stripes: how many?")]
    items, _, _ = prompt_items(tok, questions, dev, 3, 512)
    assert items[0].ids[0] == tok.bos_token_id and all(it.single_token for it in items)
    n, sharing = shared_prefix([it.ids for it in items])
    assert n > 50 and 6 not in sharing and sharing == list(range(6))  # the crossing question falls back
    _reuse_and_full(model, tok, questions, dev, 3, batch_size=4)


def test_prefix_reuse_that_disagrees_with_a_plain_forward_is_turned_off(tiny, monkeypatch, caplog):
    from eval import scoring

    real = scoring.PrefixScorer._score_suffixes

    def wrong(self, *a, **k):
        return [[x + 1.0 for x in s] for s in real(self, *a, **k)]

    monkeypatch.setattr(scoring.PrefixScorer, "_score_suffixes", wrong)
    model, tok = tiny
    _reuse_and_full(model, tok, load_questions("builtin", limit=3), _builtin_dev(2), 2)
    assert "prefix reuse is off for this model" in caplog.text


def test_prompts_that_do_not_fit_are_cut_as_the_harness_and_reuse_matches_plain_scoring(tiny, caplog):
    """The built-in base has a 128-token context: 5-shot prompts overflow and are cut from the left; the
    prefix-reuse path gives the plain path's log-likelihoods, which are a brute force's on the cut tokens."""
    from eval.mmlu import evaluate, load_benchmark

    model, tok = tiny
    bench = load_benchmark("builtin", shots=5, limit=2)
    _, records = evaluate(model, tok, bench, batch_size=4)
    _, plain = evaluate(model, tok, bench, batch_size=4, reuse=False)
    assert all(r.tokens_cut > 0 and r.shots == 5 for r in records)
    assert "cut from the left as lm-evaluation-harness does" in caplog.text
    for a, b in zip(records, plain, strict=True):
        diff = max(abs(x - y) for x, y in zip(a.loglikelihoods, b.loglikelihoods, strict=True))
        assert a.predicted == b.predicted and diff < 1e-4
    r = records[0]
    question = next(x for x in bench.questions if (x.subject, x.index) == (r.subject, r.index))
    whole = tok(build_context(question, bench.dev[question.subject][:5]) + " A")["input_ids"]
    kept = whole[-(128 + 1) :][:-1]  # the harness's left truncation
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([kept])).logits[0, -1], -1)
    assert r.loglikelihoods[0] == pytest.approx(logp[whole[-1]].item(), abs=1e-4)
    assert len(whole) - 1 - len(kept) == r.tokens_cut


def test_with_drop_shots_prompts_that_do_not_fit_lose_shots_and_say_so(tiny, caplog, tmp_path):
    """overflow=drop_shots: 5 shots cannot fit 128 tokens; each record says how many did."""
    from eval.mmlu import evaluate, load_benchmark, write_results

    model, tok = tiny
    bench = load_benchmark("builtin", shots=5, limit=2, overflow="drop_shots")
    result, records = evaluate(model, tok, bench, batch_size=4)
    used = {r.shots for r in records}
    assert max(used) < 5 and min(used) >= 0
    assert "did not fit the model's context (128 tokens) with 5 shots" in caplog.text
    for r in records:  # no prompt longer than the context was ever scored
        q = next(x for x in bench.questions if (x.subject, x.index) == (r.subject, r.index))
        assert len(tok(build_context(q, bench.dev[q.subject][: r.shots]), verbose=False)["input_ids"]) < 128
    write_results(tmp_path / "r.json", result, records, {"shots": 5})
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (
        sum(saved["shots_used"].values()) == len(records) and saved["records"][0]["shots"] == records[0].shots
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_an_evaluation_phase_says_how_far_it_is_where_no_bar_shows(caplog, monkeypatch, enabled):
    """Without a terminal (a job's log) a phase logs its progress, rate and time left every few seconds
    and its total at the end (tqdm alone printed nothing there); a worker process (disabled) logs nothing."""
    import logging

    from eval import progress

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="eval.test")
    with progress.Progress(4, "benchmark questions", "q", enabled, logging.getLogger("eval.test")) as bar:
        for _ in range(4):
            bar.update()
    lines = [r.getMessage() for r in caplog.records]
    if enabled:
        assert any("benchmark questions: 1/4 q" in line and "s left" in line for line in lines), lines
        assert lines[-1].startswith("benchmark questions: 4 q in")
    else:
        assert lines == []
