"""The run directory's integrity, through the CLI as a user meets it: export, reuse, resume, checkpoints,
locks.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fedllm import files
from fedllm.cli import main
from fedllm.run import checkpoint as ckpt
from tests.conftest import tiny_overrides

FAST = ("eval.personalized=false", "eval.limit=1")


def cli(capsys, *argv) -> tuple[int, str]:
    """Run ``fedllm`` in-process; returns (exit code, stderr)."""
    try:
        code = main(["--log-level", "WARNING", *argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def new_run(capsys, run_dir: Path, *extra: str) -> int:
    overrides = [o for o in tiny_overrides(run_dir, *FAST, *extra) if not o.startswith("output.dir")]
    code, err = cli(capsys, "run", "--output-dir", str(run_dir), *overrides)
    assert code in (0, 1), err
    return code


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, builtin_base):
    """A finished 2-round run; tests copy it before changing anything."""
    run_dir = tmp_path_factory.mktemp("runs") / "done"
    overrides = [o for o in tiny_overrides(run_dir, *FAST) if not o.startswith("output.dir")]
    assert main(["--log-level", "WARNING", "run", "--output-dir", str(run_dir), *overrides]) == 0
    return run_dir


@pytest.fixture
def run_copy(done_run, tmp_path):
    shutil.copytree(done_run, tmp_path / "run")
    return tmp_path / "run"


def listing(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


def rounds_in(run_dir: Path) -> list[int]:
    return [r["round"] for r in files.read_jsonl(run_dir / "metrics.jsonl")]


# 1. export never deletes what it did not write
def test_export_refuses_the_run_itself_and_non_empty_folders(run_copy, tmp_path, capsys):
    before = listing(run_copy)
    code, err = cli(capsys, "export", str(run_copy), "--output", str(run_copy))
    assert code == 2 and "would replace the run directory" in err and listing(run_copy) == before
    code, err = cli(capsys, "export", str(run_copy), "--output", str(run_copy.parent), "--overwrite")
    assert code == 2 and "would replace the run directory" in err  # an ancestor holds the run
    code, err = cli(capsys, "export", str(run_copy), "--output", str(run_copy / "checkpoints"), "--overwrite")
    assert code == 2 and "inside the run's own files (checkpoints)" in err and listing(run_copy) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = cli(capsys, "export", str(run_copy), "--output", str(mine))
    assert (
        code == 2
        and "is not empty: pass --overwrite" in err
        and (mine / "notes.txt").read_text() == "keep me"
    )
    assert cli(capsys, "export", str(run_copy), "--output", str(mine), "--overwrite")[0] == 0
    names = {p.name for p in mine.iterdir()}
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "notes.txt" not in names  # the old content replaced, not merged
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export-")]  # no temporary left beside it


# 2. a run directory belongs to one run
def test_reused_output_dir_is_refused_continued_or_overwritten(run_copy, tmp_path, capsys):
    overrides = [o for o in tiny_overrides(run_copy, *FAST) if not o.startswith("output.dir")]
    before = listing(run_copy)
    code, err = cli(capsys, "run", "--output-dir", str(run_copy), *overrides, "federation.seed=7")
    assert code == 2 and "already holds another run" in err and "federation.seed: 0 there, 7 now" in err
    assert listing(run_copy) == before
    code, err = cli(capsys, "run", "--output-dir", str(run_copy), *overrides)  # the same config: finished
    assert code == 0 and "nothing to do" in err and listing(run_copy) == before
    code, err = cli(
        capsys, "run", "--output-dir", str(run_copy), *overrides, "federation.seed=7", "--overwrite"
    )
    assert code == 0, err
    assert rounds_in(run_copy) == [0, 1, 2]  # the old rows are gone, not mixed in
    assert "seed: 7" in (run_copy / "config.yaml").read_text()
    assert [p.name for p in files.round_checkpoints(run_copy)] == ["round-0001", "round-0002"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("a,b\n")
    code, err = cli(capsys, "run", "--output-dir", str(foreign), *overrides, "--overwrite")
    assert code == 2 and "holds no fedllm run" in err and (foreign / "data.csv").exists()


HOLD_LOCK = """
import sys, time
from fedllm.run.folder import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_process_is_refused_while_the_first_lives(run_copy, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_copy)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3")
        assert code == 2 and f"in use by another fedllm process (pid {holder.pid}" in err
    finally:
        holder.kill()  # SIGKILL: no release, the lock file stays behind
        holder.wait()
    assert (run_copy / ".lock").exists()
    # its process is gone: the lock is stale and taken over; the resume runs and releases it
    code, err = cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3")
    assert code == 0, err
    assert rounds_in(run_copy) == [0, 1, 2, 3] and not (run_copy / ".lock").exists()


