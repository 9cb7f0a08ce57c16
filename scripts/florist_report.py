"""FLoRIST's kept ranks, downloads and losses beside other variants of one comparison, per round.

Reads each variant's ``metrics.jsonl`` under a ``fedllm compare`` output folder (``RUN_ROOT/<variant>/
seed-<s>/``) and prints, for each variant: the kept rank per module type (q, k, v, o, gate, up, down:
the mean over layers) and round beside the round's client rank sum and largest client rank (what FLoRA's
stacking and FlexLoRA's SVD would keep at most), the bytes downloaded over the run (``down_bytes``,
catch-ups of missed merges included), the held-out loss before and after, and the general prompts'
agreement with the base. FLoRIST's paper (tau 0.9) keeps rank 6-10 of 64; the last line is one JSON object.

    python scripts/florist_report.py runs/florist_sweep [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

TYPES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def variant_report(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rounds = []
    for r in rows:
        if "agg_kept_rank" not in r and "agg_client_rank_sum" not in r:
            continue
        by_type: dict[str, list[int]] = defaultdict(list)
        for module, k in (r.get("agg_kept_rank") or {}).items():
            kind = next((t for t in TYPES if module.endswith(t)), "other")
            by_type[kind].append(k)
        rounds.append(
            {
                "round": r["round"],
                "kept_mean": r.get("agg_kept_rank_mean"),
                "kept_by_type": {t: round(sum(v) / len(v), 1) for t, v in by_type.items()},
                "client_rank_sum": r.get("agg_client_rank_sum"),
                "client_rank_max": r.get("agg_client_rank_max"),
            }
        )
    losses = [(r["round"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    agreement = [r["general_agreement"] for r in rows if "general_agreement" in r]
    return {
        "rounds": rounds,
        "down_mb": sum(r.get("down_bytes", 0) for r in rows) / 1e6,  # catch-ups included
        "up_mb": sum(r.get("up_bytes", 0) for r in rows) / 1e6,
        "loss_before": losses[0][1] if losses else None,
        "loss_after": losses[-1][1] if losses else None,
        "agreement_after": agreement[-1] if agreement else None,
        "time_s": sum(
            v for r in rows for k, v in r.items() if k in ("time_train_s", "time_eval_s", "time_server_s")
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a fedllm compare --output-dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    found = sorted(args.root.glob(f"*/seed-{args.seed}/metrics.jsonl"))
    if not found:
        raise SystemExit(f"{args.root}: no <variant>/seed-{args.seed}/metrics.jsonl")
    report = {m.parent.parent.name: variant_report(m) for m in found}
    for name, v in report.items():
        if v["loss_before"] is None:  # a run that has evaluated nothing yet
            print(f"{name}: no held-out loss yet")
            continue
        print(
            f"{name}: loss {v['loss_before']:.4f} -> {v['loss_after']:.4f}, download {v['down_mb']:.1f} MB, "
            f"upload {v['up_mb']:.1f} MB, agreement {v['agreement_after']}"
        )
        for r in v["rounds"]:
            if r["kept_mean"] is None:
                continue
            types = " ".join(f"{t.split('_')[0]} {k}" for t, k in r["kept_by_type"].items())
            print(
                f"  round {r['round']}: kept {r['kept_mean']:.1f} ({types}); client ranks sum "
                f"{r['client_rank_sum']}, max {r['client_rank_max']}"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
