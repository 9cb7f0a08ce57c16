"""What a comparison reads from each finished run, and how each metric is printed and ranked.

A run evaluates one held-out set (``eval.split``): the test set (``heldout_loss``: a table's numbers) or the
validation set (``validation_loss``: what tuning chooses on). A metric of the other set is never read from a
run, so a table cannot be fed a validation number or a choice a test number.
"""

from __future__ import annotations

from pathlib import Path

from fedllm.run.reader import RunFolder

# metric name -> (where it is read, how it is printed: accuracies in points, counts with separators)
METRICS = {
    "accuracy": ("summary:accuracy_after", "points"),
    "accuracy_gain": ("gain:accuracy", "points"),
    "heldout_loss": ("summary:loss_after", "loss"),
    "heldout_loss_drop": ("drop:loss", "percent"),
    "validation_loss": ("summary:loss_after", "loss"),
    "rouge_l": ("summary:rouge_l_after", "rouge"),
    "rouge_l_gain": ("gain:rouge_l", "rouge"),
    "general_agreement": ("summary:general_agreement_after", "rouge"),
    "client_acc_global": ("last:global_client_acc", "points"),
    "client_acc_personal": ("last:personal_acc", "points"),
    "up_params": ("comm:total_up_params", "count"),
    "down_params": ("comm:total_down_params", "count"),
    "up_mb": ("comm:total_up_bytes", "megabytes"),
    "down_mb": ("comm:total_down_bytes", "megabytes"),
    "wall_s": ("summary:wall_s", "seconds"),
    "client_loss_global": ("last:global_client_loss", "loss"),
    "client_loss_personal": ("last:personal_loss", "loss"),
    # the same, over the clients sampled at least once (one never sampled has its method's starting model)
    "client_loss_own_trained": ("own:personal_loss", "loss"),
    # updates the server's clip scaled down, over the run (0 when no clip runs: counted either way)
    "clipped_updates": ("rows:agg_clipped", "count"),
    # the largest update change over the round's median change, over the run (what a clip would have cut)
    "update_norm_ratio_max": ("rowsmax:agg_update_norm_ratio_max", "number"),
}
# the held-out set a metric is of (eval.split): read only from a run that evaluated that set
SPLIT_OF = {
    "heldout_loss": "test",
    "heldout_loss_drop": "test",
    "rouge_l": "test",
    "rouge_l_gain": "test",
    "accuracy": "test",
    "accuracy_gain": "test",
    "validation_loss": "validation",
}
# which way is better, for the metrics a table ranks rows by ("the best row"): +1 higher, -1 lower
BETTER = {
    "accuracy": 1,
    "accuracy_gain": 1,
    "heldout_loss": -1,
    "heldout_loss_drop": 1,
    "validation_loss": -1,
    "rouge_l": 1,
    "rouge_l_gain": 1,
    "client_acc_global": 1,
    "client_acc_personal": 1,
    "client_loss_global": -1,
    "client_loss_personal": -1,
    "client_loss_own_trained": -1,
    "down_mb": -1,
    "up_mb": -1,
}
FORMATS = {
    "points": (100.0, ".1f", " points"),
    "percent": (100.0, ".1f", " %"),
    "loss": (1.0, ".4f", ""),
    "rouge": (1.0, ".2f", ""),  # Rouge-L, already in percent
    "count": (1.0, ",.0f", ""),
    "megabytes": (1e-6, ".3f", " MB"),
    "seconds": (1.0, ".1f", " s"),
    "number": (1.0, ".3g", ""),  # a number a feature reports in the summary's ``metrics`` (e.g. its bound)
}


def metric_format(metric: str) -> tuple[float, str, str]:
    """(scale, format spec, unit) of a metric (a feature's own: a plain number)."""
    return FORMATS[METRICS.get(metric, ("", "number"))[1]]


def run_metrics(run_dir: Path) -> dict[str, float | None]:
    """The comparison metrics of one finished run (None where the run does not have them)."""
    run = RunFolder(run_dir)
    summary, rows = run.summary(), run.rows()
    split = summary.get("eval_split", "test")  # a run made before validation sets existed read the test set
    last = next((r for r in reversed(rows) if "eval_loss" in r or "accuracy" in r), rows[-1] if rows else {})
    out: dict[str, float | None] = {}
    for name, (where, _) in METRICS.items():
        kind, _, key = where.partition(":")
        if SPLIT_OF.get(name, split) != split:
            out[name] = None
        elif kind == "summary":
            out[name] = summary.get(key)
        elif kind == "last":
            out[name] = last.get(key)
        elif kind == "comm":
            out[name] = summary.get("communication", {}).get(key)
        elif kind == "gain":  # after minus before
            a, b = summary.get(f"{key}_after"), summary.get(f"{key}_before")
            out[name] = None if a is None or b is None else a - b
        elif kind == "own":  # the last personalized row's clients that were sampled at least once
            sampled = {str(k) for r in rows for k in r.get("sampled", [])}
            own: dict[str, dict[str, float]] = next(
                (r["personal"] for r in reversed(rows) if r.get("personal")), {}
            )
            vals = [v[key] for k, v in own.items() if k in sampled and v.get(key) is not None]
            out[name] = sum(vals) / len(vals) if vals else None
        elif kind == "drop":  # relative fall, 1 - after / before
            a, b = summary.get(f"{key}_after"), summary.get(f"{key}_before")
            out[name] = None if a is None or not b else 1 - a / b
        elif kind == "rows":  # a count over the run's training rows (None where no row has it)
            counts = [r[key] for r in rows if key in r]
            out[name] = sum(counts) if counts else None
        elif kind == "rowsmax":
            found = [r[key] for r in rows if r.get(key) is not None]
            out[name] = max(found) if found else None
    out.update(summary.get("metrics", {}))  # what a feature reports (a guarantee's bound, ...)
    return out
