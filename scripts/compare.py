"""Run a built-in comparison and print its table; last line: one JSON object.

    python scripts/compare.py floral    # FLoRAL vs FedIT vs local-only on the clustered config
    python scripts/compare.py clients   # sft, fedprox, scaffold, perfedavg on a non-IID split

Each variant is one `fedllm run` of the same config and seed, so the
partition is identical; only the named override changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SUITES = {
    "floral": ("configs/builtin_clustered.yaml",
               {"floral": ["aggregation.name=floral"], "fedit": ["aggregation.name=fedit"],
                "local": ["aggregation.name=local"]}),
    "clients": ("configs/builtin_noniid_clients.yaml",
                {name: [f"client.algorithm={name}"] for name in ("sft", "fedprox", "scaffold", "perfedavg")}),
}


def main() -> None:
    suite = sys.argv[1] if len(sys.argv) > 1 else "floral"
    out_root = Path(sys.argv[2] if len(sys.argv) > 2 else f"runs/compare-{suite}")
    config, variants = SUITES[suite]
    results = {}
    for name, overrides in variants.items():
        run_dir = out_root / name
        subprocess.run([sys.executable, "-m", "fedllm.cli", "--log-level", "WARNING", "run", "--config", config,
                        "--output-dir", str(run_dir), *overrides], check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        last = rows[-1]
        summary = json.loads((run_dir / "summary.json").read_text())
        comm = summary["communication"]
        routers = {}
        if name == "floral":
            from safetensors.torch import load_file

            from fedllm.checkpoint import latest_checkpoint

            tensors = load_file(str(latest_checkpoint(run_dir) / "state.safetensors"))
            for key, t in sorted(tensors.items()):
                if key.startswith("client.") and ".router." in key:
                    cid = int(key.split(".")[1])
                    routers[cid] = [round(float(x), 3) for x in t.softmax(-1)]
        results[name] = {
            "benchmark_acc": last.get("accuracy"), "global_client_acc": last.get("global_client_acc"),
            "personal_acc": last.get("personal_acc"), "up_params": comm["total_up_params"],
            "down_params": comm["total_down_params"], "wall_s": summary["wall_s"], "routers": routers or None,
        }
        print(f"{name:10s} benchmark {last.get('accuracy'):.4f}  client-test global {last.get('global_client_acc'):.4f}"
              f"  personalized {last.get('personal_acc'):.4f}  up {comm['total_up_params']:,}"
              f"  down {comm['total_down_params']:,}" + (f"  routers {routers}" if routers else ""), flush=True)
    print(json.dumps({"suite": suite, "results": results}))


if __name__ == "__main__":
    main()
