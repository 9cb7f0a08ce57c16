"""MMLU accuracy as an ``evaluate`` metric that loads offline.

    import evaluate
    metric = evaluate.load("path/to/eval/mmlu_metric")
    metric.compute(predictions=[0, 2], references=[0, 1], subjects=["anatomy", "virology"])

Returns the micro accuracy over questions (MMLU's headline figure), accuracy
per category (stem, humanities, social_sciences, other) and per subject,
computed exactly as ``eval.mmlu.aggregate`` does.
"""

from __future__ import annotations

from collections import defaultdict

import datasets
import evaluate

_CITATION = """@article{hendryckstest2021, title={Measuring Massive Multitask Language Understanding},
author={Dan Hendrycks and Collin Burns and Steven Basart and Andy Zou and Mantas Mazeika and Dawn Song
and Jacob Steinhardt}, journal={ICLR}, year={2021}}"""
_DESCRIPTION = "MMLU accuracy: micro average over questions, per category and per subject."
_KWARGS = "predictions: answer indices 0-3; references: gold indices 0-3; subjects: subject of each question."

# `evaluate.load` copies only this file, so the table is inlined here; a test
# checks it against eval/mmlu_subjects.json.
SUBJECT_CATEGORIES = {
    "abstract_algebra": "stem",
    "anatomy": "stem",
    "astronomy": "stem",
    "business_ethics": "other",
    "clinical_knowledge": "other",
    "college_biology": "stem",
    "college_chemistry": "stem",
    "college_computer_science": "stem",
    "college_mathematics": "stem",
    "college_medicine": "other",
    "college_physics": "stem",
    "computer_security": "stem",
    "conceptual_physics": "stem",
    "econometrics": "social_sciences",
    "electrical_engineering": "stem",
    "elementary_mathematics": "stem",
    "formal_logic": "humanities",
    "global_facts": "other",
    "high_school_biology": "stem",
    "high_school_chemistry": "stem",
    "high_school_computer_science": "stem",
    "high_school_european_history": "humanities",
    "high_school_geography": "social_sciences",
    "high_school_government_and_politics": "social_sciences",
    "high_school_macroeconomics": "social_sciences",
    "high_school_mathematics": "stem",
    "high_school_microeconomics": "social_sciences",
    "high_school_physics": "stem",
    "high_school_psychology": "social_sciences",
    "high_school_statistics": "stem",
    "high_school_us_history": "humanities",
    "high_school_world_history": "humanities",
    "human_aging": "other",
    "human_sexuality": "social_sciences",
    "international_law": "humanities",
    "jurisprudence": "humanities",
    "logical_fallacies": "humanities",
    "machine_learning": "stem",
    "management": "other",
    "marketing": "other",
    "medical_genetics": "other",
    "miscellaneous": "other",
    "moral_disputes": "humanities",
    "moral_scenarios": "humanities",
    "nutrition": "other",
    "philosophy": "humanities",
    "prehistory": "humanities",
    "professional_accounting": "other",
    "professional_law": "humanities",
    "professional_medicine": "other",
    "professional_psychology": "social_sciences",
    "public_relations": "social_sciences",
    "security_studies": "social_sciences",
    "sociology": "social_sciences",
    "us_foreign_policy": "social_sciences",
    "virology": "other",
    "world_religions": "humanities",
}


class MmluMetric(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                    "subjects": datasets.Value("string"),
                }
            ),
        )

    def _compute(self, predictions, references, subjects, categories: dict | None = None):
        cats = {**SUBJECT_CATEGORIES, **(categories or {})}
        by_subject, by_category = defaultdict(list), defaultdict(list)
        hits = []
        for p, r, s in zip(predictions, references, subjects, strict=True):
            hit = int(p == r)
            hits.append(hit)
            by_subject[s].append(hit)
            by_category[cats.get(s, "other")].append(hit)
        out = {"accuracy": sum(hits) / len(hits) if hits else float("nan"), "n": len(hits)}
        out.update({f"category/{c}": sum(v) / len(v) for c, v in sorted(by_category.items())})
        out.update({f"subject/{s}": sum(v) / len(v) for s, v in sorted(by_subject.items())})
        return out
