"""A site's identity on Flower: the operator's key registry, one live node per client id, refusals that
fire every time, and what a site's handshake and updates reveal by default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedllm.config import ConfigError, load_config
from fedllm.flower import server_app
from fedllm.flower.identity import load_registry, pem_of, refuse_token_modules
from fedllm.flower.records import info_record, signed
from fedllm.flower.site import Site
from tests.flower_grid import Sent

PRIVATE: dict[bytes, object] = {}  # a test site's private key by its public PEM (it signs its replies)


def keypair() -> tuple[str, bytes]:
    """A site key as its OpenSSH public line (what the operator registers) and as Flower stores it (PEM)."""
    private = ec.generate_private_key(ec.SECP384R1())
    pub = private.public_key()
    line = pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    pem = pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    PRIVATE[pem] = private
    return line, pem


class FakeGrid:
    """Nodes that claim client ids (with or without a key); records which node got which message."""

    def __init__(self):
        self.claims: dict[int, tuple[int, bytes | None]] = {}  # node id -> (claimed client id, key)
        self.received: dict[int, list] = {}

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=key or b"") for n, (_, key) in self.claims.items()]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for m in messages:
            n = m.metadata.dst_node_id
            self.received.setdefault(n, []).append(m.content)
            if m.metadata.message_type == "query":
                key = PRIVATE.get(self.claims[n][1] or b"")
                content = signed(
                    info_record({"client-id": self.claims[n][0], "num-examples": 10}),
                    key,
                    m.metadata.message_id,
                )
            else:
                content = {"from": n}
            replies.append(
                SimpleNamespace(
                    content=content,
                    has_error=lambda: False,
                    metadata=SimpleNamespace(src_node_id=n, reply_to_message_id=m.metadata.message_id),
                )
            )
        return replies


def as_is(k, content, reply_to):
    """A parser that takes a reply's content as it is (the identity tests look at who answers)."""
    return content


@pytest.fixture
def driver_for(tmp_path, monkeypatch):
    monkeypatch.setattr(server_app, "Message", Sent)
    monkeypatch.setattr(server_app, "start_record", lambda start, text, k, codecs: {"client": k})

    def make(*overrides: str):
        cfg = load_config(None, ["federation.num_clients=2", *overrides])
        grid = FakeGrid()
        return server_app.FlowerDriver(cfg, tmp_path / "run", grid), grid

    return make


def test_plain_mode_a_second_claim_is_refused_while_the_holder_lives(driver_for, caplog):
    """Without a registry the first live node holds the id: an impostor claiming client 0 never receives
    client 0's messages and never contributes; once the holder is gone (a restarted site) the id is free."""
    driver, grid = driver_for()
    grid.claims = {11: (0, None), 12: (1, None)}
    assert set(driver.handshake()) == {0, 1}
    grid.claims[66] = (0, None)  # a third node claims client 0
    for round_idx in (1, 2):
        caplog.clear()
        replies, failures = driver._exchange({0: "s0", 1: "s1"}, "train", round_idx, as_is)
        assert "node 66 claims client 0: refused" in caplog.text  # logged every time it asks
        assert replies == {0: {"from": 11}, 1: {"from": 12}} and not failures
    assert all(c.get("client") is None for c in grid.received[66])  # only handshakes reached it
    assert driver.nodes == {0: 11, 1: 12}
    del grid.claims[11]  # the holder is gone: the next claim takes the id
    driver.handshake()
    assert driver.nodes == {0: 66, 1: 12}


def test_registry_binds_each_key_to_one_client(driver_for, tmp_path, caplog):
    """With a registry a node answers for an id only with that id's key; a restarted site (same key, new
    node id) takes its id back; an unknown key or another site's key is refused even when the id is free."""
    (l0, k0), (l1, k1), (_, rogue) = keypair(), keypair(), keypair()
    reg = tmp_path / "registry.txt"
    (tmp_path / "site1.pub").write_text(l1 + "\n")
    reg.write_text(f"# operator's registry\n0: {l0}\n1: site1.pub\n")
    driver, grid = driver_for(f"flower.registry={reg}")
    grid.claims = {11: (0, k0), 12: (1, k1), 66: (0, rogue), 67: (0, k1), 68: (1, None)}
    infos = driver.handshake()
    assert set(infos) == {0, 1} and driver.nodes == {0: 11, 1: 12}
    assert "node 66 claims client 0: refused (its key is not in flower.registry)" in caplog.text
    assert "node 67 claims client 0: refused (its key is registered for client 1)" in caplog.text
    assert "node 68 claims client 1: refused (it has no authenticated key)" in caplog.text
    del grid.claims[11]
    driver.handshake()
    assert 0 not in driver.nodes  # the rogue and the other site's key still cannot take it
    grid.claims[21] = (0, k0)  # site 0 restarted: its key, a new node id
    driver.handshake()
    assert driver.nodes == {0: 21, 1: 12}
    replies, _ = driver._exchange({0: "s0", 1: "s1"}, "train", 3, as_is)
    assert replies == {0: {"from": 21}, 1: {"from": 12}}
    assert not any(c.get("client") is not None for n in (66, 67, 68) for c in grid.received.get(n, []))


