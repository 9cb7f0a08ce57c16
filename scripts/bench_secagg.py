"""What fedllm's secure aggregation costs beside Flower's SecAgg+ alone: bytes, message rounds and time of one
round, both measured in this run on the same vectors (Flower's in-process protocol, as the tests run it).

- ``flower``: Flower 1.42's mod and ``SecAggPlusWorkflow``, no checks, Flower's mask generator (its seeds
  folded to 32 bits);
- ``fedllm``: fedllm's sites (every message checked, masks from ChaCha20, parameters pinned to the config,
  the round recorded in the site's state folder) with node keys and the federation's registry (every key
  signed and checked, the round's statement signed by every site, the survivors' consistency round), and
  fedllm's ServerApp workflow at its default threshold (one colluder withstood: ``secagg.colluders=1``).

Every site starts from its cut of a full-rank global state of as many values as the vector (what a round of
FedIT sends), in both; fedllm's statement stage sends each site that state once more. ``--first-round``: a
first round's fresh starts and an empty state instead (what issue 78's measurement sent).

    python scripts/bench_secagg.py --sites 5 --values 100000 --reps 3

Bytes are the protocol records' serialized sizes (what the Grid carries), server to sites and back; a
message round is one ``send_and_receive`` of the workflow. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def record_bytes(content) -> int:
    from flwr.common.serde import recorddict_to_proto

    return len(recorddict_to_proto(content).SerializeToString())


def one_round(kind: str, cfg, vectors, federation, root: Path, state, fitins) -> dict:
    import tests.test_secagg as t
    from fedllm.secagg import prg

    counts = {"rounds": 0, "down": 0, "up": 0}
    grid_class = t.VectorGrid
    original = grid_class.send_and_receive

    def counting(self, messages, timeout=None):
        messages = list(messages)
        counts["rounds"] += 1
        counts["down"] += sum(record_bytes(m.content) for m in messages)
        replies = original(self, messages, timeout)
        counts["up"] += sum(record_bytes(r.content) for r in replies if not r.has_error())
        return replies

    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.server.workflow import SecAggPlusWorkflow

    import fedllm.secagg.flower as sf

    modules = [importlib.import_module(n) for n in prg.FLOWER_MODULES]
    saved = (sf._guard, prg.install, [m.pseudo_rand_gen for m in modules], sf.SecureExchange.workflow)
    grid_class.send_and_receive = counting
    try:
        if kind == "flower":
            sf._guard = lambda msg, context: None
            prg.install = lambda: None
            for m in modules:
                m.pseudo_rand_gen = pseudo_rand_gen

            def plain(self, max_weight, timeout, sites):  # Flower's own workflow and threshold
                parameters = self.parameters(max_weight, timeout, sites)
                parameters["reconstruction_threshold"] = float(self.o.reconstruction_threshold)
                return SecAggPlusWorkflow(**parameters)

            sf.SecureExchange.workflow = plain
            node_config, sites = None, None
        else:
            node_config = lambda n: federation.node_config(n, n - 100)  # noqa: E731
            sites = t.StateSites(root, list(vectors))
        t0 = time.perf_counter()
        c = 0 if kind == "flower" else 1
        mean, nodes, _ = t.protocol_round(
            cfg, vectors, {n: 1 for n in vectors}, node_config=node_config, sites=sites, colluders=c,
            fitins=fitins(c), global_state=state,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
    finally:
        grid_class.send_and_receive = original
        sf._guard, prg.install, sf.SecureExchange.workflow = saved[0], saved[1], saved[3]
        for m, fn in zip(modules, saved[2], strict=True):
            m.pseudo_rand_gen = fn
    plain = np.mean([vectors[n] for n in nodes], axis=0)
    return {**counts, "seconds": seconds, "max_error": float(np.abs(mean - plain).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--values", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--first-round", action="store_true", help="fresh starts, an empty global state")
    args = ap.parse_args()

    from flwr.supercore.task_identity import TaskIdentity

    import tests.test_secagg as t
    from fedllm.config import load_config
    from tests.conftest import tiny_overrides

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        setattr(TaskIdentity, name, value)
    tmp = Path(tempfile.mkdtemp(prefix="bench-secagg-"))
    cfg = load_config(
        None,
        tiny_overrides(
            tmp / "run",
            f"federation.num_clients={args.sites}",
            "federation.weighting=uniform",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
        ),
    )
    federation = t.Federation(tmp / "keys", args.sites)
    vectors = t.clipped_vectors(args.sites, args.values, seed=0)
    import copy

    import torch

    from fedllm.aggregation.base import GlobalState
    from fedllm.factors import LoraFactors
    from fedllm.flower.site import expected_start

    width = max(1, args.values // 64)  # 32 x width + width x 32 values: as many as the vector
    module = "model.layers.0.self_attn.q_proj"
    state = GlobalState({module: LoraFactors(torch.randn(32, width), torch.randn(width, 32), 1.0)})

    if args.first_round:
        state = GlobalState()

    def fitins(colluders: int) -> dict:  # each site its cut of the state, under the round's config
        mine = copy.deepcopy(cfg)
        mine.secagg.colluders = colluders
        return {n: t.start_of(mine, k, 1, expected_start(mine, state, k, 1)) for k, n in enumerate(vectors)}

    results: dict[str, list[dict]] = {"flower": [], "fedllm": []}
    for rep in range(args.reps):  # alternating, so that a slow patch of the machine hits both
        for kind in ("flower", "fedllm"):
            results[kind].append(
                one_round(kind, cfg, vectors, federation, tmp / f"state-{rep}", state, fitins)
            )
    out: dict = {"sites": args.sites, "values": args.values, "reps": args.reps}
    out["first_round"] = args.first_round
    for kind, rows in results.items():
        out[kind] = {
            "message_rounds": rows[0]["rounds"],
            "bytes_down": rows[0]["down"],
            "bytes_up": rows[0]["up"],
            "seconds_median": statistics.median(r["seconds"] for r in rows),
            "max_error": max(r["max_error"] for r in rows),
        }
    f, g = out["flower"], out["fedllm"]
    out["ratio"] = {
        "bytes": (g["bytes_down"] + g["bytes_up"]) / (f["bytes_down"] + f["bytes_up"]),
        "seconds": g["seconds_median"] / f["seconds_median"],
        "extra_message_rounds": g["message_rounds"] - f["message_rounds"],
    }
    for kind in ("flower", "fedllm"):
        r = out[kind]
        print(f"{kind:7} {r['message_rounds']} message rounds, {r['bytes_down'] / 1e6:.3f} MB down, "
              f"{r['bytes_up'] / 1e6:.3f} MB up, {r['seconds_median']:.2f} s (median of {args.reps}), "
              f"max error {r['max_error']:.2e}")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
