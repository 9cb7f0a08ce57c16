"""Global evaluation of a run's model: held-out loss and first-token accuracy, and the benchmark.

The model is the client runtime's base with the server's global model
installed on it (``ClientRuntime.install_global``); the benchmark is scored
the MMLU way by ``eval/``. Under ZeRO-3 every process runs every forward pass
(the weights are gathered layer by layer), so the benchmark is not split.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from data_prep.natural_instructions import Reference
from data_prep.prompts import TokenizedExample, collate
from eval.general import GeneralCheck
from eval.mmlu import Benchmark
from eval.mmlu import evaluate as score_benchmark
from eval.rouge import rouge_l
from fedllm.model.generate import generate
from fedllm.model.loss import response_logits
from fedllm.model.parallel import evaluation_engine

log = logging.getLogger(__name__)


@torch.no_grad()
def heldout(
    model, tokenizer, data: list[TokenizedExample], batch_size: int, progress: bool = False
) -> tuple[float | None, float | None]:
    """Mean response-token loss, and the share of examples whose whole answer is predicted (teacher-forced
    argmax at every response token but the closing EOS: for a one-token answer, its first token; for the
    testbed's "52 even", both the intermediate step and the label, which is what a label shift changes)."""
    if not data:
        return None, None
    from eval.progress import Progress

    device = next(model.parameters()).device
    with Progress(len(data), "held-out loss", "examples", progress, log) as bar:
        return _heldout(model, tokenizer, data, batch_size, device, bar)


def _heldout(model, tokenizer, data, batch_size: int, device, bar) -> tuple[float, float]:
    total, tokens, hits = 0.0, 0, 0
    for i in range(0, len(data), batch_size):
        batch = {
            k: v.to(device) for k, v in collate(data[i : i + batch_size], tokenizer.pad_token_id).items()
        }
        logits, labels = response_logits(model, batch)  # the head only where a label is
        n = int((labels != -100).sum())
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        total += loss.item() * n
        tokens += n
        predicted = logits.argmax(-1)
        scored = labels != -100
        if tokenizer.eos_token_id is not None:  # the answer's words, not its end marker
            scored &= labels != tokenizer.eos_token_id
        hits += int(((predicted == labels) | ~scored).all(1).logical_and(scored.any(1)).sum())
        bar.update(len(batch["labels"]))
    return total / tokens, hits / len(data)


@dataclass
class Generation:
    """The Rouge-L evaluation: what is answered, with which template, how long prompts and answers may be."""

    references: list[Reference]
    template: str
    max_new_tokens: int
    max_prompt_tokens: int


def _greedy(
    model, tokenizer, examples: list, how: Generation | GeneralCheck, batch_size: int, progress: bool
):
    """Greedy answers with ``how``'s template and lengths (the held-out tasks' and the general prompts')."""
    return generate(
        model,
        tokenizer,
        examples,
        how.template,
        max_new_tokens=how.max_new_tokens,
        batch_size=batch_size,
        max_prompt_tokens=how.max_prompt_tokens,
        progress=progress,
    )


def rouge_heldout(
    model, tokenizer, gen: Generation, batch_size: int, progress: bool = False
) -> dict[str, Any]:
    """Greedy answers to ``gen``'s examples, scored by Rouge-L against each one's references: the mean,
    and the mean per task (category) where examples carry one."""
    answers = _greedy(model, tokenizer, [r.example for r in gen.references], gen, batch_size, progress)
    scores = rouge_l(answers, [r.references for r in gen.references])
    by_task: dict[str, list[float]] = {}
    for r, s in zip(gen.references, scores, strict=True):
        by_task.setdefault(r.example.category or "all", []).append(s)
    return {
        "rouge_l": sum(scores) / len(scores),
        "rouge_l_tasks": {t: sum(v) / len(v) for t, v in sorted(by_task.items())},
        "generations": [  # written to generations.jsonl, not to the metrics row
            {"task": r.example.category, "answer": a, "rouge_l": s, "references": list(r.references)}
            for r, a, s in zip(gen.references, answers, scores, strict=True)
        ],
    }


def general_answers(
    model, tokenizer, check: GeneralCheck, batch_size: int, progress: bool = False
) -> dict[str, Any]:
    """The answers to the general prompts and, once the base's are known, their mean Rouge-L against them
    (``general_agreement``, 0-100)."""
    answers = _greedy(model, tokenizer, check.examples, check, batch_size, progress)
    out: dict[str, Any] = {"general_answers": answers}
    if check.reference is not None:
        scores = rouge_l(answers, [[r] for r in check.reference])
        out["general_agreement"] = sum(scores) / len(scores)
        out["general_scores"] = scores
    return out


def evaluate_global(
    runtime,
    global_model: tuple,
    eval_data: list[TokenizedExample],
    benchmark: Benchmark | None,
    batch_size: int,
    generation: Generation | None = None,
    general: GeneralCheck | None = None,
) -> dict[str, Any]:
    """Held-out loss, the benchmark, (``generation``) held-out Rouge-L and (``general``) the answers to the
    general prompts, scored against the base's once known (``eval/general.py``), of the global model
    (``Server.global_adapter()``) on ``runtime``'s base.
    """
    t0 = time.perf_counter()
    has_adapter = runtime.install_global(*global_model)
    model, layout, acc = runtime.model, runtime.layout, runtime.acc
    ctx = torch.no_grad() if has_adapter else model.disable_adapter()
    out: dict[str, Any] = {}
    lockstep = layout.zero_stage == 3
    progress = acc.is_main_process and runtime.progress
    with ctx, evaluation_engine(acc, layout, model, batch_size):
        t = time.perf_counter()
        out["eval_loss"], out["eval_token_acc"] = heldout(
            model, runtime.tokenizer, eval_data, batch_size, progress
        )
        out["time_eval_loss_s"] = time.perf_counter() - t
        if benchmark is not None:
            t = time.perf_counter()
            result, _ = score_benchmark(
                model,
                runtime.tokenizer,
                benchmark,
                batch_size=batch_size,
                accelerator=None if lockstep else acc,
                progress=progress,
            )
            out["accuracy"] = result["accuracy"]
            out["accuracy_categories"] = result["categories"]
            out["time_eval_benchmark_s"] = time.perf_counter() - t
        if generation is not None and generation.references:
            t = time.perf_counter()
            with acc.autocast():  # the run's mixed precision (model.mixed_precision); scores above stay as is
                out.update(rouge_heldout(model, runtime.tokenizer, generation, batch_size, progress))
            out["time_eval_generate_s"] = time.perf_counter() - t
        if general is not None:
            t = time.perf_counter()
            with acc.autocast():
                out.update(general_answers(model, runtime.tokenizer, general, batch_size, progress))
            out["time_eval_general_s"] = time.perf_counter() - t
    out["time_eval_s"] = time.perf_counter() - t0
    return out
