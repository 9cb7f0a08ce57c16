"""The built-in testbed (data_prep/testbed.py): its data, its cloze-scored benchmark, its base and configs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data_prep import testbed
from eval.mmlu import prompt_items, score_questions, style_of
from eval.mmlu_data import load_questions

ROOT = Path(__file__).resolve().parents[1]
TESTBEDS = ("headroom", "rank", "clustered", "drift", "personal")


@pytest.fixture(scope="module")
def tok():
    from fedllm.model.builtin_base import build_tokenizer

    return build_tokenizer("builtin-testbed")


def test_benchmark_is_balanced_in_gold_letters_and_second_step_labels():
    bench = testbed.benchmark()
    assert len(bench) == len(testbed.SKILLS) * testbed.BENCHMARK_PER_SKILL
    for skill in testbed.SKILLS:
        mine = [r for r in bench if r["subject"] == skill]
        golds = Counter(r["answer"] for r in mine)
        assert set(golds.values()) == {len(mine) // 4}, skill  # a letter prior wins nothing
        labels = Counter(r["choices"][r["answer"]].rpartition(" ")[2] for r in mine)
        assert len(labels) == 2 and set(labels.values()) == {len(mine) // 2}, (skill, labels)
        for r in mine:  # every option plausible: two first steps crossed with two labels
            firsts = {c.rpartition(" ")[0] for c in r["choices"]}
            seconds = {c.rpartition(" ")[2] for c in r["choices"]}
            assert len(firsts) == 2 and len(seconds) == 2 and len(set(r["choices"])) == 4


def test_training_data_never_holds_a_benchmark_question_and_base_never_sees_the_new_concepts():
    from data_prep.loaders import load_examples

    asked = {r["question"] for r in testbed.benchmark()}
    train = load_examples("testbed", builtin_per_skill=200)
    assert not asked & {e.instruction for e in train}
    assert Counter(e.category for e in train) == dict.fromkeys(testbed.SKILLS, 200)
    pre = testbed.pretraining_examples(0, n_per_skill=50)
    assert {e.category for e in pre} == set(testbed.PRIMITIVES) - set(testbed.UNSEEN_PRIMITIVES)
    assert not any(e.response in ("below", "above", "vowel", "consonant", "animal", "thing") for e in pre)


def test_every_word_is_in_the_testbed_vocabulary(tok):
    texts = [r["question"] + " " + c for r in testbed.benchmark() for c in r["choices"]]
    texts += [f"{e.instruction} {e.response}" for e in testbed.instruction_examples(50)]
    texts += [f"{e.instruction} {e.response}" for e in testbed.pretraining_examples(0, n_per_skill=50)]
    assert not [t for t in texts if tok.unk_token_id in tok(t)["input_ids"]]


def test_label_shift_flips_the_second_step_only():
    e = testbed.instruction_examples(1, skills=("larger_parity",))[0]
    first, _, label = e.response.rpartition(" ")
    shifted = testbed.shift_labels(e, 1)
    assert shifted.response == f"{first} {testbed.PAIR_OF[label]}"
    assert shifted.instruction == e.instruction and testbed.shift_labels(e, 0) == e


def test_testbed_benchmark_is_cloze_scored_on_the_options_text(tok):
    assert style_of("testbed") == "cloze" and style_of("builtin") == "letter"
    q = load_questions("testbed", limit=1)[0]
    (item,), _, _ = prompt_items(tok, [q], None, 0, 128, style="cloze")
    assert item.ids == tok(q.question)["input_ids"]
    assert [tok.decode(c) for c in item.continuations] == list(q.choices)


def test_cloze_scores_are_the_options_summed_log_likelihoods(tok):
    """Against a brute-force sum over each option's tokens, on a random tiny Llama."""
    from fedllm.model.builtin_base import build_model

    model = build_model(tok, 3).eval()
    questions = load_questions("testbed", limit=2)[:6]
    records = score_questions(model, tok, questions, batch_size=5, style="cloze")
    for q, r in zip(questions, records, strict=True):
        for c, got in zip(q.choices, r.loglikelihoods, strict=True):
            ctx = tok(q.question)["input_ids"]
            ids = tok(q.question + " " + c)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            want = sum(logp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
            assert got == pytest.approx(want, abs=1e-4)


class _Echo(torch.nn.Module):
    """Predicts each next token right except at ``wrong`` positions (teacher-forced)."""

    def __init__(self, vocab: int, wrong: set[int]):
        super().__init__()
        self.vocab, self.wrong, self.w = vocab, wrong, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, labels=None):
        nxt = torch.roll(input_ids, -1, 1)
        for p in self.wrong:
            nxt[:, p] = (nxt[:, p] + 1) % self.vocab
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float() * 10
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return SimpleNamespace(loss=loss, logits=logits)


def test_client_accuracy_needs_the_whole_answer_not_its_first_token(tok):
    """A model right on the intermediate step and wrong on the label scores 0 (the label is what clusters
    disagree on); right on both, 1; the closing EOS is not part of the answer."""
    from data_prep.prompts import tokenize_examples
    from fedllm.model.evaluation import heldout

    (ex,) = tokenize_examples(testbed.instruction_examples(1, skills=("sum_parity",)), tok, "plain", 96)
    n = len(ex.input_ids)  # ... question, intermediate, label, EOS
    label_at, eos_at = n - 3, n - 2  # positions whose logits predict the label and the EOS
    assert heldout(_Echo(len(tok), set()), tok, [ex], 4)[1] == 1.0
    assert heldout(_Echo(len(tok), {eos_at}), tok, [ex], 4)[1] == 1.0
    assert heldout(_Echo(len(tok), {label_at}), tok, [ex], 4)[1] == 0.0


@pytest.mark.parametrize("name", TESTBEDS)
def test_testbed_configs_load_and_are_pre_registered(name):
    from fedllm.config import load_config

    path = ROOT / "configs" / f"testbed_{name}.yaml"
    head = path.read_text().split("\nmodel:")[0]
    assert "Pre-registered" in head and "predicted" in head and "mechanism" in head
    cfg = load_config(str(path), [])
    assert cfg.model.name == "builtin-testbed" and cfg.data.dataset == "testbed"
    assert cfg.eval.benchmark == "testbed"
    import scripts.compare as suites

    assert suites.SUITES[f"testbed-{name}"][0] == f"configs/testbed_{name}.yaml"


def test_testbed_base_has_its_own_cache_key_and_the_default_keeps_its_own(tmp_path):
    from fedllm.model.builtin_base import builtin_base_path, ensure_builtin_base

    default, bed = (
        builtin_base_path(10, cache_dir=tmp_path),
        builtin_base_path(10, cache_dir=tmp_path, suite="builtin-testbed"),
    )
    assert default != bed and default.name.startswith("builtin-base-") and "testbed" in bed.name
    with pytest.raises(ValueError, match="model.name"):
        ensure_builtin_base(10, cache_dir=tmp_path, suite="builtin-other")
