"""Loaders on small local files in the real schemas, partitioners, prompts and masking."""

from __future__ import annotations

import json

import pytest

from data_prep import builtin_skills
from data_prep.loaders import load_examples
from data_prep.partition import categories_of, client_stats, dirichlet, iid, partition, shards
from data_prep.prompts import IGNORE_INDEX, build_prompt, collate, tokenize_example
from data_prep.schema import DataError, Example

DOLLY = [
    {"instruction": "Name a primary color.", "context": "", "response": "Red.", "category": "open_qa"},
    {
        "instruction": "Summarize.",
        "context": "Cats sleep a lot.",
        "response": "Cats sleep.",
        "category": "summarization",
    },
]
ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi!"},
]
WIZARD = [{"instruction": "Explain gravity.", "output": "Mass attracts mass."}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(("records", "fmt"), [(DOLLY, "dolly"), (ALPACA, "alpaca"), (WIZARD, "wizard")])
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_loaders_map_real_schemas(tmp_path, records, fmt, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, records)
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    for given in ("auto", fmt):
        examples = load_examples(str(path), given)
        assert len(examples) == len(records)
        first = examples[0]
        assert first.instruction == records[0]["instruction"]
        assert first.response == records[0].get("response", records[0].get("output"))
    if fmt == "dolly":
        assert examples[1].input == "Cats sleep a lot." and examples[1].category == "summarization"
    if fmt == "alpaca":
        assert examples[0].input == "2 and 3" and examples[0].category is None


def test_loader_errors_name_file_line_and_field(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_examples(str(tmp_path / "missing.jsonl"))
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [DOLLY[0], {"instruction": "x", "context": "", "category": "a"}]
    )
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: missing required field 'response'"):
        load_examples(str(bad), "dolly")
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"instruction": "  ", "input": "", "output": "x"}])
    with pytest.raises(
        DataError, match=r"empty.jsonl, line 1: field 'instruction' must be a non-empty string"
    ):
        load_examples(str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ALPACA[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl, line 2: not valid JSON"):
        load_examples(str(broken))
    # a raw line or paragraph separator inside a string (JSON allows it) is not a new record
    odd = tmp_path / "odd.jsonl"
    rec = {"instruction": "a\u2028b", "input": "c\x85d", "output": "e"}
    odd.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [e.instruction for e in load_examples(str(odd))] == ["a\u2028b"]
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(
        DataError, match=r"cannot tell the dataset format from fields \['completion', 'prompt'\]"
    ):
        load_examples(str(unknown))
    txt = tmp_path / "d.csv"
    txt.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_examples(str(txt))


def test_hub_id_offline_gives_clear_error():
    with pytest.raises(DataError, match="offline mode is on: download it first or pass a local"):
        load_examples("dolly")


def cats(n_per=50, k=8):
    return [f"c{i % k}" for i in range(n_per * k)]


def test_partitions_cover_data_and_are_seeded():
    c = cats()
    for parts in (iid(len(c), 5, 0), dirichlet(c, 5, 0.5, 0), shards(c, 5, 2, 0)):
        flat = sorted(i for p in parts for i in p)
        assert flat == list(range(len(c)))  # sizes add up, no duplicates
    assert dirichlet(c, 5, 0.5, 3) == dirichlet(c, 5, 0.5, 3)
    assert dirichlet(c, 5, 0.5, 3) != dirichlet(c, 5, 0.5, 4)


def test_dirichlet_skew_grows_as_alpha_shrinks():
    import numpy as np

    c = cats(100)

    def skew(alpha):
        vals = []
        for seed in range(5):
            for p in dirichlet(c, 6, alpha, seed):
                counts = np.bincount([int(c[i][1:]) for i in p], minlength=8)
                vals.append(counts.max() / max(1, counts.sum()))
        return float(np.mean(vals))

    assert skew(0.05) > skew(1.0) > skew(100.0)


def test_min_size_holds_and_infeasible_is_an_error():
    c = cats(10)
    parts = dirichlet(c, 8, 0.01, 0, min_size=6)
    assert min(len(p) for p in parts) >= 6
    with pytest.raises(DataError, match="num_clients = 100 .* needs 500 examples, but the dataset has 80"):
        partition([Example("q", "", "a", x) for x in c], "dirichlet", 100, 0, min_size=5)


def test_category_fallback_uses_first_word():
    ex = [Example("Write a poem", "", "x"), Example("write code", "", "y"), Example("Explain it", "", "z")]
    assert categories_of(ex) == ["write", "write", "explain"]
    stats = client_stats(ex, [[0, 1], [2]])
    assert stats[0]["categories"] == {"write": 2} and stats[1]["size"] == 1


def test_builtin_benchmark_is_balanced_and_held_out():
    recs = builtin_skills.benchmark()
    from collections import Counter

    letters = Counter(r["answer"] for r in recs)
    assert len(set(letters.values())) == 1  # each gold letter equally often
    prompts = builtin_skills.benchmark_prompts(recs)
    train = builtin_skills.instruction_examples(200, exclude_prompts=prompts)
    for ex in train:
        if ex.instruction.endswith("Answer:"):
            block = ex.instruction.split("\n\n", 1)[1]
            assert block not in prompts
    assert {ex.category for ex in train} == set(builtin_skills.SKILLS)
    assert {r["subject"] for r in recs} == set(builtin_skills.BENCHMARK_SKILLS) and len(recs) == 5 * 160


def test_pretraining_never_shows_the_benchmark_skills_as_multiple_choice():
    """The base learns the format on the format skills only: the benchmark skills' format is the federated
    lesson.
    """
    from fedllm.model.builtin_base import pretraining_examples

    examples = pretraining_examples(seed=0, n_per_skill=50)
    mc = {ex.category for ex in examples if ex.instruction.endswith("Answer:")}
    free = {ex.category for ex in examples if not ex.instruction.endswith("Answer:")}
    assert mc == set(builtin_skills.FORMAT_SKILLS) | {"match"}
    assert free == set(builtin_skills.SKILLS)  # every answer is known to the base


@pytest.fixture(scope="module")
def tokenizer():
    from fedllm.model.builtin_base import build_tokenizer

    return build_tokenizer()


def test_loss_only_on_response_tokens(tokenizer):
    ex = Example("What number comes after 4 ?", "", "5", "next_number")
    tok = tokenize_example(ex, tokenizer, "plain", 64)
    prompt_len = len(tokenizer(build_prompt(ex, "plain"))["input_ids"])
    assert tok.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert tok.labels[prompt_len:] == tok.input_ids[prompt_len:]
    assert tokenizer.convert_ids_to_tokens(tok.labels[prompt_len]) == "5"
    assert tok.input_ids[-1] == tokenizer.eos_token_id
    batch = collate(
        [tok, tokenize_example(Example("Is 3 even or odd ?", "", "odd"), tokenizer, "plain", 64)],
        tokenizer.pad_token_id,
    )
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()


def test_truncation_drops_examples_without_response(tokenizer):
    ex = Example("What number comes after 4 ?", "", "5")
    assert tokenize_example(ex, tokenizer, "plain", 4) is None
    short = tokenize_example(ex, tokenizer, "plain", 9)
    assert short is not None and len(short.input_ids) == 9


def test_alpaca_template_with_and_without_input():
    with_input = build_prompt(Example("Add.", "2 and 3", "5"), "alpaca")
    assert "### Input:\n2 and 3" in with_input and with_input.endswith("### Response:\n")
    assert "### Input" not in build_prompt(Example("Add.", "", "5"), "alpaca")


def _refused(argv, capsys) -> str:
    """Run the CLI in-process; it must exit 2 with one line on stderr and no traceback."""
    from fedllm.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert "Traceback" not in err and err.startswith("fedllm: error: ")
    return err.splitlines()[-1]


def _unreadable_files(tmp_path):
    """A file of each unreadable kind, with the words the error must say."""
    import os

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes([0xA1, 0xFF, 0x00, 0x9C]) * 50)
    truncated = tmp_path / "data.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(DOLLY * 20), truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    cases = [
        (garbage, "is not UTF-8 text (byte 0xa1 at offset 0)"),
        (truncated, "not a readable parquet file"),
        (folder, "is a directory"),
    ]
    if os.geteuid() != 0:  # root reads any file: no permission error to provoke
        locked = write_jsonl(tmp_path / "locked.jsonl", DOLLY)
        locked.chmod(0)
        cases.append((locked, "cannot be read (permission denied)"))
    return cases


