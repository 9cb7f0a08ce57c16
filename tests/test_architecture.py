"""The federated boundary: import rules, the package layout, and server and runtime meeting only through
messages.
"""

from __future__ import annotations

import ast
import json
import re
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
    # the checks strategies and algorithms share live below them (fedllm/checks.py): none imports the server
    assert offenders("fedllm/aggregation", ("fedllm.server",)) == {}
    assert offenders("fedllm/client", ("fedllm.server",)) == {}
    # atomic writes live below the clients' store and the config (fedllm/files/): neither imports fedllm.run
    assert offenders("fedllm/client", ("fedllm.run",)) == {}
    assert offenders("fedllm/config", ("fedllm.run",)) == {}
    # batching is the runtime's own way of training, one direction: the runtime calls the batched trainer
    batched = ROOT / "fedllm" / "client" / "batched.py"
    assert "fedllm.client.runtime" not in imports_of(batched)
    takes_runtime = [
        node.name
        for node in ast.walk(ast.parse(batched.read_text()))
        if isinstance(node, ast.FunctionDef) and any(a.arg == "runtime" for a in node.args.args)
    ]
    assert takes_runtime == []  # it is handed the model and the jobs, never the runtime to read
    assert offenders("eval", ("fedllm",)) == {}
    assert offenders("data_prep", ("fedllm",)) == {}
    server = imports_of(ROOT / "fedllm" / "server" / "server.py")
    assert not {
        m
        for m in server
        if m.split(".")[0] in ("peft", "transformers", "accelerate")
        or m.startswith(("fedllm.client", "fedllm.model.modeling", "fedllm.simulation"))
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


def test_the_package_is_split_by_concept():
    """At most 12 modules directly under fedllm/; the rest lives in packages named after their concept."""
    top = sorted(p.name for p in (ROOT / "fedllm").glob("*.py"))
    assert len(top) <= 12, top
    for package in ("aggregation", "client", "config", "flower", "model", "privacy", "run", "server"):
        assert (ROOT / "fedllm" / package / "__init__.py").is_file(), package


def through_the_wire(tensors: dict, meta: dict) -> tuple[dict, dict]:
    """What a transport does: new tensors and a JSON round trip of the metadata, no shared objects."""
    return {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta))


class WireSimulation(Simulation):
    """The same round loop, with every start and update encoded, copied and decoded on its way."""

    def train_clients(self, plan):
        replies = {}
        for k, start in plan.starts.items():
            got = decode_start(*through_the_wire(*encode_start(start)))
            update = self.runtime.train(self.clients[k], got)
            replies[k] = decode_update(*through_the_wire(*encode_update(update)))
            assert not any(t is u for t in replies[k].factors.values() for u in update.factors.values())
        return replies


