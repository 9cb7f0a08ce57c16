"""How far apart ShareGPT's clients are: the split by each chat's kind (read from its content, today's)
against the split by the first word of the first request (the one used before), both Dirichlet(alpha) over
their labels, measured in both vocabularies, over several seeds; and whether any held-out conversation has a
part of its chat in training, under today's split and under the old per-record draw.

    python scripts/sharegpt_clients.py --config configs/compare_sharegpt_smollm2.yaml --seeds 5

Per split and seed: the mean Jensen-Shannon divergence (base 2, 0 to 1) between every two clients'
distributions, and the mean total variation of each client from the pool, over content kinds and over first
words; mean +/- std over the seeds. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def distribution(labels: list[str], vocab: list[str]) -> np.ndarray:
    counts = Counter(labels)
    p = np.array([counts[v] for v in vocab], dtype=float)
    return p / max(p.sum(), 1.0)


def jsd(p: np.ndarray, q: np.ndarray) -> float:
    m = (p + q) / 2

    def kl(a: np.ndarray, b: np.ndarray) -> float:
        mask = a > 0
        return float((a[mask] * np.log2(a[mask] / b[mask])).sum())

    return (kl(p, m) + kl(q, m)) / 2


def spread(clients: list[list[str]]) -> dict[str, float]:
    """Mean pairwise JSD and mean total variation from the pool of the clients' label lists."""
    vocab = sorted({x for c in clients for x in c})
    dists = [distribution(c, vocab) for c in clients if c]
    pool = distribution([x for c in clients for x in c], vocab)
    return {
        "jsd": statistics.fmean(jsd(a, b) for a, b in itertools.combinations(dists, 2)),
        "tv": statistics.fmean(0.5 * float(np.abs(d - pool).sum()) for d in dists),
        "other_share": statistics.fmean(c.count("other") / len(c) for c in clients if c),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/compare_sharegpt_smollm2.yaml")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()

    from data_prep.partition import categories_of
    from fedllm.config import load_config
    from fedllm.federation_data import load_partitions
    from fedllm.protocol import derive_seed

    out: dict = {"config": args.config, "seeds": args.seeds, "splits": {}}
    rows: dict[str, list[dict]] = {"content kinds": [], "first word": []}
    leaks_old = []
    for seed in range(args.seeds):
        cfg = load_config(args.config, [f"federation.seed={seed}"])
        parts = load_partitions(cfg)
        pool = [e for c in parts.clients for e in c]
        words = dict(
            zip(
                map(id, pool),
                categories_of([dataclasses.replace(e, category=None) for e in pool]),
                strict=True,
            )
        )
        held = {e.group for e in parts.eval_examples}
        assert not held & {e.group for e in pool}, "a held-out chat has a part in training"
        kinds_split = [[e.category for e in c] for c in parts.clients]
        words_split = [[words[id(e)] for e in c] for c in parts.clients]
        # the old split: the same examples partitioned by their first words instead
        old_cfg = load_config(args.config, [f"federation.seed={seed}"])
        from data_prep.partition import partition

        flat = [dataclasses.replace(e, category=None) for e in pool]
        d = old_cfg.data
        old = partition(
            flat,
            "dirichlet",
            cfg.federation.num_clients,
            seed,
            d.dirichlet_alpha,
            2,
            d.min_examples_per_client,
        )
        old_kinds = [[pool[i].category for i in p] for p in old]
        old_words = [[words[id(pool[i])] for i in p] for p in old]
        rows["content kinds"].append({"kinds": spread(kinds_split), "words": spread(words_split)})
        rows["first word"].append({"kinds": spread(old_kinds), "words": spread(old_words)})
        # the old per-record held-out draw (32 records) on the same sample
        everything = parts.eval_examples + pool
        order = list(range(len(everything)))
        random.Random(derive_seed(seed, 3)).shuffle(order)
        heldout = [everything[i] for i in order[:32]]
        trained = {everything[i].group for i in order[32:]}
        leaks_old.append(sum(e.group in trained for e in heldout))
    for name, per_seed in rows.items():
        summary = {}
        for vocab in ("kinds", "words"):
            for metric in ("jsd", "tv", "other_share"):
                vals = [r[vocab][metric] for r in per_seed]
                summary[f"{metric} over {vocab}"] = {
                    "mean": statistics.fmean(vals),
                    "std": statistics.stdev(vals),
                }
        out["splits"][name] = summary
        print(name)
        for k, v in summary.items():
            print(f"  {k:24} {v['mean']:.3f} +/- {v['std']:.3f}")
    out["old_heldout_leaks_of_32"] = leaks_old
    print(
        "held-out chats with a part in training: 0 under today's split; the old per-record draw of 32: "
        + str(leaks_old)
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
