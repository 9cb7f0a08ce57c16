"""Fault injection: bad clients, skipped rounds, clipping, killed runs and writers, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fedllm import files
from fedllm.config import load_config
from fedllm.factors import LoraFactors
from fedllm.run import checkpoint as ckpt
from fedllm.simulation import Simulation
from tests.conftest import faulty, tiny_overrides


def run_with_hook(tmp_path, hook, *extra):
    cfg = load_config(None, tiny_overrides(tmp_path / "r", *extra))
    fed = faulty(Simulation)(cfg, tmp_path / "r", fault=hook)
    fed.setup()
    summary = fed.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return fed, summary, rows


def nan_update(r, k, u):
    if k == 1:
        key = next(iter(u.factors))
        u.factors[key] = LoraFactors(u.factors[key].A * float("nan"), u.factors[key].B, u.factors[key].scale)
    return u


def wrong_shape(r, k, u):
    if k == 2:
        key = next(iter(u.factors))
        f = u.factors[key]
        u.factors[key] = LoraFactors(f.A[:-1], f.B[:, :-1], f.scale)
    return u


def raises(r, k, u):
    if k == 0 and r == 2:
        raise RuntimeError("client crashed")
    return u


def slow(r, k, u):
    if k == 3:
        u.metrics["train_s"] = 1e6
    return u


@pytest.mark.parametrize(
    ("hook", "extra", "client", "reason"),
    [
        (nan_update, [], "1", "non-finite values"),
        (wrong_shape, [], "2", "has shape"),
        (raises, [], "0", "client crashed"),
        (slow, ["federation.client_timeout_s=100"], "3", "past federation.client_timeout_s"),
    ],
)
def test_faulty_client_is_left_out_and_counted(tmp_path, hook, extra, client, reason):
    fed, summary, rows = run_with_hook(tmp_path, hook, *extra)
    bad = [r for r in rows[1:] if r["failed"]]
    assert bad, rows
    for r in bad:
        assert client in r["failed"] and reason in r["failed"][client]
        assert r["n_updates"] == 3 and r["n_failed"] == 1 and not r["skipped"]
    assert summary["failed_client_calls"] == len(bad)
    for f in fed.server.state.factors.values():
        assert torch.isfinite(f.A).all() and torch.isfinite(f.B).all()


def test_round_below_min_clients_is_skipped_and_state_unchanged(tmp_path):
    def all_fail_round_2(r, k, u):
        if r == 2:
            raise RuntimeError("outage")
        return u

    snapshots = {}

    def record(r, k, u):
        return all_fail_round_2(r, k, u)

    cfg = load_config(None, tiny_overrides(tmp_path / "r", "federation.min_clients=2"))
    fed = faulty(Simulation)(cfg, tmp_path / "r", fault=record)
    fed.setup()
    original = fed.run_round

    def wrapped(r):
        if r == 2:
            snapshots["before"] = {k: v.A.clone() for k, v in fed.server.state.factors.items()}
        out = original(r)
        if r == 2:
            snapshots["after"] = {k: v.A.clone() for k, v in fed.server.state.factors.items()}
        return out

    fed.run_round = wrapped
    fed.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[2]["skipped"] and rows[2]["n_updates"] == 0 and rows[2]["n_failed"] == 4
    for k in snapshots["before"]:
        assert torch.equal(snapshots["before"][k], snapshots["after"][k])


def test_clipping_in_a_run(tmp_path):
    def hostile(r, k, u):
        if k == 0:
            u.factors = {key: LoraFactors(f.A * 50, f.B * 50 + 1.0, f.scale) for key, f in u.factors.items()}
        return u

    _, _, rows = run_with_hook(tmp_path, hostile, "aggregation.clip_norm_ratio=1.5")
    assert all(r["agg_clipped"] >= 1 for r in rows[1:])
    # with no clip nothing is clipped, and the row still says what a clip would have cut: a count of 0 that
    # could have been more (the hostile update is far beyond 1.5 x the round's median change)
    _, _, rows = run_with_hook(tmp_path / "off", hostile, "aggregation.clip_norm_ratio=0")
    assert all(r["agg_clipped"] == 0 and r["agg_update_norm_ratio_max"] > 10 for r in rows[1:])


def test_no_statistic_of_one_update_is_written_under_differential_privacy():
    """The rows of a DP run carry no per-update norm (it is what the noise hides); a plain run's do."""
    from fedllm.assembly import server_policy

    assert server_policy(load_config(None, [])).norm_stats
    for mode in ("central", "local"):
        assert not server_policy(load_config(None, [f"privacy.mode={mode}"])).norm_stats


def test_checkpoint_writer_failure_keeps_previous(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 1, {"x": torch.ones(2)}, {"round": 1})

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "save_file", boom)  # the atomic writer under the checkpoint
    with pytest.raises(
        files.CheckpointError, match=r"could not write checkpoint .*round-0002: No space left"
    ):
        ckpt.save_checkpoint(tmp_path, 2, {"x": torch.zeros(2)}, {"round": 2})
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "round-0001"
    tensors, meta = ckpt.load_checkpoint(latest)
    assert torch.equal(tensors["x"], torch.ones(2)) and meta["round"] == 1
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".round")]


def test_incompatible_checkpoint_is_reported(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, {"x": torch.ones(1)}, {"round": 1})
    meta = json.loads((path / "meta.json").read_text())
    meta["format"] = 99
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(files.CheckpointError, match="format 99 was written by another fedllm version"):
        ckpt.load_checkpoint(path)


def test_torn_metrics_line_is_ignored(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"round": 0}\n{"round": 1}\n{"rou')
    assert [r["round"] for r in files.read_jsonl(p)] == [0, 1]


def fedllm_cmd(*args):
    return [sys.executable, "-m", "fedllm.cli", "--log-level", "WARNING", *args]


@pytest.mark.slow
def test_sigkill_mid_round_then_resume_matches_uninterrupted(tmp_path):
    from safetensors.torch import load_file

    extra = ["federation.rounds=4", "client.local_steps=30", "eval.limit=1"]
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(
        fedllm_cmd("run", *tiny_overrides(ref_dir, *extra)),
        check=True,
        env=env,
        timeout=600,
        capture_output=True,
    )
    proc = subprocess.Popen(
        fedllm_cmd("run", *tiny_overrides(killed_dir, *extra)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = killed_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:  # wait until round 2 is done, then kill inside round 3
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / "summary.json").exists()  # it really died before finishing
    done = len(files.read_jsonl(metrics))
    assert done < 5
    out = subprocess.run(
        fedllm_cmd("run", "--resume", str(killed_dir)), env=env, timeout=600, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = files.read_jsonl(metrics)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    a = load_file(ref_dir / "global_adapter" / "adapter_model.safetensors")
    b = load_file(killed_dir / "global_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fifty_rounds_with_one_in_five_client_calls_failing(tmp_path):
    import random

    rng = random.Random(0)

    def flaky(r, k, u):
        if rng.random() < 0.2:
            raise RuntimeError("random client failure")
        return u

    _, summary, rows = run_with_hook(
        tmp_path, flaky, "federation.rounds=50", "eval.every=10", "federation.min_clients=1"
    )
    assert [r["round"] for r in rows] == list(range(51))  # no lost rounds
    failed = sum(r["n_failed"] for r in rows[1:])
    assert 0.1 < failed / (50 * 4) < 0.3
    assert summary["failed_client_calls"] == failed
    assert all(r["n_updates"] + r["n_failed"] == 4 for r in rows[1:])
