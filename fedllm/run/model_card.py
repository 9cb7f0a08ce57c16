"""The model card of an export: the Hub's metadata and what was exported (round, metrics, traffic).

Written into every export folder as ``README.md``; ``base_model`` and
``datasets`` name Hub ids only, since a path of this machine means nothing on
the Hub.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from eval.mmlu import benchmark_name
from fedllm.run.reader import RunFolder

log = logging.getLogger(__name__)


def hub_id(name: str) -> str | None:
    """``name`` if it reads as a Hub repository id (owner/name, not a path on this machine), else None."""
    local = Path(name).expanduser().exists() or name.startswith((".", "/", "~"))
    if name in ("builtin", "builtin-testbed") or local:
        return None
    return name if name.count("/") == 1 and all(name.split("/")) else None


def card_text(
    run: RunFolder,
    cfg,
    base: str,
    merged: bool,
    client: int | None = None,
    round_idx: int | None = None,
) -> str:
    """An export's README.md: the Hub's metadata and what was exported (the round, its metrics and traffic).

    ``base_model`` and ``datasets`` name Hub ids only: a base or data set that
    was a local path (or the built-in one) is left out, with a warning, since a
    path of this machine means nothing on the Hub.
    """
    from data_prep.loaders import HUB_IDS
    from fedllm.assembly import assign_ranks, describe_ranks

    facts = run.facts(round_idx)
    summary = run.summary()
    kind = "merged model" if merged else "LoRA adapter"
    base_id = hub_id(cfg.model.name)
    if base_id is None:
        log.warning(
            "model card: the base %r is not a Hub id, so base_model is left out of the card", cfg.model.name
        )
    data_id = hub_id(HUB_IDS.get(cfg.data.dataset, cfg.data.dataset))
    meta: dict = {
        "base_model": base_id,
        "library_name": "transformers" if merged else "peft",
        "license": "apache-2.0",
        "datasets": [data_id] if data_id else None,
        "pipeline_tag": "text-generation",
        "tags": ["federated-learning", "lora", "fedllm", cfg.aggregation.name, cfg.client.algorithm],
    }
    meta = {k: v for k, v in meta.items() if v is not None}
    source = summary.get("benchmark")
    bench = benchmark_name(source) if source else None
    own = run.client_facts(client) if client is not None else None
    if bench and facts["accuracy"] is not None and client is None:  # a client's model was not benchmarked
        meta["model-index"] = [
            {
                "name": f"fedllm-{cfg.aggregation.name}-round-{facts['round']}",
                "results": [
                    {
                        "task": {"type": "multiple-choice", "name": "Multiple-choice question answering"},
                        "dataset": {"type": source, "name": bench},
                        "metrics": [
                            {
                                "type": "accuracy",
                                "value": round(facts["accuracy"], 4),
                                "name": f"accuracy ({cfg.eval.shots}-shot)",
                            }
                        ],
                    }
                ],
            }
        ]
    base_text = (
        f"`{base_id}`"
        if base_id
        else ("the fedllm built-in base" if cfg.model.name.startswith("builtin") else "a local base model")
    )

    def num(x, spec=".4f"):
        return "n/a" if x is None else format(x, spec)

    body = [
        f"# fedllm {cfg.aggregation.name} {kind}"
        + (f" (client {client}, personalized)" if client is not None else ""),
        "",
        f"Federated fine-tuning of {base_text} with **{cfg.aggregation.name}** aggregation and "
        f"**{cfg.client.algorithm}** clients: {cfg.federation.num_clients} clients with LoRA ranks "
        f"{describe_ranks(assign_ranks(cfg))}, exported after round **{facts['round']}** of "
        f"{cfg.federation.rounds}"
        + (f", then personalized for client {client}." if client is not None else "."),
        "",
        "| | value |",
        "|---|---|",
        f"| strategy / client algorithm | {cfg.aggregation.name} / {cfg.client.algorithm} |",
        f"| rounds (exported / configured) | {facts['round']} / {cfg.federation.rounds} |",
        f"| held-out loss (before round 1 -> round {facts['eval_round']}) | {num(facts['loss_before'])} -> "
        f"{num(facts['loss'])} |",
    ]
    if own:
        body.append(
            f"| client {client}'s own held-out accuracy (round {own['round']}): this personalized model / "
            f"the global model | **{num(own.get('personal_acc'))}** / {num(own.get('global_acc'))} |"
        )
    elif client is not None:
        body.append(f"| client {client}'s own held-out accuracy | not evaluated in this run |")
    if bench:
        body.append(
            f"| {bench} accuracy of the {'global model' if client is not None else 'model'} (before round 1 "
            f"-> round {facts['eval_round']}) | {num(facts['accuracy_before'])} -> {num(facts['accuracy'])} |"
        )
    # what a feature states of the run
    body += [f"| guarantee | {line} |" for line in summary.get("guarantees", [])]
    body += [
        f"| communication up to round {facts['round']} | up {num(facts['up_params'], ',')} params "
        f"({num(facts['up_bytes'] and facts['up_bytes'] / 1e6, '.2f')} MB), "
        f"down {num(facts['down_params'], ',')} "
        f"params ({num(facts['down_bytes'] and facts['down_bytes'] / 1e6, '.2f')} MB) |",
        "",
        "Load it with "
        + (
            "`AutoModelForCausalLM.from_pretrained(...)`."
            if merged
            else "`peft.AutoPeftModelForCausalLM.from_pretrained(...)` (or `PeftModel.from_pretrained` on "
            "the base)."
        ),
    ]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(body) + "\n"
