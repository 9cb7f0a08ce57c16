"""Prompt templates and tokenization with the loss on response tokens only.

Alpaca-style SFT: the model sees prompt + response + EOS, and the labels of
the prompt tokens are -100 so only the response is learned. The prompt is
tokenized on its own and its length masks the joint tokenization, as in the
Stanford Alpaca code, so BPE merges across the boundary cannot shift the mask
by more than the boundary token.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    # FlowerTune's templates (``formatting_prompts_func`` in examples/flowertune-llm-*): Alpaca's header
    # without the blank lines, the response after "### Response: " on the same line; the loaded record's
    # instruction already holds what the template puts there (data_prep.loaders), texts kept as they are.
    "flowertune": (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n### Instruction:\n{instruction}\n### Response: ",
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n### Instruction:\n{instruction}\n### Response: ",
    ),
}
VERBATIM = {"flowertune"}  # templates whose texts go in unstripped, as their reference builds them
# The base's own chat template (an instruct model's, e.g. SmolLM2-Instruct's ChatML): the instruction and
# input are the user's turn, the response the assistant's, closed by the tokenizer's EOS (the end-of-turn
# token of such a template). Its text already holds every special token, so it is tokenized without adding
# more.
CHAT = "chat"


# Gemma's turn format, written from its published description (ai.google.dev, "Gemma formatting and system
# instructions"): ``<start_of_turn>user`` / ``<start_of_turn>model`` turns, each closed by ``<end_of_turn>``
# and a newline, after the BOS; Gemma has no system role: system instructions go at the start of the first
# user turn, followed by a blank line. A base checkpoint without a chat template of its own (the Gemma 3
# 270M GGUF) gets this one from ``fedllm.model.modeling.load_base``, so conversations can train on it.
GEMMA_TURNS = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma turns alternate: user, model, user, ... (one system turn first at most)') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# model types whose checkpoints may come without a chat template, and the turn format they were made for
TURN_FORMATS = {
    "gemma3": GEMMA_TURNS,
    "gemma3_text": GEMMA_TURNS,
    "gemma2": GEMMA_TURNS,
    "gemma": GEMMA_TURNS,
}


def turn_end_id(tokenizer) -> int | None:
    """The token the chat template closes an answer with (ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``):
    the first special or added token it writes after an answer's text (what it writes before the text, a
    "<think>" block, is not looked at); the EOS where it writes none. An answer is trained up to it and
    generation stops at it."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.eos_token_id
    user = [{"role": "user", "content": "Hi"}]
    before = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": "Yes"}], tokenize=False)
    tail = whole[len(before) :] if whole.startswith(before) else ""
    if "Yes" not in tail:
        return tokenizer.eos_token_id
    after = tail[tail.index("Yes") + len("Yes") :]
    markers = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    markers -= {tokenizer.unk_token_id} - {tokenizer.eos_token_id}
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    return next((t for t in ids if t in markers), tokenizer.eos_token_id)


def chat_prompt(example: Example, tokenizer) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.template = chat needs a base whose tokenizer has a chat template (an instruct model's); "
            "this one has none: use alpaca or plain"
        )
    content = example.instruction.strip()
    if example.input.strip():
        content += "\n\n" + example.input.strip()
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def build_prompt(example: Example, template: str, tokenizer=None) -> str:
    """The prompt text (everything before the response) of ``example``; ``tokenizer``: the base's, for the
    chat template."""
    if template == CHAT:
        return chat_prompt(example, tokenizer)
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {sorted([*TEMPLATES, CHAT])}")
    with_input, without_input = TEMPLATES[template]
    fmt = with_input if example.input.strip() else without_input
    if template in VERBATIM:
        return fmt.format(instruction=example.instruction, input=example.input)
    return fmt.format(instruction=example.instruction.strip(), input=example.input.strip())


def response_text(example: Example, template: str) -> str:
    """The response as it follows the prompt in training."""
    return example.response if template in VERBATIM else example.response.strip()


@dataclass
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]
    cut: int = 0  # tokens lost to max_seq_len (counted and reported: real prompts run long)


TRUNCATION = ("right", "left")


