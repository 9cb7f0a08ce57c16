"""Flower: the Simulation Engine gives the in-process simulation's model, with the same run directory."""

from __future__ import annotations

import json

import pytest
import torch

from fedllm.config import load_config
from fedllm.simulation import Simulation
from tests.conftest import assert_close_updates, tiny_overrides

pytest.importorskip("flwr")
pytest.importorskip("ray")


@pytest.fixture(autouse=True)
def quiet_flower(monkeypatch):
    for key, value in {
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }.items():
        monkeypatch.setenv(key, value)


def files(run_dir) -> list[str]:
    """The run folder's files, less the simulated clients' state (``clients/``): real sites keep their own."""
    return sorted(
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if p.is_file() and ".lock" not in p.name and p.relative_to(run_dir).parts[0] != "clients"
    )


# FedIT, FlexLoRA and FLoRIST in the default run; FLoRA (merges on the sites), FLoRAL (routers on the sites)
# and the stateful client algorithms (SCAFFOLD's c_k, Per-FedAvg) under -m slow
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "strategy,more",
    [
        pytest.param("fedit", [], marks=SLOW, id="fedit"),  # ~30 s on 2 cores: every engine run is slow
        pytest.param("flexlora", [], marks=SLOW, id="flexlora"),
        pytest.param("florist", [], marks=SLOW, id="florist"),
        pytest.param("flora", [], marks=SLOW, id="flora"),
        pytest.param("floral", ["lora.ranks=[4]"], marks=SLOW, id="floral"),
        pytest.param("fedex", [], marks=SLOW, id="fedex"),
        pytest.param("hetlora", [], marks=SLOW, id="hetlora"),
        pytest.param("fedit", ["client.algorithm=scaffold"], marks=SLOW, id="fedit-scaffold"),
        pytest.param("fedit", ["client.algorithm=perfedavg"], marks=SLOW, id="fedit-perfedavg"),
        pytest.param("fedsa", [], marks=SLOW, id="fedsa"),
        pytest.param("ffa", [], marks=SLOW, id="ffa"),
        # the baselines: Fed-SB (round 1 its initialization's dense steps, then R in the extras), FedSVD (A
        # re-factored by the server), RoLoRA (the factor alternates), a server optimizer (its moments)
        pytest.param("fedsb", [], marks=SLOW, id="fedsb"),
        pytest.param("fedsvd", [], marks=SLOW, id="fedsvd"),
        pytest.param("rolora", [], marks=SLOW, id="rolora"),
        pytest.param("fedit", ["aggregation.server_opt=fedadam"], marks=SLOW, id="fedit-fedadam"),
        pytest.param(
            "fedsb",
            ["privacy.mode=central", "privacy.noise_seed=0", "privacy.clip_norm=0.5"],
            marks=SLOW,
            id="fedsb-dp-central",
        ),
        # DP with reproducible noise: the sites clip (ClientApp), the server adds the same noise (ServerApp)
        pytest.param(
            "ffa",
            [
                "privacy.mode=central",
                "privacy.noise_seed=0",
                "privacy.clip_norm=0.5",
                "federation.clients_per_round=2",
            ],
            marks=SLOW,
            id="ffa-dp-central",
        ),
        pytest.param(
            "flexlora",
            ["privacy.mode=local", "privacy.noise_seed=0", "privacy.noise_multiplier=0.5"],
            marks=SLOW,
            id="flexlora-dp-local",
        ),
    ],
)
def test_simulation_engine_equals_in_process_simulation(tmp_path, strategy, more, builtin_base):
    from tests.flower_grid import run_on_simulation_engine

    extra = [f"aggregation.name={strategy}", "eval.limit=2", "federation.seed=3", *more]
    # one clip on both sides: auto settles 0 where one job runs every client and 2 across organizations, and
    # Per-FedAvg's unclipped SGD steps give updates the clip at 2x the round's median does cut
    extra.append("aggregation.clip_norm_ratio=2")
    extra.append("flower.share_token_modules=true")  # the tiny base shares its embeddings (accepted here)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # every process computes as each Ray worker does (1 CPU each): the same float kernels
    try:
        reference = Simulation(load_config(None, tiny_overrides(tmp_path / "sim", *extra)), tmp_path / "sim")
        reference.setup()
        ref = reference.run()
        cfg = load_config(None, tiny_overrides(tmp_path / "flower", *extra))
        run_on_simulation_engine(cfg, tmp_path / "flower")
    finally:
        torch.set_num_threads(threads)
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert files(tmp_path / "flower") == files(tmp_path / "sim")  # the same run directory
    assert_close_updates(tmp_path / "sim", tmp_path / "flower", 1e-4)  # delta W of every module
    assert summary["loss_after"] == pytest.approx(ref["loss_after"], rel=1e-4)
    assert summary["communication"]["total_up_params"] == ref["communication"]["total_up_params"]
    assert summary["communication"]["total_down_params"] == ref["communication"]["total_down_params"]
    rows = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and all(
        r["n_updates"] == r["n_sampled"]
        for r in rows[1:]  # (a secret sample's rows name no client)
    )
    assert "personal_acc" in rows[-1]  # personalized evaluation ran on the sites
