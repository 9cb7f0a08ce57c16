"""Built-in comparisons over seeds: mean +/- std and paired 95% intervals; last line: one JSON object.

    python scripts/compare.py default  [--seeds 3] [--jobs 2]  # the default run: gain over the base
    python scripts/compare.py strategies     # fedit, flora, flexlora, florist, fedex, hetlora, fedsa, ffa
    python scripts/compare.py floral                              # FLoRAL vs FedIT vs local-only, clustered
    python scripts/compare.py clients                             # sft, fedprox, scaffold, perfedavg, non-IID
    python scripts/compare.py privacy   # FedIT, FFA-LoRA: no DP, epsilon ~8, 4, 1; FlexLoRA local DP eps 8
    python scripts/compare.py testbed-NAME --seeds 5 --jobs 2  # NAME: headroom, rank, clustered, drift,
                                                               # personal (configs/testbed_NAME.yaml)
    python scripts/compare.py server-opt --seeds 5 --jobs 2    # FedIT with FedAvgM, FedAdagrad, FedYogi,
                                                               # FedAdam on the drift instance
    python scripts/compare.py fedsvd-dp --seeds 5 --jobs 2     # FedSVD vs FFA-LoRA, central DP eps 4
    python scripts/compare.py testbed-clients --seeds 5 --jobs 2  # RoLoRA vs FedIT, FFA-LoRA at 4/16/64
    python scripts/compare.py fedsb --seeds 5 --jobs 2         # Fed-SB vs FedIT, FFA-LoRA, FLoRA per MB

Each suite is one `fedllm compare` call (the same seeds, so the same partitions, for every variant);
runs land in runs/compare-<suite>/<variant>/seed-<s> and are reused when complete.
"""

from __future__ import annotations

import argparse
import sys

from fedllm.cli import main as fedllm_main

SUITES: dict[str, tuple[str | None, list[str]]] = {
    "default": (None, ["default"]),
    "strategies": (
        "configs/builtin_fedit.yaml",
        [
            f"{s}:aggregation.name={s}"
            for s in ("fedit", "flora", "flexlora", "florist", "fedex", "hetlora", "fedsa", "ffa")
        ],
    ),
    "floral": (
        "configs/builtin_clustered.yaml",
        ["fedit:aggregation.name=fedit", "floral:aggregation.name=floral", "local:aggregation.name=local"],
    ),
    "privacy": (
        "configs/builtin_cross_device_dp.yaml",
        [
            f"{s}_{tag}:aggregation.name={s},{dp}"
            for s in ("fedit", "ffa")
            for tag, dp in (
                # no DP: the config's DP settings back to their defaults (a mode of none refuses others)
                ("nodp", "privacy.mode=none,privacy.clip_norm=1.0,privacy.noise_multiplier=1.0"),
                ("eps8", "privacy.noise_multiplier=1.5279"),  # fedllm privacy ... --target-epsilon 8
                ("eps4", "privacy.noise_multiplier=2.2068"),
                ("eps1", "privacy.noise_multiplier=5.9764"),
            )
        ]
        # what local DP costs (FLoRA, FlexLoRA and FLoRIST get local DP only): each site noises its own
        # update (fedllm privacy --mode local --clients 1000 --per-round 100 --rounds 20 --target-epsilon 8)
        + [
            "flexlora_local_eps8:aggregation.name=flexlora,privacy.mode=local,privacy.noise_multiplier=4.8244",
            # DP's clip and uniform weights without noise: what the noise costs, apart from the clip
            "fedit_clip_only:aggregation.name=fedit,privacy.noise_multiplier=0",
        ],
    ),
    # FedSVD against FFA-LoRA under central DP (pre-registered in configs/builtin_cross_device_dp.yaml)
    "fedsvd-dp": (
        "configs/builtin_cross_device_dp.yaml",
        [
            f"{s}_{tag}:aggregation.name={s},privacy.noise_multiplier={sigma},privacy.noise_seed=0"
            for tag, sigma in (("eps4", "2.2068"),)  # (epsilon 1: "5.9764", not run yet)
            for s in ("ffa", "fedsvd")
        ],
    ),
    "clients": (
        "configs/builtin_noniid_clients.yaml",
        [f"{a}:client.algorithm={a}" for a in ("sft", "fedprox", "scaffold", "perfedavg")],
    ),
    # the testbed (docs/testbed.md): each suite's first variant is its mechanism's baseline
    "testbed-headroom": (
        "configs/testbed_headroom.yaml",
        ["fedit:aggregation.name=fedit", "flexlora:aggregation.name=flexlora"],
    ),
    "testbed-rank": (
        "configs/testbed_rank.yaml",
        [f"{s}:aggregation.name={s}" for s in ("fedit", "flora", "flexlora", "florist", "fedex", "hetlora")],
    ),
    "testbed-clustered": (
        "configs/testbed_clustered.yaml",
        ["fedit:aggregation.name=fedit", "local:aggregation.name=local", "floral:aggregation.name=floral"],
    ),
    "testbed-drift": (
        "configs/testbed_drift.yaml",
        [f"{a}:client.algorithm={a}" for a in ("sft", "fedprox", "scaffold")],
    ),
    # the server optimizers (issue 55; predictions in configs/testbed_drift.yaml, written before measuring)
    "server-opt": (
        "configs/testbed_drift.yaml",
        ["fedit:aggregation.server_opt=none"]
        + [f"{o}:aggregation.server_opt={o}" for o in ("fedavgm", "fedadagrad", "fedyogi", "fedadam")],
    ),
    # Fed-SB's accuracy per MB (issue 55; predictions in configs/testbed_drift.yaml, written before measuring)
    "fedsb": (
        "configs/testbed_drift.yaml",
        [f"{s}:aggregation.name={s}" for s in ("fedit", "ffa", "flora")]
        + [f"fedsb_r{r}:aggregation.name=fedsb,lora.ranks=[{r}]" for r in (8, 32)],
    ),
    # RoLoRA as the number of clients grows (issue 55; predictions in configs/testbed_clients.yaml)
    "testbed-clients": (
        "configs/testbed_clients.yaml",
        [
            f"{s}_n{n}:aggregation.name={s},federation.num_clients={n},client.local_steps={240 // n}"
            for n in (4, 16, 64)
            for s in ("fedit", "ffa", "rolora")
        ],
    ),
    "testbed-personal": (
        "configs/testbed_personal.yaml",
        [
            "sft:client.algorithm=sft",
            "perfedavg_fo:client.algorithm=perfedavg,client.perfedavg.variant=fo",
            "perfedavg_hf:client.algorithm=perfedavg,client.perfedavg.variant=hf",
        ],
    ),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--output-dir")
    args, overrides = p.parse_known_args()
    config, variants = SUITES[args.suite]
    argv = [
        "--log-level",
        "WARNING",
        "compare",
        "--seeds",
        str(args.seeds),
        "--jobs",
        str(args.jobs),
        "--output-dir",
        args.output_dir or f"runs/compare-{args.suite}",
    ]
    argv += ["--config", config] if config else []
    for v in variants:
        argv += ["--variant", v]
    return fedllm_main(argv + overrides)


if __name__ == "__main__":
    sys.exit(main())
