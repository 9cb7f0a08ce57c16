"""Where a run's global update keeps its energy: raFLoRA's "rank collapse" check on a finished run.

raFLoRA (2026) names rank collapse in SVD-based heterogeneous aggregation: the global update's energy gathers
in the smallest shared rank over the rounds, because each client starts a round from the global update cut to
its own rank and only the high-rank clients carry the directions beyond the low ranks into the next average.
This reads the global model (its global adapter plus what was merged into the base) that each kept
checkpoint of a run holds (``RUN/checkpoints/round-*``) and reports, per round, the share of the update's
energy (squared singular values of ``scale * B @ A``, from the factors without forming the matrix) in its
top k directions for each k, and the rank that holds 90 % of it, as mean +/- std over the adapted modules.
A share that grows round on round at small k is the collapse.

    python scripts/rank_energy.py runs/which_method_smollm2/{fedit,flexlora,florist}/seed-0

Last line: one JSON object ({run: {round: {"top_k": {k: mean}, "rank90": mean, "modules": n}}}).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedllm.factors import DenseDelta, LoraFactors, energy_rank, low_rank_svd

TOP = (4, 8, 16, 32, 64)


def energy_shares(s: torch.Tensor, top: tuple[int, ...] = TOP) -> dict[int, float]:
    """The share of ``sum(s**2)`` in the ``k`` largest singular values, for each ``k`` (1.0 past the rank)."""
    e = torch.sort(s.double() ** 2, descending=True).values
    total = float(e.sum())
    if total == 0.0:
        return {k: float("nan") for k in top}
    cum = torch.cumsum(e, 0) / total
    return {k: float(cum[min(k, len(e)) - 1]) for k in top}


def spectrum(f: LoraFactors | DenseDelta) -> torch.Tensor:
    """The singular values of one module's update, whatever form the checkpoint keeps it in."""
    if isinstance(f, DenseDelta):
        return torch.linalg.svdvals(f.D.double() * f.scale)
    return low_rank_svd(LoraFactors(f.A.double(), f.B.double(), f.scale))[1]


def round_energy(adapter: dict[str, LoraFactors | DenseDelta], top: tuple[int, ...] = TOP) -> dict:
    """Mean +/- std over the modules with a nonzero update: top-k shares and the 90 % rank."""
    shares: dict[int, list[float]] = {k: [] for k in top}
    ranks: list[int] = []
    for f in adapter.values():
        s = spectrum(f)
        if float((s**2).sum()) == 0.0:
            continue
        for k, v in energy_shares(s, top).items():
            shares[k].append(v)
        ranks.append(energy_rank(s, 0.9))  # FLoRIST's own threshold rule (s sorted, as SVDs return it)

    def sd(xs: list[float]) -> float:
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    return {
        "modules": len(ranks),
        "top_k": {str(k): statistics.fmean(v) for k, v in shares.items() if v},
        "top_k_std": {str(k): sd(v) for k, v in shares.items() if v},
        "rank90": statistics.fmean(ranks) if ranks else None,
        "rank90_std": sd([float(r) for r in ranks]) if ranks else None,
    }


def run_energy(run: Path, top: tuple[int, ...] = TOP) -> dict[int, dict]:
    """Each kept checkpoint's global model of ``run``, by round: the run's strategy says what its global
    adapter is (Fed-SB's ``B @ R``, FLoRAL's uniform mixture), plus everything merged into the base
    (FLoRA, FedEx-LoRA, FLoRIST), as ``fedllm export`` reads it."""
    from fedllm.run.reader import RunFolder

    folder = RunFolder(run)
    rounds = folder.kept_rounds()
    if not rounds:
        raise SystemExit(f"{run}/checkpoints holds no round-* folder: nothing to read (kept runs drop them)")
    return {r: round_energy(folder.global_model(r)[0], top) for r in rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished or running run folders with checkpoints")
    ap.add_argument("--top", type=int, nargs="+", default=list(TOP), help="the k of the top-k shares")
    args = ap.parse_args(argv)
    top = tuple(sorted(set(args.top)))
    result = {}
    for run in args.runs:
        by_round = run_energy(run, top)
        result[str(run)] = {str(r): v for r, v in by_round.items()}
        for r, v in by_round.items():
            cells = "  ".join(f"top{k} {v['top_k'].get(str(k), float('nan')):.3f}" for k in top)
            rank = "n/a" if v["rank90"] is None else f"{v['rank90']:.1f} +/- {v['rank90_std']:.1f}"
            print(f"{run}  round {r}: {cells}  rank(90%) {rank}  ({v['modules']} modules)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