def test_registry_errors_name_the_line(tmp_path):
    (l0, _), (l1, _) = keypair(), keypair()
    reg = tmp_path / "r.txt"
    for text, msg in (
        (f"0: {l0}\n", "no key for clients [1]"),
        (f"0: {l0}\n1: {l0}\n", "line 2: this key is already registered for client 0"),
        (f"0: {l0}\n0: {l1}\n", "line 2: client id 0 is registered twice"),
        (f"x {l0}\n", "line 1: expected 'client-id: public key'"),
        (f"0: {l0}\n5: {l1}\n", "line 2: client id 5 is outside 0..1"),
        (f"0: {l0}\n1: missing.pub\n", "line 2: missing.pub is neither a public key nor a file"),
        (f"0: {l0}\n1: ecdsa-sha2-nistp384 AAAAbad\n", "line 2: not a public key"),
    ):
        reg.write_text(text)
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            load_registry(str(reg), 2)
    with pytest.raises(ConfigError, match="is not a file"):
        load_registry(str(tmp_path / "none.txt"), 2)
    reg.write_text(f"0: {l0}\n1: {l1}\n")
    assert sorted(load_registry(str(reg), 2).values()) == [0, 1]
    assert pem_of(l0, "x").startswith(b"-----BEGIN PUBLIC KEY-----")


def test_token_indexed_modules_are_refused_on_flower_unless_acknowledged():
    with pytest.raises(ConfigError, match=r"\['embed_tokens', 'lm_head'\].*flower.share_token_modules=true"):
        refuse_token_modules(load_config(None, []))  # the built-in default shares both
    refuse_token_modules(load_config(None, ["flower.share_token_modules=true"]))
    refuse_token_modules(load_config(None, ["lora.trainable_modules=[]"]))


def test_a_site_shares_its_count_only_unless_asked():
    """The handshake carries the client id and the example count; the histogram and test size only with
    flower.share_data_stats. Under secure aggregation with uniform weights the count is 1 (the weighting needs
    none; secagg.site_metrics=true sends it), as it is for a site pinned to secure aggregation; with example
    weights it is the count the weighting needs."""
    import types

    def site(*over: str, pinned: bool = False):
        cfg = load_config(None, list(over))
        out = SimpleNamespace(
            cfg=cfg,
            client_id=3,
            client=SimpleNamespace(num_examples=40, test=[1, 2], rank=8),
            categories={"math": 30, "qa": 12},
            pinned=pinned,
            own_examples=44,
        )
        out.keeps_figures = types.MethodType(Site.keeps_figures, out)
        out.declared_examples = types.MethodType(Site.declared_examples, out)
        return out

    assert Site.info(site("flower.share_data_stats=false")) == {"client-id": 3, "rank": 8, "num-examples": 40}
    shared = Site.info(site("flower.share_data_stats=true"))
    assert shared["num-test"] == 2 and "math" in shared["categories"]
    secure = ("flower.secure_aggregation=true", "secagg.clip_norm=1", "federation.num_clients=4")
    assert Site.info(site(*secure, "federation.weighting=uniform"))["num-examples"] == 1
    assert (
        Site.info(site(*secure, "federation.weighting=uniform", "secagg.site_metrics=true"))["num-examples"]
        == 40
    )
    assert Site.info(site(*secure))["num-examples"] == 40  # example weights need the count
    assert Site.info(site("federation.weighting=uniform", pinned=True))["num-examples"] == 1
    # pinned, with example weights: its own count, and no histogram whatever the config asks
    assert Site.info(site("flower.share_data_stats=true", pinned=True)) == {"client-id": 3, "rank": 8,
                                                                             "num-examples": 44}  # fmt: skip


def test_a_sites_log_says_how_many_of_its_examples_tokenizing_dropped(builtin_base, tmp_path, caplog):
    """A site shares its sizes after tokenizing and its categories before: the server cannot tell a drop, so
    the site's own line must say it, or its train and test sizes would not add up to its file."""
    import json
    import logging

    from tests.conftest import TEST_PRETRAIN_STEPS

    rows = [{"instruction": "Say hi", "response": "hi", "category": "qa"}] * 6
    rows += [{"instruction": "word " * 400, "response": "long", "category": "qa"}] * 2  # past max_seq_len
    data = tmp_path / "site.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(
        None,
        [
            f"model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}",
            "federation.num_clients=2",
            "data.max_seq_len=64",
        ],
    )
    with caplog.at_level(logging.INFO, logger="fedllm.flower.site"):
        site = Site(cfg, 0, tmp_path / "state", data_path=str(data))
    assert len(site.client.train) + len(site.client.test) == 6
    assert "(8 partitioned, 2 dropped when tokenized)" in caplog.text