def tokenize_batch(
    examples: Sequence[Example], tokenizer, template: str, max_seq_len: int, truncation: str = "right"
) -> list[TokenizedExample | None]:
    """Token ids and masked labels of each example, truncated to ``max_seq_len``; the prompts and the full
    texts each go through the tokenizer as one batch (the fast tokenizer's parallel path).

    ``truncation``: ``right`` cuts the end (the response first), ``left`` the start (the prompt's oldest
    tokens, keeping the response whole when it fits: real instructions run to hundreds of tokens, and an
    example whose response is cut away teaches nothing).

    An entry is ``None`` when truncation leaves no response token, because such an example would contribute
    nothing but padding to a batch.
    """
    if any(e.turns for e in examples):  # conversations: the chat template, loss on the assistant's turns
        if template != CHAT:
            raise ValueError(
                f"conversations (data_prep/sharegpt.py) are rendered by the base's chat template: set "
                f"data.template=chat (got {template!r})"
            )
        if all(e.turns for e in examples):
            return [tokenize_conversation(e, tokenizer, max_seq_len) for e in examples]
        return [
            tokenize_conversation(e, tokenizer, max_seq_len)
            if e.turns
            else tokenize_batch([e], tokenizer, template, max_seq_len, truncation)[0]
            for e in examples
        ]
    prompts = [build_prompt(e, template, tokenizer) for e in examples]
    fulls = [p + response_text(e, template) for p, e in zip(prompts, examples, strict=True)]
    special = template != CHAT  # the chat template's text holds its special tokens already
    prompt_ids = tokenizer(prompts, add_special_tokens=special)["input_ids"] if prompts else []
    full_ids = tokenizer(fulls, add_special_tokens=special)["input_ids"] if fulls else []
    # a chat template's answer ends with its end of turn (ChatML's is the EOS; Gemma's is <end_of_turn>)
    eos = turn_end_id(tokenizer) if template == CHAT else tokenizer.eos_token_id
    bos = tokenizer.bos_token_id
    out: list[TokenizedExample | None] = []
    for p_ids, f_ids in zip(prompt_ids, full_ids, strict=True):
        ids = [*f_ids, eos] if eos is not None else list(f_ids)
        n_prompt = min(len(p_ids), len(ids))
        labels = [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
        cut = max(0, len(ids) - max_seq_len)
        if truncation == "left":
            # a BOS the tokenizer added stays: models trained with one (Gemma, Llama) are far off without
            # it, and generation's left truncation (the tokenizer's) keeps it too. A chat template writes
            # its first token into the text (SmolLM2's BOS is its "<|im_start|>"): generation cuts that
            # as text, and so does training, so that both see the same prompt
            lead = 1 if special and bos is not None and ids[:1] == [bos] else 0
            if cut and cut >= n_prompt - lead:  # the response alone fills the budget: no prompt would be left
                out.append(None)
                continue
            ids, labels = ids[:lead] + ids[lead + cut :], labels[:lead] + labels[lead + cut :]
        else:
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        out.append(None if all(x == IGNORE_INDEX for x in labels) else TokenizedExample(ids, labels, cut))
    return out


def tokenize_example(example: Example, tokenizer, template: str, max_seq_len: int) -> TokenizedExample | None:
    """One example (see :func:`tokenize_batch`)."""
    return tokenize_batch([example], tokenizer, template, max_seq_len)[0]


def tokenize_examples(
    examples: Sequence[Example], tokenizer, template: str, max_seq_len: int
) -> list[TokenizedExample]:
    """Tokenize a list in memory, dropping examples that truncation left without a response (the federation's
    data goes through the on-disk cache of ``data_prep.tokenized`` instead)."""
    return [t for t in tokenize_batch(examples, tokenizer, template, max_seq_len) if t is not None]


def tokenize_conversation(example: Example, tokenizer, max_seq_len: int):
    """``example``'s turns rendered by the tokenizer's chat template, labels on the assistant's turns only
    (their text and the template's end of turn), cut at a turn boundary (``data_prep/sharegpt.py``); None
    when not even the first user turn fits. Each turn's tokens are found by rendering the conversation up
    to it: a template whose rendering of a longer conversation does not begin with that of a shorter one
    cannot be masked this way, and is refused."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("conversations need a base whose tokenizer has a chat template (data.template=chat)")
    messages = [{"role": r, "content": t} for r, t in example.turns]

    def ids(upto: int, prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    input_ids: list[int] = []
    labels: list[int] = []
    answered = 0  # where the last assistant turn kept ends
    eos = turn_end_id(tokenizer)

    def taught(answer: list[int]) -> list[int]:
        """An answer's labels: its tokens up to the end of turn (what generation stops at); what the
        template writes after it (a newline) is masked, as the single-turn path never trains it either."""
        if eos in answer:
            k = answer.index(eos) + 1
            return answer[:k] + [IGNORE_INDEX] * (len(answer) - k)
        return answer

    for k, (role, _) in enumerate(example.turns):
        before = ids(k, prompt=role == "assistant") if role == "assistant" else ids(k) if k else []
        after = ids(k + 1)
        # the rendering up to this turn must begin with what is kept, and (an answer) with its own
        # generation prompt: a template that prompts otherwise than it renders a finished turn (a
        # "<think>" opened only when generating) would misplace every answer token
        if after[: len(input_ids)] != input_ids or after[: len(before)] != before:
            raise ValueError(
                "the chat template renders a longer conversation differently from a shorter one's start; "
                "its assistant turns cannot be masked token by token"
            )
        if role == "assistant":
            prompt_part, answer = before[len(input_ids) :], after[len(before) :]
            if len(input_ids) + len(prompt_part) + len(answer) > max_seq_len:
                if "assistant" in {r for r, _ in example.turns[:k]}:
                    break  # cut at the turn boundary: what is kept ends with an assistant turn
                room = max_seq_len - len(input_ids) - len(prompt_part)
                if room <= 0:
                    return None  # the first request alone fills the budget
                input_ids += prompt_part + answer[:room]
                labels += [IGNORE_INDEX] * len(prompt_part) + taught(answer[:room])
                answered = len(input_ids)
                break
            input_ids += prompt_part + answer
            labels += [IGNORE_INDEX] * len(prompt_part) + taught(answer)
            answered = len(input_ids)
        else:
            part = after[len(input_ids) :]
            if len(input_ids) + len(part) > max_seq_len:
                if k == 0 or not any(r == "assistant" for r, _ in example.turns[:k]):
                    return None
                break
            input_ids += part
            labels += [IGNORE_INDEX] * len(part)
    if all(x == IGNORE_INDEX for x in labels):
        return None
    input_ids, labels = input_ids[:answered], labels[:answered]  # end with the last answer kept
    cut = max(0, len(ids(len(example.turns))) - len(input_ids))
    return TokenizedExample(input_ids, labels, cut)


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