RACE = """
import json, sys, time
from fedllm.run.folder import RunDirError, RunLock
folder, at = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, at - time.time()))
try:
    RunLock(folder).acquire()
except RunDirError:
    print("refused", flush=True)
    sys.exit(0)
print("held", flush=True)
time.sleep(3)
"""


@pytest.mark.parametrize(
    "stale",
    [pytest.param(False, marks=pytest.mark.slow)] * 2 + [pytest.param(True, marks=pytest.mark.slow)],
    ids=["fresh", "fresh-again", "stale"],
)
def test_processes_starting_at_the_same_instant_hold_the_lock_once(tmp_path, stale):
    """Many processes take the lock at the same instant (with or without a stale lock left by a dead process):
    exactly one holds it, every other is refused."""
    folder = tmp_path / "run"
    folder.mkdir()
    if stale:  # the lock of a process that was SIGKILLed
        dead = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True
        )
        assert dead.stdout.readline().strip() == "held"
        dead.kill()
        dead.wait()
    at = time.time() + 4.0  # every racer is started and waiting by then
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(folder), str(at)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(12)
    ]
    outcomes = [r.communicate(timeout=120)[0].strip() for r in racers]
    assert all(r.returncode == 0 for r in racers)
    assert sorted(outcomes) == ["held"] + ["refused"] * 11


# 3. a resume takes only the changes that keep the trajectory
@pytest.mark.parametrize(
    "change",
    [
        "federation.num_clients=8",
        "lora.ranks=[2]",
        "lora.target_modules=[q_proj]",
        "federation.seed=3",
        "client.algorithm=fedprox",
        "lora.trainable_modules=[]",
        "data.dirichlet_alpha=0.1",
    ],
)
def test_resume_with_a_changed_config_is_refused_naming_the_key(run_copy, capsys, change):
    before = (run_copy / "config.yaml").read_text()
    code, err = cli(capsys, "run", "--resume", str(run_copy), change, "federation.rounds=3")
    assert code == 2 and f"{change.split('=')[0]}:" in err and "cannot continue" in err
    assert (run_copy / "config.yaml").read_text() == before


def test_resume_with_more_rounds_is_recorded(run_copy, capsys):
    code, err = cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3", "eval.limit=2")
    assert code == 0, err
    assert "rounds: 3" in (run_copy / "config.yaml").read_text()
    assert rounds_in(run_copy) == [0, 1, 2, 3]
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["rounds"] == 3
    code, err = cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=2")
    assert code == 2 and "federation.rounds: 3 -> 2" in err  # fewer rounds than done


def test_a_resume_killed_after_its_last_checkpoint_is_not_reported_finished(run_copy, capsys, monkeypatch):
    """A resume that adds a round and dies after that round's checkpoint, before its summary: the next
    --resume finishes it (summary and global adapter of round 3) instead of saying 'nothing to do'."""
    from fedllm.run.folder import RunWriter

    def killed(self, summary, write_adapter):
        raise KeyboardInterrupt  # as a SIGINT right after the last checkpoint

    monkeypatch.setattr(RunWriter, "finish", killed)
    code = main(
        ["--log-level", "WARNING", "run", "--resume", str(run_copy), "federation.rounds=3", "eval.limit=2"]
    )
    assert code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"fedllm: interrupted; round 3 is checkpointed in {run_copy}: continue with "
        f"`fedllm run --resume {run_copy}`"
    )
    monkeypatch.undo()
    assert json.loads((run_copy / "summary.json").read_text())["rounds_done"] == 2  # the old summary
    assert (run_copy / "checkpoints" / "round-0003").exists()
    code, err = cli(capsys, "run", "--resume", str(run_copy))
    assert code == 0, err
    assert "nothing to do" not in err
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["rounds_done"] == 3 and summary["rounds"] == 3
    code, err = cli(capsys, "run", "--resume", str(run_copy))
    assert code == 0 and "nothing to do" in err  # now it has finished


