"""The federated boundary: import rules, module sizes, and server and runtime meeting only through
messages.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedllm.config import load_config
from fedllm.protocol import decode_start, decode_update, encode_start, encode_update
from fedllm.simulation import Simulation
from tests.conftest import assert_close_updates, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def offenders(folder: str, banned: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad = sorted(m for m in imports_of(path) if m.split(".")[0] in banned or m.startswith(banned))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_import_rules():
    assert (
        offenders(
            "fedllm/aggregation",
            ("fedllm.config", "fedllm.client", "fedllm.cli", "peft", "transformers", "accelerate"),
        )
        == {}
    )
    assert offenders("fedllm/client", ("fedllm.aggregation",)) == {}
    assert offenders("eval", ("fedllm",)) == {}
    assert offenders("data_prep", ("fedllm",)) == {}
    server = imports_of(ROOT / "fedllm" / "server.py")
    assert not {
        m
        for m in server
        if m.split(".")[0] in ("peft", "transformers", "accelerate")
        or m.startswith(("fedllm.client", "fedllm.modeling", "fedllm.simulation"))
    }


def test_the_server_loads_no_model_code():
    """Importing the server (and the strategies it runs) pulls in neither peft, transformers nor
    accelerate.
    """
    code = (
        "import sys, fedllm.server; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('peft', 'transformers', 'accelerate')); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_modules_stay_readable():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in ("fedllm", "eval", "data_prep")
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 520
    }
    assert long == {}


def through_the_wire(tensors: dict, meta: dict) -> tuple[dict, dict]:
    """What a transport does: new tensors and a JSON round trip of the metadata, no shared objects."""
    return {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta))


@pytest.mark.parametrize(
    ("strategy", "algorithm"),
    [
        ("fedit", "sft"),
        ("flora", "fedprox"),
        ("flexlora", "sft"),
        ("florist", "sft"),
        ("floral", "scaffold"),
        ("fedit", "scaffold"),
        ("fedit", "perfedavg"),
        ("local", "sft"),
    ],
)
def test_server_and_runtime_meet_only_through_messages(tmp_path, strategy, algorithm, builtin_base):
    """Every start and update crosses as encoded tensors + JSON; the result is the in-process simulation's."""
    extra = [
        f"aggregation.name={strategy}",
        f"client.algorithm={algorithm}",
        "eval.personalized=false",
        "eval.benchmark=none",
    ] + (["lora.ranks=[4]"] if strategy == "floral" else [])
    reference = Simulation(load_config(None, tiny_overrides(tmp_path / "ref", *extra)), tmp_path / "ref")
    reference.setup()
    reference.run()

    sim = Simulation(load_config(None, tiny_overrides(tmp_path / "wire", *extra)), tmp_path / "wire")
    sim.setup()
    server, runtime = sim.server, sim.runtime
    for r in (1, 2):
        plan = server.plan_round(r)
        replies = {}
        for k, start in plan.starts.items():
            got = decode_start(*through_the_wire(*encode_start(start)))
            update = runtime.train(sim.clients[k], got)
            replies[k] = decode_update(*through_the_wire(*encode_update(update)))
            assert not any(t is u for t in replies[k].factors.values() for u in update.factors.values())
        server.finish_round(plan, replies)
        if server.last_merged:
            runtime.apply_merges([(r, server.last_merged)])
    for key, f in reference.server.state.factors.items():
        torch.testing.assert_close(server.state.factors[key].delta(), f.delta(), rtol=1e-5, atol=1e-7)
    for key, f in reference.server.state.residual.items():
        torch.testing.assert_close(server.state.residual[key].delta(), f.delta(), rtol=1e-5, atol=1e-7)
    assert server.ledger.totals() == reference.server.ledger.totals()
    from fedllm.export import save_global_adapter

    save_global_adapter(server, sim.cfg, tmp_path / "wire" / "global_adapter")
    assert_close_updates(tmp_path / "ref", tmp_path / "wire", 1e-5)
