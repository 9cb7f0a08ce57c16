"""The evaluations a run makes, apart from the round loop that asks for them.

After a round (and before the first) the round loop asks for the global model's evaluation, or, for a
strategy without a global model (local-only), each visited client's own (:meth:`RunEvaluator.of_clients`).
Here each is scored (held-out loss, the benchmark, held-out Rouge-L, the general prompts:
``fedllm.model.evaluation.evaluate_global``), the base's own evaluation is reused where the same inputs
were evaluated before (``fedllm/model/evaluation_cache.py``), the general prompts' reference (the base's
answers) is kept in the run folder, and the answers go to ``generations.jsonl``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from eval.general import GeneralCheck
from eval.mmlu import Benchmark
from fedllm.config import Config, flat_config
from fedllm.logs import client_label
from fedllm.model import evaluation_cache
from fedllm.model.evaluation import Generation, evaluate_global

log = logging.getLogger(__name__)

# a model to score: LoRA factors by module, dense modules, LoRA biases (``Server.global_adapter``)
GlobalModel = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


@dataclass
class RunEvaluator:
    """What a run's evaluations read: the config, the client runtime's base, the launch, the run folder's
    writer, and the held-out data, benchmark, generation and general prompts the driver set up."""

    cfg: Config
    runtime: Any
    acc: Any
    writer: Any
    eval_data: Any
    benchmark: Benchmark | None
    generation: Generation | None
    general: GeneralCheck | None

    def of_global(self, round_idx: int, global_model: GlobalModel) -> dict[str, Any]:
        """The global model's figures after ``round_idx`` (0: the base, reused where it was evaluated
        before); its answers go to ``generations.jsonl``."""
        key = self.base_key(global_model) if round_idx == 0 else None
        stored = evaluation_cache.load(key) if key is not None else None
        if stored is not None:
            log.info("the base's evaluation is reused: the same model, data and settings were evaluated "
                     "before (%s/%s.json; eval.reuse_base=false evaluates it again)",
                     evaluation_cache.cache_folder(), key)  # fmt: skip
            out = evaluation_cache.reused(stored)
        else:
            out = self._score(round_idx, global_model)
            if key is not None and self.acc.is_main_process:
                evaluation_cache.store(key, out)
        self.writer.log_answers(round_idx, self._take_answers(round_idx, out))
        return out

    def of_clients(self, round_idx: int, models: dict[int, GlobalModel | None]) -> dict[str, Any]:
        """Each client's own model scored as the global one would be, and the mean over them: held-out loss,
        benchmark, Rouge-L and the general prompts' agreement (and the per-category and per-task means);
        each client's own figures under ``scored_clients``. ``models``: the clients the round loop visits
        (under a secret sample a fixed seeded subset), None for one that has no model of its own yet."""
        per: dict[int, dict[str, Any]] = {}
        answers: list[dict[str, Any]] = []
        for cid, own in models.items():
            if own is None:  # never trained (a fixed subset's client, not yet sampled): nothing of its own
                continue
            log.info("round %d: scoring client %s's own model", round_idx, client_label(cid))
            out = self._score(round_idx, own)
            answers += [{**a, "client": cid} for a in self._take_answers(round_idx, out)]
            per[cid] = out
        self.writer.log_answers(round_idx, answers)
        if not per:
            log.warning("round %d: none of the clients to score has trained yet: nothing scored", round_idx)
            return {"scored_clients": {}}
        return mean_of_clients(per)

    def _score(self, round_idx: int, model: GlobalModel) -> dict[str, Any]:
        general = self.general
        if general is not None and general.reference is None and round_idx > 0:
            general.reference = self.writer.general_reference()  # a resumed run: the base's, as written
        return evaluate_global(
            self.runtime,
            model,
            self.eval_data,
            self.benchmark,
            self.cfg.eval.batch_size,
            self.generation,
            general,
        )

    def _take_answers(self, round_idx: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        """The evaluation's answers, taken out of its figures: the held-out tasks' and the general prompts'.
        Round 0's general answers are the base's: they become the reference (kept in the run folder for a
        resume) and agree with themselves (100)."""
        answers: list[dict[str, Any]] = out.pop("generations", [])
        general = out.pop("general_answers", None)
        scores = out.pop("general_scores", None)
        if general is None or self.general is None:
            return answers
        if round_idx == 0:  # the base's own answers: the reference, which agrees with itself
            self.general.reference = general
            self.writer.keep_general_reference(general)
            out["general_agreement"] = 100.0
        for i, (example, answer) in enumerate(zip(self.general.examples, general, strict=True)):
            scored = {} if scores is None else {"agreement": scores[i]}
            answers.append({"task": "general", "prompt": example.instruction, "answer": answer, **scored})
        return answers

    def base_key(self, global_model: GlobalModel) -> str | None:
        """The key under which the evaluation before round 1 is the base's own and can be reused
        (:mod:`fedllm.model.evaluation_cache`); None when the global model computes anything else than the
        base (``ClientRuntime.is_base``), the run is split over processes, or ``eval.reuse_base`` is off."""
        if not self.cfg.eval.reuse_base or self.acc.num_processes > 1:
            return None
        if not self.runtime.is_base(*global_model):
            return None
        from fedllm.model.modeling import resolve_model_path

        model = self.cfg.model
        return evaluation_cache.base_key(
            resolve_model_path(model.name, model.builtin_pretrain_steps),
            {k: v for k, v in flat_config(self.cfg).items() if k.startswith("model.")},
            self.eval_data,
            self.benchmark,
            [self.generation, self.general],
            self.cfg.eval.batch_size,
            str(self.acc.mixed_precision),
        )


def mean_of_clients(per: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The mean over clients of each evaluation figure (a number, or a dict of numbers by category or task:
    the mean over the clients that have it); times are summed. Each client's scalar figures are kept under
    ``scored_clients``."""
    out: dict[str, Any] = {}
    keys = dict.fromkeys(k for r in per.values() for k in r)
    for k in keys:
        vals = [r[k] for r in per.values() if r.get(k) is not None]
        if not vals:
            out[k] = None
        elif k.startswith("time_"):
            out[k] = sum(vals)
        elif all(isinstance(v, int | float) for v in vals):
            out[k] = sum(vals) / len(vals)
        elif all(isinstance(v, dict) for v in vals):
            names = dict.fromkeys(n for v in vals for n in v)
            out[k] = {n: sum(v[n] for v in vals if n in v) / sum(n in v for v in vals) for n in names}
    out["scored_clients"] = {
        str(cid): {k: v for k, v in r.items() if isinstance(v, int | float) and not k.startswith("time_")}
        for cid, r in per.items()
    }
    return out
