"""Fuzzing the ServerApp's reply handling: hundreds of malformed train and handshake replies, drawn by a
seeded generator from a genuine reply of each transport format (wrong dtypes, complex and bool included,
shapes, ranks, scales that are 0, negative or NaN, missing and extra keys, huge sizes, encodings that decode
to another rank), go through the driver's parser, the transport's rebuild and the server's acceptance,
clipping and aggregation. Nothing raises out of them, and each reply that is not the protocol's is that
site's failure for the round with a one-line reason.

The sites are real (their ClientApp handlers train once, in round 1); afterwards each site answers with its
genuine reply re-addressed to the round asked, so that every round has two honest updates beside the fuzzed
one and the server's whole round runs.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedllm.transport.codec import encode
from fedllm.transport.wire import WIRE
from tests.flower_grid import Reply, grid_driver_factory, meta_of


@pytest.fixture
def grid_driver(tmp_path, monkeypatch, builtin_base):
    return grid_driver_factory(tmp_path, monkeypatch)


VICTIM = 101  # the node of site 1
STRANGE = [
    torch.complex64,
    torch.bool,
    torch.int64,
    torch.float64,
    torch.float16,
    torch.uint8,
    torch.int8,
]
JUNK = [
    0,
    -1,
    -4.5,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e300,
    True,
    None,
    "x",
    [],
    {},
    [1, 2],
    {"a": 1},
]


def _parts(content) -> tuple[dict[str, torch.Tensor], dict]:
    return dict(content["tensors"].to_torch_state_dict()), meta_of(content)


def _record(tensors: dict[str, torch.Tensor], meta: dict | str) -> RecordDict:
    text = meta if isinstance(meta, str) else json.dumps(meta)
    return RecordDict(
        {"tensors": ArrayRecord(torch_state_dict=tensors), "meta": ConfigRecord({"json": text})}
    )


def _pick(rng: random.Random, items):
    items = sorted(items)
    return items[rng.randrange(len(items))]


def _bad_train_reply(rng: random.Random, content, fmt: str) -> tuple[str, RecordDict | object]:
    """One malformed reply derived from a genuine one: (what was done, the reply)."""
    tensors, meta = _parts(content)
    kind = rng.randrange(14)
    if kind == 0:  # a tensor in another dtype
        name, dtype = _pick(rng, tensors), STRANGE[rng.randrange(len(STRANGE))]
        if tensors[name].dtype == dtype or (name.startswith(WIRE) and dtype == torch.uint8):
            dtype = torch.complex64
        tensors[name] = tensors[name].to(dtype)
        return f"{name} as {dtype}", _record(tensors, meta)
    if kind == 1:  # a tensor of another shape
        name = _pick(rng, tensors)
        t = tensors[name]
        how = rng.randrange(4)
        if how == 0:
            new = t.reshape(-1)[: max(t.numel() - 1, 0)]
        elif how == 1:
            new = torch.cat([t.reshape(-1), t.reshape(-1)[:3]])
        elif how == 2:
            new = t.reshape(-1)[:0]
        else:
            new = t.reshape(-1).repeat(2)
        tensors[name] = new.contiguous()
        return f"{name} reshaped ({how})", _record(tensors, meta)
    if kind == 2:  # the change of every factor encoded at another rank, consistently with its shapes
        rank_of = next(iter(meta["scales"].values()))
        factors = {k: t for k, t in tensors.items() if ".A" in k or ".B" in k}
        if fmt == "float32":
            for k, t in factors.items():
                tensors[k] = t[:1].clone() if k.endswith(".A") else t[:, :1].clone()
        else:
            shapes = dict(meta["wire"]["shapes"])
            for name, shape in list(shapes.items()):
                if name.startswith("factors."):
                    shape = [1, shape[1]] if name.endswith(".A") else [shape[0], 1]
                    e = encode(torch.randn(shape), fmt, meta["wire"]["block"])
                    tensors[f"{WIRE}{name}.payload"] = e.payload.contiguous().view(torch.uint8)
                    if e.scales is not None:
                        tensors[f"{WIRE}{name}.scales"] = e.scales
                    shapes[name] = shape
            meta["wire"] = {**meta["wire"], "shapes": shapes}
        return f"rank 1 instead of {rank_of}", _record(tensors, meta)
    if kind == 3:  # a module's scale that no layer has
        key = _pick(rng, meta["scales"])
        meta["scales"][key] = JUNK[rng.randrange(len(JUNK))]
        return f"scale of {key} = {meta['scales'][key]!r}", _record(tensors, meta)
    if kind == 4:  # a required field missing
        key = _pick(rng, ["client_id", "num_examples", "scales", "metrics"])
        del meta[key]
        return f"no {key}", _record(tensors, meta)
    if kind == 5:  # a field beyond the protocol's, or a record beyond the reply's
        if rng.random() < 0.5:
            meta[f"extra{rng.randrange(9)}"] = JUNK[rng.randrange(len(JUNK))]
            return "an extra field", _record(tensors, meta)
        out = _record(tensors, meta)
        out["junk"] = ArrayRecord(torch_state_dict={"x": torch.zeros(4)})
        return "an extra record", out
    if kind == 6:  # a count or id of another type or value
        key = _pick(rng, ["client_id", "num_examples"])
        meta[key] = _pick_value(rng, meta[key])
        return f"{key} = {meta[key]!r}", _record(tensors, meta)
    if kind == 7:  # non-finite values
        floats = [k for k, t in tensors.items() if t.is_floating_point() and t.numel()]
        if not floats:  # a 16-bit format: every tensor travels as its bytes; write a NaN's bytes into one
            name = _pick(rng, [k for k in tensors if k.endswith(".payload")])
            t = tensors[name].clone()
            t[:2] = torch.tensor([0x00, 0x7E] if fmt == "float16" else [0xC0, 0x7F], dtype=torch.uint8)
            tensors[name] = t
            return f"{name}: a NaN's bytes", _record(tensors, meta)
        name = _pick(rng, floats)
        t = tensors[name].clone()
        t.view(-1)[rng.randrange(t.numel())] = _pick(rng, [float("nan"), float("inf"), -float("inf")])
        tensors[name] = t
        return f"{name}: a non-finite value", _record(tensors, meta)
    if kind == 8:  # huge sizes: a shape of 2^40 values, or a tensor far beyond the update's size
        if fmt != "float32" and rng.random() < 0.5:
            name = _pick(rng, meta["wire"]["shapes"])
            meta["wire"]["shapes"][name] = [1 << 20, 1 << 20]
            return "a wire shape of 2^40 values", _record(tensors, meta)
        tensors["factors.huge.A"] = torch.zeros(3_000_000)
        return "a tensor of 12 MB", _record(tensors, meta)
    if kind == 9:  # the wire metadata broken, or present in a float32 run and absent in an encoded one
        if fmt == "float32":
            meta["wire"] = {"fmt": "int8", "block": 64, "shapes": {}}
            return "wire metadata in a float32 run", _record(tensors, meta)
        key = _pick(rng, ["fmt", "block", "shapes"])
        meta["wire"][key] = JUNK[rng.randrange(len(JUNK))]
        return f"wire {key} = {meta['wire'][key]!r}", _record(tensors, meta)
    if kind == 10:  # block scales of an integer format that are 0, negative, NaN or of another count
        scales = [k for k in tensors if k.endswith(".scales")]
        if not scales:
            del meta["scales"]
            return "no scales (float formats have no block scales)", _record(tensors, meta)
        name = _pick(rng, scales)
        t = tensors[name].clone()
        how = rng.randrange(4)
        if how == 0:
            t.view(-1)[0] = -1.0
        elif how == 1:
            t.view(-1)[0] = float("nan")
        elif how == 2:
            t = t[:-1].contiguous() if t.numel() > 1 else torch.ones(3)
        else:
            t = t.to(torch.complex64)
        tensors[name] = t
        return f"{name} broken ({how})", _record(tensors, meta)
    if kind == 11:  # a tensor renamed to something no update has
        name = _pick(rng, tensors)
        tensors[f"{name}.evil"] = tensors.pop(name)
        return f"{name} renamed", _record(tensors, meta)
    if kind == 12:  # metadata of another type
        how = rng.randrange(4)
        text = ["[1, 2]", "{oops", json.dumps("text"), "x" * 70_000][how]
        return f"metadata text ({how})", _record(tensors, text)
    # kind 13: not records at all, or records of the wrong kind
    how = rng.randrange(3)
    if how == 0:
        return "not a record dict", ["not", "records"]
    if how == 1:
        return "tensors as a ConfigRecord", RecordDict({"tensors": content["meta"], "meta": content["meta"]})
    return "no tensors", RecordDict({"meta": content["meta"]})


def _pick_value(rng: random.Random, value):
    choices = [-1, -(1 << 62), 1 << 62, 2.5, float("nan"), True, None, "3", [value], {"v": value}, value + 1]
    return choices[rng.randrange(len(choices))]


class _Replay:
    """The grid's replies from round 2 on: each site's genuine round-1 reply re-addressed to the round asked
    (its round and plan fields taken from the message it answers); site 1's then broken by
    ``_bad_train_reply`` when ``rng`` is set (``what`` says how)."""

    def __init__(self, genuine: dict[int, object], fmt: str):
        self.genuine, self.fmt = genuine, fmt
        self.rng: random.Random | None = None
        self.what = ""

    def __call__(self, node, kind, message, content):
        if kind != "train":
            return content
        sent = meta_of(message.content)
        tensors, meta = _parts(self.genuine[node])
        meta.update(round=sent["round"], token=sent["token"])
        honest = _record(tensors, meta)
        if node != VICTIM or self.rng is None:
            return honest
        self.what, bad = _bad_train_reply(self.rng, honest, self.fmt)
        return bad


@pytest.mark.parametrize(
    ("fmt", "count"),
    [
        pytest.param("float32", 90, marks=pytest.mark.slow),
        pytest.param("float16", 50, marks=pytest.mark.slow),
        ("int8", 120),  # the default run's share: the format with block scales, payloads and rebuilds
        pytest.param("int4", 50, marks=pytest.mark.slow),
    ],
)
def test_malformed_train_replies_never_raise_and_each_is_that_sites_failure(
    grid_driver, monkeypatch, fmt, count
):
    from fedllm.flower import client_app

    driver, grid = grid_driver(3, 2, False, f"comm.upload={fmt}", "eval.personalized=false")
    genuine: dict[int, object] = {}

    def keep(node, kind, message, content):
        if kind == "train":
            genuine[node] = content
        return content

    grid.tamper = keep
    driver.setup()
    driver.run_round(1)
    assert set(genuine) == {100, 101, 102}
    monkeypatch.setattr(client_app, "train", lambda message, context: None)  # the sites replay from now on
    replay = _Replay(genuine, fmt)
    grid.tamper = replay
    plan = driver.server.plan_round(2)
    honest = driver.server.finish_round(plan, driver.train_clients(plan))
    assert honest.row["n_updates"] == 3 and not honest.row["failed"], honest.row  # the replay is honest
    replay.rng = random.Random(f"fuzz-{fmt}")
    seen = set()
    for i in range(count):
        plan = driver.server.plan_round(3 + i)
        results = driver.train_clients(plan)  # must not raise
        report = driver.server.finish_round(plan, results)  # nor this
        seen.add(replay.what.split(" ")[0])
        failed = report.row["failed"]
        assert "1" in failed and report.row["n_updates"] == 2, (
            i,
            replay.what,
            failed,
            report.row["n_updates"],
        )
        reason = failed["1"]
        assert reason and "\n" not in reason and len(reason) < 400, (replay.what, reason)
        assert "stale" not in reason, (replay.what, reason)  # broken for what was done to it, not its round
    assert len(seen) > 10, seen
    # a site whose ClientApp failed: Flower's error reply has no content, and reading it raises
    replay.rng = None
    grid.tamper = lambda node, kind, m, c: (
        Reply(None, node, m.metadata.message_id, error="ClientApp raised")
        if node == VICTIM
        else replay(node, kind, m, c)
    )
    plan = driver.server.plan_round(3 + count)
    report = driver.server.finish_round(plan, driver.train_clients(plan))
    assert report.row["failed"]["1"] == "site error: ClientApp raised" and report.row["n_updates"] == 2
    assert driver.message_bytes["flower_up_bytes"] > 0  # the two honest replies, counted; the error, not


def _bad_handshake(rng: random.Random, genuine: dict) -> tuple[str, object]:
    info = dict(genuine)
    kind = rng.randrange(7)
    if kind == 0:
        key = _pick(rng, ["client-id", "num-examples", "num-test"])
        info[key] = _pick_value(rng, info.get(key, 0)) if rng.random() < 0.8 else -3
        if isinstance(info[key], int) and not isinstance(info[key], bool) and info[key] >= 0:
            info[key] = -1 - info[key]
        return f"{key} = {info[key]!r}", RecordDict({"meta": ConfigRecord({"json": json.dumps(info)})})
    if kind == 1:
        del info[_pick(rng, ["client-id", "num-examples"])]
        return "a field missing", RecordDict({"meta": ConfigRecord({"json": json.dumps(info)})})
    if kind == 2:
        info["categories"] = _pick(
            rng,
            [
                "{[",
                json.dumps([1, 2]),
                json.dumps({"a": "b"}),
                json.dumps({"a": 1.5}),
                json.dumps({"a": None}),
                json.dumps("x"),
            ],
        )
        return f"categories = {info['categories']}", RecordDict(
            {"meta": ConfigRecord({"json": json.dumps(info)})}
        )
    if kind == 3:
        info[f"extra{rng.randrange(5)}"] = JUNK[rng.randrange(len(JUNK))]
        return "an extra field", RecordDict({"meta": ConfigRecord({"json": json.dumps(info)})})
    if kind == 4:
        text = _pick(rng, ["[]", "nope", json.dumps(3), "x" * 70_000])
        return "metadata text", RecordDict({"meta": ConfigRecord({"json": text})})
    if kind == 5:
        return "a tensors record", RecordDict(
            {
                "meta": ConfigRecord({"json": json.dumps(info)}),
                "tensors": ArrayRecord(torch_state_dict={"x": torch.zeros(3, dtype=torch.complex64)}),
            }
        )
    return "not records", _pick(rng, ["text", "42"])


def test_malformed_handshakes_never_raise_and_refuse_that_node(grid_driver):
    driver, grid = grid_driver(2, 1)
    genuine = {}

    def keep(node, kind, message, content):
        if kind == "query" and node == VICTIM:
            genuine.update(meta_of(content))
        return content

    grid.tamper = keep
    assert set(driver.handshake()) == {0, 1}
    rng = random.Random("fuzz-handshake")
    bad = [None]
    grid.tamper = lambda node, kind, m, c: bad[0] if node == VICTIM and kind == "query" else c
    for i in range(120):
        what, bad[0] = _bad_handshake(rng, genuine)
        driver.bindings.nodes.pop(1, None)  # unbound: the node is asked again
        infos = driver.handshake()  # must not raise
        assert 1 not in infos and 1 not in driver.nodes, (i, what)
    assert driver.nodes == {0: 100}