def test_unreadable_data_files_are_refused_naming_the_file(tmp_path, capsys):
    for path, words in _unreadable_files(tmp_path):
        line = _refused(["run", "--output-dir", str(tmp_path / "r"), f"data.dataset={path}"], capsys)
        assert str(path) in line and words in line, line
        assert "expected a .json, .jsonl or .parquet file" in line
        assert not (tmp_path / "r").exists()  # refused before anything was written


def test_unreadable_config_and_mmlu_files_are_refused(tmp_path, capsys):
    for path, words in _unreadable_files(tmp_path):
        if path.suffix != ".parquet":
            line = _refused(["run", "--config", str(path)], capsys)
            assert str(path) in line and words in line and "expected a YAML config file" in line, line
        line = _refused(["eval", "--data", str(path)], capsys)
        if path.is_dir():  # a folder is a valid MMLU source: it must hold a split
            words = "no 'test' split found (looked for data/test/*_test.csv"
        assert str(path) in line and words in line, line


def test_read_errors_other_than_decoding_name_the_file(tmp_path, monkeypatch):
    """An OS error while reading (e.g. EACCES where root is not the reader, or EIO) still names the file."""
    from pathlib import Path

    path = write_jsonl(tmp_path / "d.jsonl", DOLLY)

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(DataError, match=r"d.jsonl cannot be read \(Permission denied\); expected a .json"):
        load_examples(str(path))