@pytest.mark.parametrize(
    ("strategy", "algorithm"),
    [
        ("fedit", "sft"),
        ("flora", "fedprox"),
        ("flexlora", "sft"),
        ("florist", "sft"),
        ("floral", "fedprox"),
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
    runs = {}
    for name, driver in (("ref", Simulation), ("wire", WireSimulation)):
        runs[name] = driver(load_config(None, tiny_overrides(tmp_path / name, *extra)), tmp_path / name)
        runs[name].setup()
        runs[name].run()
    ref, wire = runs["ref"].server, runs["wire"].server
    for key, f in ref.state.factors.items():
        torch.testing.assert_close(wire.state.factors[key].delta(), f.delta(), rtol=1e-5, atol=1e-7)
    for key, f in ref.state.residual.items():
        torch.testing.assert_close(wire.state.residual[key].delta(), f.delta(), rtol=1e-5, atol=1e-7)
    assert wire.ledger.totals() == ref.ledger.totals()
    assert_close_updates(tmp_path / "ref", tmp_path / "wire", 1e-5)


def import_graph() -> dict[str, set[str]]:
    """fedllm, eval and data_prep modules, each with the project modules it imports (anywhere in the file)."""
    modules = {}
    for folder in ("fedllm", "eval", "data_prep"):
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        graph[name] = {m for m in map(resolve, found) if m and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(import_graph()) == []


def module_imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each module's imports run when it is imported (module level, outside ``if TYPE_CHECKING``, with the
    parent packages a submodule's import runs first) and those that run only inside a function."""
    modules = {}
    for folder in ("fedllm", "eval", "data_prep"):
        for path in (ROOT / folder).rglob("*.py"):
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        return []

    top: dict[str, set[str]] = {}
    local: dict[str, set[str]] = {}
    for name, path in modules.items():
        at_top, inside = set(), set()

        def walk(node, in_function: bool, name=name, at_top=at_top, inside=inside) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                for m in targets(child):
                    r = resolve(m)
                    if r and r != name:
                        (inside if in_function else at_top).add(r)
                walk(
                    child,
                    in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda),
                )

        walk(ast.parse(path.read_text()), False)
        parts = name.split(".")
        at_top |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(modules)
        top[name], local[name] = at_top, inside - at_top
    return top, local


def cycle_dodges(top: dict[str, set[str]], local: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Function-local imports ``a -> b`` that would close a circle at import time: ``b``'s own imports lead
    back to ``a`` through a module outside ``a``'s package (a package's lazy import of its own submodule,
    whose imports stay inside the package, is no circle)."""
    found = []
    for a, bs in local.items():
        package = a if any(m.startswith(a + ".") for m in top) else a.rpartition(".")[0]
        for b in bs:
            seen, todo = set(), [(b, not b.startswith(package + "."))]
            while todo:
                node, left = todo.pop()
                if node == a and left:
                    found.append((a, b))
                    break
                if (node, left) in seen:
                    continue
                seen.add((node, left))
                for nxt in top.get(node, ()):
                    todo.append((nxt, left or not (nxt == package or nxt.startswith(package + "."))))
    return sorted(found)


def test_no_function_local_import_dodges_a_circle():
    """A lazy import that exists only to dodge an import circle (the server's package once loaded its
    names through ``__getattr__`` because the strategies imported its checks) is a circle all the same."""
    assert cycle_dodges(*module_imports()) == []


def test_the_dodge_finder_finds_one():
    top = {
        "p": {"p.a"},
        "p.a": {"p"},
        "p.b": {"p", "q"},
        "q": {"p.c"},
        "p.c": {"p"},
        "r": set(),
        "r.x": {"r", "r.y"},
        "r.y": {"r"},
    }
    local = {"p": {"p.b"}, "r": {"r.x"}}  # p's lazy p.b leads back through q; r's lazy r.x stays inside r
    assert cycle_dodges(top, local) == [("p", "p.b")]


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_driver():
    """Drivers (the simulation, the Flower apps) are composed by the CLI only: nothing else depends on one."""
    drivers = {"fedllm.simulation", "fedllm.flower.server_app", "fedllm.flower.client_app"}
    graph = import_graph()
    users = {m: sorted(deps & drivers) for m, deps in graph.items() if deps & drivers and m != "fedllm.cli"}
    assert users == {}


PRIVACY_WORDS = re.compile(r"privacy|differential|(^|_)dp($|_)|epsilon|noise_multiplier", re.IGNORECASE)


def code_words(path: Path) -> set[str]:
    """Identifiers, attribute and keyword names, imported modules and non-docstring string constants of a
    module: what its code says (comments and docstrings aside)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif (isinstance(node, ast.keyword) and node.arg) or isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, ast.alias):
            words.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            words.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return words


# the one place another feature reads DP's settings: secure aggregation composed with DP (distributed mode:
# each site's share of the noise on its masked vector, the clip that bounds the protocol's range)
COMPOSES_WITH_PRIVACY = Path("fedllm/secagg/bounds.py")
# the typed list of the config's sections, a feature's among them (a type checker reads cfg.privacy.epsilon)
TYPED_SECTIONS = Path("fedllm/config/__init__.py")


def test_only_the_privacy_room_speaks_of_privacy():
    """Differential privacy lives in fedllm/privacy/ (the strategy wrapper, the upload transform, the
    accountant, its options and command); the registry of features names it, the config's typed sections name
    its options (``TYPED_SECTIONS``), and secure aggregation reads its clip and noise in one module
    (``COMPOSES_WITH_PRIVACY``); no other module's code does."""
    found = {}
    for path in sorted((ROOT / "fedllm").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "privacy" or rel in (Path("fedllm/features.py"), COMPOSES_WITH_PRIVACY):
            continue
        bad = sorted(w for w in code_words(path) if PRIVACY_WORDS.search(w))
        if rel == TYPED_SECTIONS:  # its import and its field, nothing else
            bad = [w for w in bad if w not in ("PrivacyOptions", "fedllm.privacy.options", "privacy")]
        if bad:
            found[str(rel)] = bad
    assert found == {}


TRANSPORT_WORDS = re.compile(
    r"^comm$|comm\.|transport|(^|_)wire($|_|\.)|(^|_)int[48]($|_)|error_feedback|Quantized(Up|Down)load|"
    r"to_wire|from_wire",
    re.IGNORECASE,
)
# where a feature's branch must never be: the drivers, the server, the client runtime, the round loop (each
# feature hooks them from outside: Feature.codec, upload_transforms, server_policy, wrap_strategy, ...)
CORE = ("fedllm/flower", "fedllm/server", "fedllm/client/runtime.py", "fedllm/round_loop.py")


def core_files() -> list[Path]:
    return [p for c in CORE for p in ([ROOT / c] if c.endswith(".py") else sorted((ROOT / c).rglob("*.py")))]


def test_the_core_never_speaks_of_transport_or_privacy():
    """A feature owns its wire format (``Feature.codec``): the Flower apps, the server, the client runtime and
    the round loop call the run's composed hooks and never read ``comm.*``, name an encoding or import the
    transport or privacy room."""
    found = {}
    for path in core_files():
        words = code_words(path)
        bad = sorted(w for w in words if TRANSPORT_WORDS.search(w) or PRIVACY_WORDS.search(w))
        bad += sorted(m for m in imports_of(path) if m.startswith(("fedllm.transport", "fedllm.privacy")))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}


def test_the_transport_word_finder_finds_a_branch(tmp_path):
    """The finder above sees the branch the Flower driver had before the codec hook."""
    path = tmp_path / "driver.py"
    path.write_text(
        "from fedllm.transport.wire import rebuild\n"
        "def received(self, update):\n"
        "    fmt = self.cfg.comm.upload\n"
        "    return update.wire\n"
    )
    words = {w for w in code_words(path) if TRANSPORT_WORDS.search(w)}
    assert words == {"comm", "fedllm.transport.wire", "wire"}


def test_one_round_loop():
    """A round is run in one place (``round_loop.one_round``): every driver and ``fedllm reproduce`` call it;
    no other module of the package plans or finishes a round itself."""
    callers = {}
    for path in sorted((ROOT / "fedllm").rglob("*.py")):
        calls = {
            node.func.attr
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("plan_round", "finish_round")
        }
        if calls:
            callers[str(path.relative_to(ROOT))] = sorted(calls)
    assert callers == {"fedllm/round_loop.py": ["finish_round", "plan_round"]}

    def calls_one_round(path: Path, function: str) -> bool:
        tree = ast.parse(path.read_text())
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
        return any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "one_round"
            for n in ast.walk(body)
        )

    assert calls_one_round(ROOT / "fedllm" / "round_loop.py", "run_round")
    assert calls_one_round(ROOT / "fedllm" / "reproduce" / "common.py", "federate")


