"""A Flower Grid that hosts real sites in this process, for driving the ServerApp's real round loop: what a
SuperLink would carry, without one (tests/test_flower_hostile.py, tests/test_flower_fuzz.py)."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, RecordDict

from fedllm.config import load_config
from fedllm.flower import client_app, server_app
from fedllm.flower.signing import load_private_key
from tests.conftest import tiny_overrides

_ids = itertools.count(1)


class Sent:
    """A message as the driver builds it; the grid names it."""

    def __init__(self, content, dst_node_id, message_type, group_id=None):
        self.content = content
        self.metadata = SimpleNamespace(
            message_id=f"m{next(_ids)}", dst_node_id=dst_node_id, message_type=message_type
        )


class Reply:
    """A reply as Flower's Message is one: an error reply has no content, and reading it raises."""

    def __init__(self, content, node, to, error=None):
        self._content, self._error = content, error
        self.error = SimpleNamespace(reason=error)
        self.metadata = SimpleNamespace(src_node_id=node, reply_to_message_id=to)

    def has_error(self) -> bool:
        return self._error is not None

    @property
    def content(self):
        if self._error is not None:
            raise ValueError(
                "Message content is None. Use <message>.has_content() to check if a message has content."
            )
        return self._content


def reply(content, node, to, error=None):
    return Reply(content, node, to, error)


class SiteGrid:
    """Nodes 100+k host site k in this process; ``tamper(node, type, message, content)`` may change a
    reply on its way (a hostile site, or another site answering for it)."""

    def __init__(self, tmp_path, n: int, keys: dict[int, str] | None = None):
        self.contexts = {
            100 + k: Context(
                run_id=1,
                node_id=100 + k,
                node_config={
                    "client-id": k,
                    "state-dir": str(tmp_path / f"site-{k}"),
                    **({"sign-key": keys[k]} if keys else {}),
                },
                state=RecordDict(),
                run_config={},
            )
            for k in range(n)
        }
        self.tamper = None
        self.keys = keys or {}

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=self.public(n)) for n in self.contexts]

    def public(self, node) -> bytes:
        k = node - 100
        if k not in self.keys:
            return b""
        return (
            load_private_key(self.keys[k])
            .public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )

    def send_and_receive(self, messages, timeout=None):
        handlers = {"query": client_app.query, "train": client_app.train, "evaluate": client_app.evaluate}
        out = []
        for m in messages:
            node, kind = m.metadata.dst_node_id, str(m.metadata.message_type)
            incoming = SimpleNamespace(
                content=m.content, metadata=SimpleNamespace(message_id=m.metadata.message_id)
            )
            content = handlers[kind](incoming, self.contexts[node])
            tampered = self.tamper(node, kind, m, content) if self.tamper else content
            out.append(
                tampered if isinstance(tampered, Reply) else reply(tampered, node, m.metadata.message_id)
            )
        return out


class Federation:
    """Node keys (ECDSA P-384, as ``ssh-keygen -t ecdsa -b 384`` makes) of clients 0..n-1 and the
    federation's registry of them (the file ``flower.registry`` reads, a copy on every site)."""

    def __init__(self, root, n: int = 8) -> None:
        from cryptography.hazmat.primitives import serialization

        root.mkdir(parents=True, exist_ok=True)
        self.root, self.keys, lines = root, {}, []
        for k in range(n):
            key = ec.generate_private_key(ec.SECP384R1())
            path = root / f"client{k}.pem"
            path.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            self.keys[k] = path
            public = key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            lines.append(f"{k}: {public.decode()}")
        self.registry = root / "registry.txt"
        self.registry.write_text("\n".join(lines) + "\n")

    def node_config(self, node: int, client: int) -> dict:
        """A bound site's node config: its client id, its node key, the federation's registry, its state."""
        return {
            "client-id": client,
            "sign-key": str(self.keys[client]),
            "registry": str(self.registry),
            "state-dir": str(self.root / f"state-{client}"),
        }


def grid_driver_factory(tmp_path, monkeypatch):
    """``make(n, rounds, signed_sites, *overrides) -> (driver, grid)``: a ServerApp driver over n sites."""
    monkeypatch.setattr(server_app, "Message", Sent)
    monkeypatch.setattr(client_app, "Message", lambda content, reply_to: content)

    def make(n=3, rounds=2, signed_sites=False, *extra):
        keys = {}
        if signed_sites:
            federation = Federation(tmp_path, n)
            keys = {k: str(path) for k, path in federation.keys.items()}
        cfg = load_config(
            None,
            tiny_overrides(
                tmp_path / "run",
                f"federation.num_clients={n}",
                f"federation.rounds={rounds}",
                "flower.share_token_modules=true",
                *([f"flower.registry={tmp_path / 'registry.txt'}"] if signed_sites else []),
                *extra,
            ),
        )
        grid = SiteGrid(tmp_path, n, keys)
        driver = server_app.FlowerDriver(cfg, tmp_path / "run", grid, startup_timeout_s=5)
        return driver, grid

    return make


def meta_of(content) -> dict:
    return json.loads(dict(content["meta"])["json"])


def with_meta(content, **change):
    meta = {**meta_of(content), **change}
    return RecordDict({"tensors": content["tensors"], "meta": ConfigRecord({"json": json.dumps(meta)})})


def run_on_simulation_engine(cfg, run_dir, num_supernodes: int = 4) -> None:
    """fedllm's ServerApp and ClientApp on Flower's Simulation Engine: Ray workers of one CPU each, two
    CPUs in all (this machine's)."""
    from flwr.simulation import run_simulation

    from fedllm.flower.client_app import app as client_app
    from fedllm.flower.server_app import server_app

    run_simulation(
        server_app(cfg, run_dir, startup_timeout_s=300),
        client_app,
        num_supernodes=num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
