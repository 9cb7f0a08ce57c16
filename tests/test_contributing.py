"""docs/contributing.md's round-by-hand script runs as written and the round it runs is a real one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_PRETRAIN_STEPS

DOC = Path(__file__).resolve().parent.parent / "docs" / "contributing.md"


def script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/contributing.md should hold exactly one python block: the round by hand"
    return blocks[0]


def test_the_script_is_short_enough_to_read():
    lines = [x for x in script().splitlines() if x.strip()]
    assert len(lines) <= 40, len(lines)


@pytest.mark.parametrize("strategy", ["fedit", pytest.param("flora", marks=pytest.mark.slow)])
def test_the_round_by_hand_runs_and_the_server_aggregates(tmp_path, builtin_base, strategy):
    path = tmp_path / "round_by_hand.py"
    path.write_text(script())
    over = [
        f"model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}",
        "data.builtin_examples_per_skill=12",
        "data.eval_size=16",
        "data.min_examples_per_client=4",
        "client.local_steps=3",
        f"aggregation.name={strategy}",
    ]
    res = subprocess.run([sys.executable, str(path), *over], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout.strip().splitlines()
    m = re.fullmatch(rf"{strategy}: clients \[(.*)\], held-out loss ([\d.]+) -> ([\d.]+)", out[-2])
    assert m, out
    assert len(m.group(1).split(",")) == 3  # federation.clients_per_round=3
    assert float(m.group(2)) != float(m.group(3))  # the round changed the global model
    assert "'n_updates': 3" in out[-1] and "'up_bytes'" in out[-1]