def test_no_module_compares_a_method_name_outside_its_own_file():
    """The round loop, server, runtime, config and drivers never branch on which strategy or algorithm
    runs: a comparison with a registered name happens only in that method's own file."""
    from fedllm.aggregation import STRATEGIES
    from fedllm.client import ALGORITHMS

    names = set(STRATEGIES) | set(ALGORITHMS)
    found = []
    for path in sorted((ROOT / "fedllm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            subject = [
                n
                for side in sides
                for n in ast.walk(side)
                if (isinstance(n, ast.Attribute) and n.attr in ("name", "algorithm"))
                or (isinstance(n, ast.Name) and n.id in ("name", "algorithm"))
            ]
            if not subject:  # e.g. privacy.mode == "local" names a mode, not the local-only strategy
                continue
            consts = [
                c.value
                for side in sides
                for c in ast.walk(side)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            for name in set(consts) & names:
                if path.stem != name:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with {name!r}")
    assert found == []


def test_the_run_folder_is_read_through_its_reader():
    """Report, compare, model card, export and the CLI read a run through fedllm/run/reader.py; only it
    and the writer (fedllm/run/folder.py) name the run's files."""
    files = ("config.yaml", "metrics.jsonl", "summary.json", "run_info.json", "partition.json")
    owners = {Path("fedllm/run/reader.py"), Path("fedllm/run/folder.py")}
    found = {}
    for path in sorted((ROOT / "fedllm").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel in owners:
            continue
        named = sorted(w for w in code_words(path) if w in files)
        if named:
            found[str(rel)] = named
    assert found == {}
