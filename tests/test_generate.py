"""fedllm generate: greedy answers equal a plain token-by-token decode whatever the batching, from the
base, a run's global adapter, a client's adapter; bad prompt files fail first; and the built-in base
answers its skills."""

from __future__ import annotations

import json

import pytest
import torch

from data_prep import builtin_skills
from data_prep.prompts import build_prompt
from fedllm.config import ModelConfig
from fedllm.model.generate import generate, read_prompts
from fedllm.model.modeling import load_base
from tests.conftest import TEST_PRETRAIN_STEPS, tiny_overrides


def greedy_by_hand(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def test_batched_greedy_answers_equal_a_plain_decode(builtin_base):
    """Left-padded batches of prompts of different lengths give each prompt the answer a one-prompt,
    token-by-token argmax decode gives."""
    model, tok = load_base(ModelConfig(name="builtin", builtin_pretrain_steps=TEST_PRETRAIN_STEPS), "cpu")
    examples = builtin_skills.instruction_examples(2, seed=5)[:6]
    assert len({len(build_prompt(e, "plain")) for e in examples}) > 1  # really different lengths
    batched = generate(model, tok, examples, "plain", max_new_tokens=5, batch_size=4)
    by_hand = [greedy_by_hand(model, tok, build_prompt(e, "plain"), 5) for e in examples]
    assert batched == by_hand
    sampled = [generate(model, tok, examples, "plain", 5, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # a seed gives the same samples


def test_prompt_files_and_errors(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('Is 4 even or odd ?\n\n{"instruction": "Add.", "input": "2 and 3"}\n')
    got = read_prompts(["first"], str(f))
    assert [(e.instruction, e.input) for e in got] == [
        ("first", ""),
        ("Is 4 even or odd ?", ""),
        ("Add.", "2 and 3"),
    ]
    f.write_text('{"input": "x"}\n')
    with pytest.raises(ValueError, match="line 1: a record needs an 'instruction' field"):
        read_prompts([], str(f))
    with pytest.raises(ValueError, match="give at least one --prompt"):
        read_prompts([], None)


def test_cli_generates_from_a_runs_global_client_and_base(tmp_path, builtin_base, capsys):
    from fedllm.cli import main

    run = tmp_path / "run"
    assert main(["run", *tiny_overrides(run, "data.client_test_fraction=0.3")]) == 0
    capsys.readouterr()
    outs = {}
    for name, extra in (("global", []), ("client", ["--client", "1"]), ("base", ["--base"])):
        out = tmp_path / f"{name}.jsonl"
        argv = [
            "generate",
            "--run",
            str(run),
            "--prompt",
            "Is 95 even or odd ?",
            "--prompt",
            "Is 4 even or odd ?",
        ]
        assert main([*argv, *extra, "--max-new-tokens", "4", "--output", str(out)]) == 0
        outs[name] = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["instruction"] for r in outs[name]] == ["Is 95 even or odd ?", "Is 4 even or odd ?"]
    assert "### Is 95 even or odd ?" in capsys.readouterr().out
    # --base is the run's own base (its pretraining steps), not the default built-in base
    from fedllm.federation_data import prompt_template
    from fedllm.run.reader import RunFolder

    cfg = RunFolder(run).config()
    base, tok = load_base(cfg.model, "cpu")
    prompts = read_prompts(["Is 95 even or odd ?", "Is 4 even or odd ?"], None)
    direct = generate(base, tok, prompts, prompt_template(cfg), 4)
    assert [r["answer"] for r in outs["base"]] == direct
    with pytest.raises(SystemExit) as e:
        main(["generate", "--run", str(run), "--prompts-file", str(tmp_path / "none.txt")])
    assert e.value.code == 2 and "--prompts-file" in capsys.readouterr().err


@pytest.mark.slow
def test_the_builtin_base_answers_its_skills(tmp_path):
    """The default base (1000 pretraining steps) answers the built-in skills' questions well above chance
    (free-form answers are mostly two-way, multiple-choice four-way: chance is about 37%)."""
    model, tok = load_base(ModelConfig(name="builtin"), "cpu")
    examples = builtin_skills.instruction_examples(10, seed=3)[:80]
    answers = generate(model, tok, examples, "plain", max_new_tokens=6, batch_size=16)
    right = sum(
        bool(a) and a.split()[0] == e.response.split()[0] for a, e in zip(answers, examples, strict=True)
    )
    assert right / len(examples) > 0.6, right