def test_a_resume_that_finishes_a_checkpointed_round_counts_its_evaluation_in_the_wall_time(
    run_copy, capsys, monkeypatch
):
    """Killed while evaluating round 3 (after its checkpoint): the resume evaluates round 3 again, and that
    time is the run's too. (It was lost once: the clock restarted after the resumed evaluation.)"""
    from fedllm.round_loop import RoundLoop

    real = RoundLoop.evaluate_and_log

    def killed(self, row, visit):
        raise KeyboardInterrupt  # as a SIGINT during round 3's evaluation

    monkeypatch.setattr(RoundLoop, "evaluate_and_log", killed)
    assert cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3")[0] == 130
    checkpointed = json.loads((run_copy / "checkpoints" / "round-0003" / "meta.json").read_text())["wall_s"]

    evaluated: list[int] = []

    def slow(self, row, visit):
        evaluated.append(row["round"])
        time.sleep(1.0)  # an evaluation that takes at least a second
        real(self, row, visit)

    monkeypatch.setattr(RoundLoop, "evaluate_and_log", slow)
    t0 = time.perf_counter()
    code, err = cli(capsys, "run", "--resume", str(run_copy))
    attempt = time.perf_counter() - t0
    assert code == 0, err
    assert evaluated == [3]  # the pending row's evaluation, done again by the resume
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["rounds_done"] == 3
    assert checkpointed + 1.0 <= summary["wall_s"] <= checkpointed + attempt  # counted once, not lost


# 4. checkpoints carry a checksum; a damaged newest one falls back to the previous intact one
def test_damaged_checkpoint_falls_back_to_the_previous_one(run_copy, capsys, caplog):
    latest = run_copy / "checkpoints" / "round-0002" / "state.safetensors"
    data = bytearray(latest.read_bytes())
    data[-4096:] = os.urandom(4096)  # tensor bytes changed, header intact
    latest.write_bytes(bytes(data))
    code, err = cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3")
    assert code == 0, err
    assert f"{latest} does not match the checksum" in caplog.text and "round-0001" in caplog.text
    assert rounds_in(run_copy) == [0, 1, 2, 3]  # round 2 was trained again from round 1's checkpoint
    tensors, _ = ckpt.load_checkpoint(run_copy / "checkpoints" / "round-0003")
    assert all(torch.isfinite(t).all() for t in tensors.values())


@pytest.mark.parametrize("damage", ["truncated", "empty", "random", "meta"])
def test_no_intact_checkpoint_is_refused_naming_the_file(run_copy, capsys, damage):
    for d in files.round_checkpoints(run_copy):
        state, meta = d / "state.safetensors", d / "meta.json"
        if damage == "truncated":
            state.write_bytes(state.read_bytes()[:100])
        elif damage == "empty":
            state.write_bytes(b"")
        elif damage == "random":
            state.write_bytes(os.urandom(2000))
        else:
            meta.write_text("\x00garbage")
    code, err = cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3")
    assert code == 2 and "no intact checkpoint" in err and "round-0002" in err
    assert ("meta.json is not readable JSON" if damage == "meta" else "state.safetensors") in err
    assert "Traceback" not in err


# 5. a full disk is one line naming the path; nothing half-written is left
def test_real_disk_full(tmp_path, capsys, builtin_base):
    """On a 96 KB tmpfs the first checkpoint does not fit (needs root to mount; the next test covers the
    rest).
    """
    small = tmp_path / "small"
    small.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(small)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        overrides = [o for o in tiny_overrides(small / "r", *FAST) if not o.startswith("output.dir")]
        code, err = cli(capsys, "run", "--output-dir", str(small / "r"), *overrides)
        leftovers = [p for p in (small / "r").rglob(".*")]
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert code in (1, 2) and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("fedllm: error:")]
    assert len(errors) == 1 and errors[0].endswith("round-0001: No space left on device"), err
    assert not leftovers, leftovers  # no temporary file or folder, and the lock released