def test_lone_surrogate_is_refused_with_file_line_and_field(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(
        json.dumps(DOLLY[0]) + "\n" + '{"instruction": "hi \\ud800", "context": "", "response": "x"}\n'
    )
    with pytest.raises(
        DataError, match=r"s.jsonl, line 2: field 'instruction' holds text that is not valid Unicode"
    ):
        load_examples(str(path))


def test_own_data_the_base_cannot_read_is_refused_before_training(tmp_path, capsys, caplog, builtin_base):
    """English the built-in base's 287-word tokenizer does not know: refused naming the share and the fix
    (point model.name at a real model); with the limit raised it trains, warning; the format is logged."""
    import logging

    from fedllm.cli import main
    from tests.conftest import tiny_overrides

    rows = [
        {
            "instruction": f"What is the capital of country number {i}?",
            "input": "",
            "output": "Paris, France.",
        }
        for i in range(40)
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [
        *tiny_overrides(tmp_path / "r", "federation.rounds=1", "eval.benchmark=none"),
        f"data.dataset={path}",
    ]
    with pytest.raises(SystemExit) as e:  # (a fresh token cache shows its progress bar first)
        main(["run", *base, "data.partition=iid"])
    lines = capsys.readouterr().err.strip().splitlines()
    err = lines[-1]
    assert e.value.code == 2 and err.startswith("fedllm: error: ") and "Traceback" not in "\n".join(lines)
    assert "data.dataset: " in err and "unknown to the tokenizer of model.name='builtin'" in err
    assert "point model.name at a real model folder" in err and "data.max_unknown_share" in err
    share = float(err.split("% of the response tokens")[0].rsplit(" ", 1)[-1])
    assert share > 20
    with caplog.at_level(logging.INFO):
        assert (
            main(
                [
                    "run",
                    *base,
                    "data.partition=iid",
                    "data.max_unknown_share=1",
                    "--output-dir",
                    str(tmp_path / "ok"),
                ]
            )
            == 0
        )
    assert "unknown to the tokenizer" in caplog.text and "alpaca format (detected)" in caplog.text
