"""ShareGPT conversations: the packaged file read up to its last complete record, roles mapped or the
record skipped, the loss on the assistant's turns only (checked token by token), long conversations cut at
turn boundaries, and a local file in ShareGPT's layout loaded and partitioned by its requests' kind."""

from __future__ import annotations

import json

import pytest

from data_prep import sharegpt
from data_prep.prompts import IGNORE_INDEX
from data_prep.schema import DataError, Example

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def record(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"conv{i}_0", "conversations": [{"from": f, "value": v} for f, v in turns]}


@pytest.fixture(scope="module")
def chat_tokenizer(builtin_base):
    """The built-in tokenizer with ChatML's turn markers as special tokens and ChatML's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin_base)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def test_a_file_cut_off_inside_a_record_gives_its_complete_records():
    recs = [record(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(recs)
    cut = text[: text.rfind("a2") + 1]  # inside the last record
    got, was_cut = sharegpt.records_of_array(cut, "f.json")
    assert got == recs[:2] and was_cut
    whole, was_cut = sharegpt.records_of_array(text, "f.json")
    assert whole == recs and not was_cut
    broken = text.replace('"q1"', "q1", 1)
    with pytest.raises(DataError, match=r"f.json: record 2 is not JSON"):
        sharegpt.records_of_array(broken, "f.json")


def test_roles_are_mapped_or_the_record_is_skipped(caplog):
    recs = [
        record(
            0, ("system", "be brief"), ("human", "hi"), ("gpt", "hello"), ("human", "bye"), ("chatgpt", "ok")
        ),
        record(1, ("human", "hi"), ("human", "again")),  # one side twice
        record(2, ("gpt", "I start")),  # no user first
        record(3, ("human", "hi"), ("gpt", "")),  # empty turn
        record(4, ("human", "hi"), ("robot", "beep")),  # unknown role
        record(5, ("human", "only a question")),  # no answer
    ]
    got = sharegpt.conversations(recs, "f.json")
    assert len(got) == 1
    assert got[0].turns == (
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "bye"),
        ("assistant", "ok"),
    )
    assert got[0].instruction == "hi" and got[0].response == "hello"
    assert "5 of 6 conversations skipped" in caplog.text
    with pytest.raises(DataError, match="no usable conversation"):
        sharegpt.conversations(recs[1:], "f.json")
    with pytest.raises(DataError, match="record 1 is not in ShareGPT's layout"):
        sharegpt.conversations([{"instruction": "x"}], "f.json")


def _conversation() -> Example:
    recs = [
        record(
            0,
            ("system", "You answer in one line."),
            ("human", "What is two plus two?"),
            ("gpt", "Four."),
            ("human", "And three plus three?"),
            ("gpt", "Six, as three doubled."),
        )
    ]
    return sharegpt.conversations(recs, "f.json")[0]


def test_the_loss_is_on_the_assistants_turns_token_by_token(chat_tokenizer):
    tok = chat_tokenizer
    ex = _conversation()
    t = sharegpt.tokenize_conversation(ex, tok, 512)
    messages = [{"role": r, "content": c} for r, c in ex.turns]
    full = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert t.input_ids == full and t.cut == 0  # the whole rendered conversation
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # the labelled spans, token by token: each assistant answer and its end of turn, nothing else
    spans, cur = [], []
    for tid, lab in zip(t.input_ids, t.labels, strict=True):
        if lab != IGNORE_INDEX:
            assert lab == tid
            cur.append(tid)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    # each answer's tokens, its end of turn and the template's newline after it; nothing of the other turns
    assert spans == [ids("Four.<|im_end|>\n"), ids("Six, as three doubled.<|im_end|>\n")]
    assert all(end in s for s in spans)
    masked = [tid for tid, lab in zip(t.input_ids, t.labels, strict=True) if lab == IGNORE_INDEX]
    prompt_side = ids("You answer in one line.") + ids("What is two plus two?") + ids("And three plus three?")
    assert sum(len(s) for s in spans) + len(masked) == len(t.input_ids)
    assert set(prompt_side) <= set(masked)


def test_a_long_conversation_is_cut_at_a_turn_boundary(chat_tokenizer):
    tok = chat_tokenizer
    ex = _conversation()
    whole = sharegpt.tokenize_conversation(ex, tok, 512)
    first_answer_end = max(i for i, lab in enumerate(whole.labels) if lab != IGNORE_INDEX and i < 40) + 1
    # room for the first exchange and part of the second: the example ends after the first answer
    t = sharegpt.tokenize_conversation(ex, tok, len(whole.input_ids) - 3)
    assert t.labels[-1] != IGNORE_INDEX and "Six" not in tok.decode(t.input_ids)
    assert t.cut == len(whole.input_ids) - len(t.input_ids) > 0
    assert len(t.input_ids) <= first_answer_end + 2
    # room for the first request and part of its answer: the answer is cut at the limit
    first_request = whole.labels.index(next(lab for lab in whole.labels if lab != IGNORE_INDEX))
    part = sharegpt.tokenize_conversation(ex, tok, first_request + 2)
    assert len(part.input_ids) == first_request + 2 and part.labels[-2:] == part.input_ids[-2:]
    # not even the first request fits: dropped
    assert sharegpt.tokenize_conversation(ex, tok, 5) is None


def test_a_local_sharegpt_file_loads_and_partitions_by_its_requests_kind(tmp_path):
    from data_prep.loaders import load_examples
    from data_prep.partition import categories_of, client_stats, partition

    kinds = ["write", "explain", "what", "how"]
    turns = [("gpt", "sure"), ("human", "more"), ("gpt", "fine")]
    recs = [record(i, ("human", f"{kinds[i % 4].title()} thing {i}"), *turns) for i in range(40)]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(recs)[:-30])  # cut off, as the packaged file is
    examples = load_examples(str(path))
    assert len(examples) == 39 and all(len(e.turns) == 4 for e in examples)
    assert set(categories_of(examples)) == set(kinds)
    parts = partition(examples, "dirichlet", 4, seed=0, alpha=0.1, min_size=2)
    stats = client_stats(examples, parts)
    assert max(max(s["categories"].values()) / s["size"] for s in stats) > 0.5  # clients differ in kind
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in recs))
    assert len(load_examples(str(jsonl))) == 40


def test_conversations_need_the_chat_template(chat_tokenizer):
    from data_prep.prompts import tokenize_batch

    with pytest.raises(ValueError, match="data.template=chat"):
        tokenize_batch([_conversation()], chat_tokenizer, "alpaca", 256)
    assert tokenize_batch([_conversation()], chat_tokenizer, "chat", 256)[0] is not None
