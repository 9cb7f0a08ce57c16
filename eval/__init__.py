"""MMLU evaluation: prompts as the reference harness builds them, log-likelihood scoring, aggregation."""