def test_disk_full_message(tmp_path, capsys, builtin_base, monkeypatch):
    from safetensors import SafetensorError

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(files, "save_file", full)  # the atomic writer under the checkpoint
    overrides = [o for o in tiny_overrides(tmp_path / "r", *FAST) if not o.startswith("output.dir")]
    code, err = cli(capsys, "run", "--output-dir", str(tmp_path / "r"), *overrides)
    assert code == 2
    assert (
        f"could not write checkpoint {tmp_path / 'r' / 'checkpoints' / 'round-0001'}: No space left on device"
        in err
        and "Traceback" not in err
    )
    assert not [p for p in (tmp_path / "r").rglob(".*")]  # no temporary file or folder, no lock


# 6. pruning orders by round number, not by name
def test_pruning_keeps_the_newest_rounds_by_number(tmp_path):
    for r in (9998, 9999, 10000, 10001):
        ckpt.save_checkpoint(tmp_path, r, {"x": torch.full((2,), float(r))}, {"round": r})
        ckpt.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in files.round_checkpoints(tmp_path)] == ["round-10000", "round-10001"]
    _, tensors, meta = ckpt.load_latest(tmp_path)
    assert meta["round"] == 10001 and tensors["x"][0] == 10001


def test_keep_checkpoints_is_an_option(tmp_path, capsys, builtin_base):
    new_run(capsys, tmp_path / "r", "federation.rounds=3", "output.keep_checkpoints=0")
    assert [p.name for p in files.round_checkpoints(tmp_path / "r")] == [
        "round-0001",
        "round-0002",
        "round-0003",
    ]
    code, err = cli(capsys, "export", str(tmp_path / "r"), "--round", "1", "--output", str(tmp_path / "e1"))
    assert code == 0, err


# 7 and 9. a run killed in round 1 resumes without a second round-0 row; temporaries are cleaned
def test_interrupted_in_round_one_resumes_cleanly(tmp_path, capsys, monkeypatch, builtin_base):
    from fedllm.simulation import Simulation

    real = Simulation.run_round

    def killed(self, r):
        if r == 1:
            raise KeyboardInterrupt  # as a kill in round 1: no checkpoint yet
        return real(self, r)

    monkeypatch.setattr(Simulation, "run_round", killed)
    overrides = [o for o in tiny_overrides(tmp_path / "r", *FAST) if not o.startswith("output.dir")]
    assert main(["--log-level", "WARNING", "run", "--output-dir", str(tmp_path / "r"), *overrides]) == 130
    assert "no round was checkpointed yet" in capsys.readouterr().err
    assert rounds_in(tmp_path / "r") == [0] and not (tmp_path / "r" / ".lock").exists()
    (tmp_path / "r" / "checkpoints").mkdir()
    stale = [tmp_path / "r" / ".metrics.jsonl.x1.tmp", tmp_path / "r" / "checkpoints" / ".round-0001.abc"]
    stale[0].write_text("half")
    stale[1].mkdir()
    monkeypatch.setattr(Simulation, "run_round", real)
    code, err = cli(capsys, "run", "--resume", str(tmp_path / "r"))
    assert code == 0, err
    assert rounds_in(tmp_path / "r") == [0, 1, 2]
    assert not any(p.exists() for p in stale)


