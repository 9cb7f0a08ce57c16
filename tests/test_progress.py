"""What a long phase says where there is no terminal (eval/progress.py): lines at a steady pace, a word
while one unit of work runs long, and libraries' bars as whole lines."""

from __future__ import annotations

import logging
import sys
import time

from eval import progress


def test_a_step_that_runs_long_is_reported_while_it_runs(monkeypatch, caplog):
    """One step of minutes (bfloat16 emulated on a CPU) left a run's log silent until it ended: the phase
    now says it is still working, with how long the current step has run, before the step is done."""
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.2)
    caplog.set_level(logging.INFO)
    log = logging.getLogger("test.progress")
    with progress.Progress(3, "client 2", "steps", logger=log, detail=lambda: "loss 1.0") as bar:
        time.sleep(1.2)  # the first step, long
        during = [r.getMessage() for r in caplog.records]
        bar.update()
    assert any("still working" in m and "0/3 steps" in m for m in during)
    assert caplog.records[-1].getMessage().startswith("client 2: 1 steps in")


def test_the_heartbeat_stops_with_the_phase(monkeypatch, caplog):
    """A closed phase says nothing more (a client that failed mid-round must not keep logging)."""
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.1)
    caplog.set_level(logging.INFO)
    bar = progress.Progress(5, "held-out loss", "examples", logger=logging.getLogger("test.progress"))
    bar.close()
    n = len(caplog.records)
    time.sleep(0.5)
    assert len(caplog.records) == n


def test_training_reports_each_client_in_a_log(builtin_base, monkeypatch, caplog, tmp_path):
    """Local training without a terminal: lines with the step, the running loss, the rate and the time
    left (every few seconds), through the same Progress as evaluation."""
    from fedllm.client import base

    monkeypatch.setattr(base, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level(logging.INFO)
    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(tmp_path / "r", "federation.rounds=1", "eval.personalized=false"))
    sim = Simulation(cfg, tmp_path / "r")
    monkeypatch.setattr(Simulation, "bars_disabled", lambda self: None)  # the main process, no terminal
    sim.setup()
    sim.run()
    lines = [r.getMessage() for r in caplog.records if "steps" in r.getMessage() and "left" in r.getMessage()]
    assert lines and all("loss" in line and "(running mean)" in line for line in lines)


def test_library_bars_become_whole_lines_and_other_text_passes(caplog, capsys):
    """A tqdm bar drawn inside bars_as_lines (no terminal) is logged line by line, at most one every
    every_s seconds plus its last state; a plain line written to stderr meanwhile passes as it is."""
    from tqdm.auto import tqdm

    caplog.set_level(logging.INFO)
    with progress.bars_as_lines(logging.getLogger("test.bars"), every_s=3600):
        for _ in tqdm(range(50), desc="downloading", mininterval=0):
            pass
        print("a plain line", file=sys.stderr)
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("downloading:   0%") and said[-1].startswith("downloading: 100%")
    assert len(said) == 2  # the first, then nothing until the last state (every_s is an hour)
    err = capsys.readouterr().err
    assert err == "a plain line\n"
