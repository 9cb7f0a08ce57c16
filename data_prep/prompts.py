"""Prompt templates and tokenization with the loss on response tokens only.

Alpaca-style SFT: the model sees prompt + response + EOS, and the labels of
the prompt tokens are -100 so only the response is learned. The prompt is
tokenized on its own and its length masks the joint tokenization, as in the
Stanford Alpaca code, so BPE merges across the boundary cannot shift the mask
by more than the boundary token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_prep.schema import Example

IGNORE_INDEX = -100

TEMPLATES: dict[str, tuple[str, str]] = {
    # (with input, without input)
    "alpaca": (
        "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    # The instruction itself is the prompt, the response follows after a space:
    # an MMLU-format instruction ending in "Answer:" is then scored exactly
    # as the MMLU evaluation scores it (" A".." D" after "Answer:").
    "plain": ("{instruction}\n{input} ", "{instruction} "),
}


def build_prompt(example: Example, template: str) -> str:
    """The prompt text (everything before the response) of ``example``."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {sorted(TEMPLATES)}")
    with_input, without_input = TEMPLATES[template]
    fmt = with_input if example.input.strip() else without_input
    return fmt.format(instruction=example.instruction.strip(), input=example.input.strip())


@dataclass
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]


def tokenize_example(example: Example, tokenizer, template: str, max_seq_len: int) -> TokenizedExample | None:
    """Token ids and masked labels, truncated to ``max_seq_len``.

    Returns ``None`` when truncation leaves no response token, because such an
    example would contribute nothing but padding to a batch.
    """
    prompt = build_prompt(example, template)
    prompt_ids = tokenizer(prompt)["input_ids"]
    full_ids = tokenizer(prompt + example.response.strip())["input_ids"]
    if tokenizer.eos_token_id is not None:
        full_ids = [*full_ids, tokenizer.eos_token_id]
    n_prompt = min(len(prompt_ids), len(full_ids))
    labels = [IGNORE_INDEX] * n_prompt + full_ids[n_prompt:]
    full_ids, labels = full_ids[:max_seq_len], labels[:max_seq_len]
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return TokenizedExample(full_ids, labels)


def tokenize_examples(
    examples: list[Example], tokenizer, template: str, max_seq_len: int
) -> list[TokenizedExample]:
    """Tokenize a list, dropping examples that truncation left without a response."""
    out = []
    for ex in examples:
        tok = tokenize_example(ex, tokenizer, template, max_seq_len)
        if tok is not None:
            out.append(tok)
    return out


def collate(batch: list[TokenizedExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; padded positions are masked in attention and labels."""
    width = max(len(b.input_ids) for b in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b.input_ids)
        ids[i, :n] = torch.tensor(b.input_ids)
        labels[i, :n] = torch.tensor(b.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