def test_eval_of_a_run_leaves_no_temporary_copy(done_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code, err = cli(capsys, "eval", "--run", str(done_run), "--limit", "1")
    assert code == 0, err
    assert list(tmp_path.iterdir()) == []


# 8. a run in which nothing trained does not look successful; a slow client is stopped
def test_run_where_every_round_was_skipped_fails(tmp_path, capsys, builtin_base):
    code = new_run(capsys, tmp_path / "r", "federation.client_timeout_s=0.000001")
    err = capsys.readouterr().err
    assert code == 1
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["global_adapter"] is None and not (tmp_path / "r" / "global_adapter").exists()
    code, err = cli(capsys, "export", str(tmp_path / "r"))
    assert code == 2 and "no global update" in err and "every round so far was skipped" in err


def test_client_past_its_time_budget_is_stopped_between_steps(tmp_path, capsys, monkeypatch, builtin_base):
    from fedllm.client.sft import SFT

    real = SFT.local_step

    def slow(self, *a, **k):
        time.sleep(0.25)
        return real(self, *a, **k)

    monkeypatch.setattr(SFT, "local_step", slow)
    t0 = time.perf_counter()
    new_run(
        capsys,
        tmp_path / "r",
        "federation.rounds=1",
        "client.local_steps=40",
        "federation.client_timeout_s=0.5",
        "federation.num_clients=2",
        "data.min_examples_per_client=4",
    )
    elapsed = time.perf_counter() - t0
    row = files.read_jsonl(tmp_path / "r" / "metrics.jsonl")[1]
    assert row["n_failed"] == 2
    assert all("stopped after" in why and "of 40 steps" in why for why in row["failed"].values())
    assert elapsed < 0.5 * 2 * 40 * 0.25  # far less than the clients' full 2 x 40 slow steps


# 10. late tracebacks become one line before the model loads; files honour the umask; round 0; wall time
def test_bad_output_dirs_are_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = cli(capsys, "run", "--output-dir", str(afile))
    assert code == 2 and f"--output-dir {afile} is a file" in err
    code, err = cli(capsys, "run", "--output-dir", str(afile / "sub"))
    assert code == 2 and "is a file, so the folder cannot be created" in err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, err = cli(capsys, "run", "--output-dir", str(locked / "run"))
        assert code == 2 and "is not writable (permission denied)" in err


def test_files_honour_the_umask(tmp_path, capsys, builtin_base):
    old = os.umask(0o027)
    try:
        new_run(capsys, tmp_path / "r", "federation.rounds=1")
    finally:
        os.umask(old)
    for p in (tmp_path / "r").rglob("*"):
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o750 if p.is_dir() else 0o640), (p, oct(mode))


def test_export_round_zero_and_wall_time_over_a_resume(run_copy, capsys):
    code, err = cli(capsys, "export", str(run_copy), "--round", "0")
    assert code == 2 and "no checkpoint for round 0" in err and "rounds start at 1" in err
    from fedllm.run.checkpoint import latest_checkpoint

    # the first attempt up to its last checkpoint (its final evaluation, after it, is not counted when a
    # resume adds rounds: fedllm.round_loop's elapsed), then the second attempt on top; a comparison with
    # the first summary's wall_s would depend on how long that final evaluation happened to take
    checkpointed = json.loads((latest_checkpoint(run_copy) / "meta.json").read_text())["wall_s"]
    t0 = time.perf_counter()
    assert cli(capsys, "run", "--resume", str(run_copy), "federation.rounds=3")[0] == 0
    second = time.perf_counter() - t0
    total = json.loads((run_copy / "summary.json").read_text())["wall_s"]
    assert checkpointed > 0 and checkpointed < total <= checkpointed + second  # both attempts counted, once


def test_ctrl_c_in_round_2_says_in_one_line_how_to_resume(run_copy, capsys, monkeypatch):
    """No traceback for a user's interrupt: at most 3 lines, naming what was kept and the command."""
    from fedllm.simulation import Simulation

    real = Simulation.train_clients

    def interrupted(self, plan):
        if plan.round == 3:
            raise KeyboardInterrupt
        return real(self, plan)

    monkeypatch.setattr(Simulation, "train_clients", interrupted)
    code = main(
        ["--log-level", "WARNING", "run", "--resume", str(run_copy), "federation.rounds=4", "eval.limit=2"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) <= 3 and "Traceback" not in "\n".join(err)
    assert f"round 2 is checkpointed in {run_copy}: continue with `fedllm run --resume {run_copy}`" in err[-1]


def test_a_clients_log_line_says_how_many_of_its_partition_tokenizing_dropped():
    """The categories count the partition's examples; the sizes count what was left after tokenizing. A
    line whose sizes did not add up to its categories (957 train beside "other 980") read as a bug."""
    from fedllm.run.folder import client_line

    stat = {"client": 4, "rank": 64, "size": 1084, "train": 957, "test": 0, "categories": {"other": 1000}}
    line = client_line(stat)
    assert line.startswith("client 4: rank 64, 957 train / 0 test examples (1084 partitioned, 127 dropped")
    whole = {**stat, "train": 1084}
    assert "dropped" not in client_line(whole) and "1084 train / 0 test" in client_line(whole)
    site = {"client": 2, "rank": 8, "train": 40}  # a Flower site that shares neither test size nor categories
    assert (
        client_line(site)
        == "client 2: rank 8, 40 train / (not shared) test examples, categories (not shared)"
    )
