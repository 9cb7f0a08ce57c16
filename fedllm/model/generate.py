"""``fedllm generate``: what a model answers, from the base, a run's global adapter or a client's
personalized adapter, with the run's prompt template.

Accuracy numbers say how often a model is right; reading its answers says
how it is wrong. Prompts come from the command line or a file (one per line,
or a jsonl of ``instruction``/``input`` records), are wrapped in the prompt
template the run trained with (``data.template``), batched with left padding
(a decoder-only model continues the last token of each row) and decoded
greedily (``--temperature 0``, the default: the same answer every time) or
sampled with a seed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from data_prep.prompts import CHAT, build_prompt, turn_end_id
from data_prep.schema import DataError, Example

log = logging.getLogger(__name__)


def read_prompts(prompts: list[str], file: str | None) -> list[Example]:
    """The prompts as examples: ``--prompt`` texts, then the file's lines (text, or jsonl records)."""
    out = [Example(p, "", "") for p in prompts]
    if file:
        path = Path(file)
        if not path.is_file():
            raise DataError(f"--prompts-file {file}: no such file")
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"--prompts-file {file}, line {i}: not JSON ({e.msg})") from None
                if "instruction" not in rec:
                    raise DataError(f"--prompts-file {file}, line {i}: a record needs an 'instruction' field")
                out.append(Example(str(rec["instruction"]), str(rec.get("input", "")), ""))
            else:
                out.append(Example(line.strip(), "", ""))
    if not out:
        raise DataError("give at least one --prompt or a --prompts-file")
    return out


@torch.no_grad()
def generate(
    model,
    tokenizer,
    examples: list[Example],
    template: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 8,
    max_prompt_tokens: int = 0,
    progress: bool = False,
) -> list[str]:
    """Each example's answer: the decoded new tokens, up to the end-of-sequence token.

    ``max_prompt_tokens`` > 0: a longer prompt keeps its last tokens (the input and the template's cue to
    answer; the harnesses cut from the left too). Examples go in order of prompt length, so a batch pads
    little (real prompts range from tens to hundreds of tokens); answers come back in the given order.
    """
    if max_new_tokens < 1 or batch_size < 1 or temperature < 0:
        raise ValueError("--max-new-tokens and --batch-size must be >= 1 and --temperature >= 0")
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    side_cut = tokenizer.truncation_side
    tokenizer.truncation_side = "left"
    torch.manual_seed(seed)
    texts = [build_prompt(e, template, tokenizer) for e in examples]
    special = template != CHAT  # the chat template's text holds its special tokens
    # an answer ends at the EOS, or at the chat template's end of turn (Gemma's <end_of_turn> is not the EOS)
    stops = sorted({tokenizer.eos_token_id, turn_end_id(tokenizer) if template == CHAT else None} - {None})
    cut = {"truncation": True, "max_length": max_prompt_tokens} if max_prompt_tokens else {}
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]
    if max_prompt_tokens and (n_cut := sum(n > max_prompt_tokens for n in lengths)):
        log.info("%d of %d prompts are longer than %d tokens: their oldest tokens are cut", n_cut, len(texts),
                 max_prompt_tokens)  # fmt: skip
        lengths = [min(n, max_prompt_tokens) for n in lengths]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    answers: list[str] = [""] * len(texts)
    from eval.progress import Progress

    bar = Progress(len(texts), "generating answers", "answers", progress, log)
    try:
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            enc = tokenizer(
                [texts[i] for i in rows], return_tensors="pt", padding=True, add_special_tokens=special, **cut
            ).to(device)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
                eos_token_id=stops,
            )
            new = [_until(row.tolist(), stops) for row in out[:, enc["input_ids"].shape[1] :]]
            for i, text in zip(rows, tokenizer.batch_decode(new, skip_special_tokens=True), strict=True):
                answers[i] = text.strip()
            bar.update(len(rows))
    finally:
        bar.close()
        tokenizer.padding_side, tokenizer.truncation_side = side, side_cut
    return answers


def _until(ids: list[int], stops: list[int]) -> list[int]:
    """A generated row up to its first stop token (the tokens after it are padding; a stop token that is not
    a special token, Gemma's <end_of_turn>, would otherwise be decoded into the answer)."""
    cut = next((k for k, t in enumerate(ids) if t in stops), len(ids))
    return ids[:cut]
