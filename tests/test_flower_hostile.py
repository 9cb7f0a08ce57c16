"""A hostile site cannot stop the Flower ServerApp: every malformed reply of a table (handshake, train,
evaluate) is that site's failure with a one-line reason, logged and written to metrics.jsonl, while the
other sites' rounds go on; a reply signed by another site's key is refused and the real site's update used.

The ServerApp's driver runs its real round loop on a Grid that hosts real sites in this process (their
ClientApp handlers, their runtimes, their signing keys): what a SuperLink would carry, without one.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedllm.config import load_config
from fedllm.flower.records import signed
from fedllm.flower.signing import load_private_key
from tests.conftest import tiny_overrides
from tests.flower_grid import grid_driver_factory, meta_of, with_meta


@pytest.fixture
def grid_driver(tmp_path, monkeypatch, builtin_base):
    return grid_driver_factory(tmp_path, monkeypatch)


TRAIN_CASES = {
    "scales as a JSON list": lambda c: with_meta(c, scales=[1, 2]),
    "metadata that is a JSON array": lambda c: RecordDict(
        {"tensors": c["tensors"], "meta": ConfigRecord({"json": "[1, 2]"})}
    ),
    "metadata that is not JSON": lambda c: RecordDict(
        {"tensors": c["tensors"], "meta": ConfigRecord({"json": "{oops"})}
    ),
    "no tensors record": lambda c: RecordDict({"meta": c["meta"]}),
    "an extra record": lambda c: RecordDict(
        {
            "tensors": c["tensors"],
            "meta": c["meta"],
            "junk": ArrayRecord(torch_state_dict={"x": torch.zeros(600_000)}),
        }
    ),
    "tensors beyond its update's size": lambda c: RecordDict(
        {"tensors": ArrayRecord(torch_state_dict={"x": torch.zeros(3_000_000)}), "meta": c["meta"]}
    ),
    "metrics that are a string": lambda c: with_meta(c, metrics="fast"),
    "an unknown metadata field": lambda c: with_meta(c, note="hello"),
    "a tensor missing for its scales": lambda c: RecordDict(
        {"tensors": ArrayRecord(torch_state_dict={}), "meta": c["meta"]}
    ),
    "not a record dict": lambda c: ["not", "records"],
    "a record of the wrong kind": lambda c: RecordDict({"tensors": c["meta"], "meta": c["meta"]}),
    "a count of another type": lambda c: with_meta(c, num_examples="many"),
}


def test_each_malformed_train_reply_is_that_sites_failure_and_the_run_goes_on(grid_driver):
    cases = list(TRAIN_CASES.items())
    driver, grid = grid_driver(3, len(cases), False, "eval.personalized=false", "eval.every=100")

    def hostile(node, kind, message, content):
        if node == 101 and kind == "train":
            return cases[driver_round[0] - 1][1](content)
        return content

    driver_round = [0]
    run_round = driver.run_round

    def counted(r):
        driver_round[0] = r
        return run_round(r)

    driver.run_round = counted
    grid.tamper = hostile
    driver.setup()
    driver.run()
    rows = [json.loads(x) for x in (driver.run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == len(cases)
    for (name, _), row in zip(cases, rows, strict=True):
        assert row["n_updates"] == 2 and not row["skipped"], name
        reason = row["failed"]["1"]
        assert "\n" not in reason and len(reason) < 400, (name, reason)
    summary = json.loads((driver.run_dir / "summary.json").read_text())
    assert summary["failed_client_calls"] == len(cases)


HANDSHAKE_CASES = {
    "an empty record dict": lambda c: RecordDict({}),
    "metadata that is not JSON": lambda c: RecordDict({"meta": ConfigRecord({"json": "nope"})}),
    "no client id": lambda c: RecordDict({"meta": ConfigRecord({"json": json.dumps({"num-examples": 3})})}),
    "a negative count": lambda c: RecordDict(
        {"meta": ConfigRecord({"json": json.dumps({"client-id": 1, "num-examples": -4})})}
    ),
    "fields beyond the protocol's": lambda c: RecordDict(
        {"meta": ConfigRecord({"json": json.dumps({"client-id": 1, "num-examples": 4, "x": 1})})}
    ),
    "categories that are not counts": lambda c: RecordDict(
        {"meta": ConfigRecord({"json": json.dumps({"client-id": 1, "num-examples": 4, "categories": "{["})})}
    ),
    "tensors in a handshake": lambda c: RecordDict(
        {"meta": c["meta"], "tensors": ArrayRecord(torch_state_dict={"x": torch.zeros(3)})}
    ),
}


@pytest.mark.parametrize("case", sorted(HANDSHAKE_CASES))
def test_a_malformed_handshake_refuses_that_node_only(grid_driver, case, caplog):
    driver, grid = grid_driver(2, 1)
    grid.tamper = lambda node, kind, m, c: HANDSHAKE_CASES[case](c) if node == 101 and kind == "query" else c
    infos = driver.handshake()
    assert set(infos) == {0}
    assert "node 101 sent an unusable handshake" in caplog.text


def test_malformed_evaluations_are_left_out(grid_driver):
    """A site's personalized evaluation with unknown fields or non-finite numbers is left out (logged);
    the others' are kept."""
    driver, grid = grid_driver(3, 1, False, "eval.personalized=true")

    def bad_eval(node, kind, m, c):
        if kind == "evaluate" and node == 102:
            return RecordDict({"metrics": MetricRecord({"global_acc": float("inf")}), "meta": c["meta"]})
        if kind == "evaluate" and node == 101:
            return RecordDict({"metrics": MetricRecord({"secret": 1.0}), "meta": c["meta"]})
        return c

    grid.tamper = bad_eval
    driver.setup()
    driver.run()
    rows = [json.loads(x) for x in (driver.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["personal"]) == {"0"}


def test_a_reply_signed_by_another_sites_key_is_refused_and_the_real_update_used(grid_driver, caplog):
    """Site 1 answers site 0's message first (site 0's content, re-signed with site 1's key, as a site that
    could push a reply in another's name would): refused by signature; site 0 is asked again and its own
    update is the one used."""
    driver, grid = grid_driver(2, 1, True, "eval.personalized=false")
    other = load_private_key(grid.keys[1])
    forged = []

    def forge(node, kind, message, content):
        if kind == "train" and node == 100 and not forged:
            forged.append(message.metadata.message_id)
            content["meta"]["signature"] = ""
            return signed(content, other, message.metadata.message_id)
        return content

    grid.tamper = forge
    driver.setup()
    driver.run()
    rows = [json.loads(x) for x in (driver.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert forged and rows[1]["n_updates"] == 2 and not rows[1]["failed"]
    assert "asking clients [0] again after a reply that failed its signature" in caplog.text
    assert torch.isfinite(torch.tensor(rows[1]["train_loss"]))


def test_what_leaves_a_site_is_what_the_docs_list_and_sites_get_no_operator_path(grid_driver):
    """Every field of every reply the ServerApp receives is one the docs list (docs/deployment.md, "What
    leaves a site", checked against the parser's tables), and the config the sites receive names no path of
    the operator's (its run folder, its registry)."""
    from fedllm.config import config_from_text
    from fedllm.flower.replies import EVALUATION_KEYS, INFO_KEYS, UPDATE_KEYS

    driver, grid = grid_driver(2, 1, False, "eval.personalized=true", "flower.share_data_stats=true")
    seen: dict[str, set] = {"query": set(), "train": set(), "evaluate": set(), "tensors": set()}
    configs = []

    def record(node, kind, message, content):
        configs.append(dict(message.content["meta"]).get("config"))
        if kind == "evaluate":
            seen[kind] |= set(dict(content["metrics"]))
        else:
            seen[kind] |= set(meta_of(content))
        if kind == "train":
            seen["tensors"] |= {name.split(".")[0] for name in content["tensors"]}
        return content

    grid.tamper = record
    driver.setup()
    driver.run()
    assert seen["query"] <= INFO_KEYS and seen["train"] <= UPDATE_KEYS
    assert seen["evaluate"] <= set(EVALUATION_KEYS) and seen["tensors"] <= {"factors", "dense", "extras"}
    assert {"client-id", "rank", "num-examples", "num-test", "categories"} == seen["query"]
    for text in filter(None, configs):
        cfg = config_from_text(text)
        assert cfg.output.dir == "" and cfg.flower.registry == ""


def _tensors(content) -> dict[str, torch.Tensor]:
    return dict(content["tensors"].to_torch_state_dict())


def _with_tensors(content, tensors) -> RecordDict:
    return RecordDict({"tensors": ArrayRecord(torch_state_dict=tensors), "meta": content["meta"]})


@pytest.mark.slow
@pytest.mark.parametrize("download", ["float32", "int8"])
def test_int8_uploads_travel_encoded_and_give_the_simulations_result(grid_driver, tmp_path, download):
    """A site's reply carries the int8 payloads and float32 scales of its changes, no float32 copy of them,
    and the server's rebuild of them gives the run the in-process simulation gives (same transport); with
    comm.download=int8 the server's train messages carry encoded payloads too."""
    from fedllm.simulation import Simulation
    from tests.conftest import assert_close_updates

    # one clip on both sides (auto: 0 in the in-process simulation, 2 on Flower)
    extra = (
        "comm.upload=int8",
        f"comm.download={download}",
        "eval.personalized=false",
        "aggregation.clip_norm_ratio=2",
    )
    driver, grid = grid_driver(3, 2, False, *extra)
    replies, starts = [], []

    def keep(node, kind, message, content):
        if kind == "train":
            replies.append(content)
            starts.append(message.content)
        return content

    grid.tamper = keep
    driver.setup()
    driver.run()
    t = _tensors(replies[-1])
    payloads = {k: v for k, v in t.items() if k.endswith(".payload")}
    assert payloads and all(v.dtype == torch.uint8 for v in payloads.values())
    assert all(v.dtype == torch.float32 for k, v in t.items() if k.endswith(".scales"))
    plain = [k for k, v in t.items() if not k.startswith("wire.") and v.numel()]
    assert not plain, plain  # every non-empty tensor travels encoded
    shapes = meta_of(replies[-1])["wire"]["shapes"]
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    sent = sum(v.numel() * v.element_size() for v in t.values())
    assert sent <= 0.27 * 4 * numel  # payload plus scales: the ledger's int8 bytes, not float32's
    sent_down = _tensors(starts[-1])
    encoded_down = [k for k in sent_down if k.endswith(".payload")]
    assert bool(encoded_down) == (download == "int8")
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "sim",
            "federation.num_clients=3",
            "federation.rounds=2",
            "flower.share_token_modules=true",
            *extra,
        ),
    )
    sim = Simulation(cfg, tmp_path / "sim")
    sim.setup()
    sim.run()
    assert_close_updates(tmp_path / "sim", driver.run_dir, 1e-4)


def _corrupt_int8(content):
    t = _tensors(content)
    name = next(k for k in t if k.endswith(".payload"))
    t[name] = t[name].clone()
    t[name][0] = 0  # -128: outside int8's -127..127
    return _with_tensors(content, t)


def _drop_scales(content):
    t = _tensors(content)
    del t[next(k for k in t if k.endswith(".scales"))]
    return _with_tensors(content, t)


def _float32_instead(content):
    t = {k: v for k, v in _tensors(content).items() if not k.startswith("wire.")}
    meta = meta_of(content)
    for name, shape in meta.pop("wire")["shapes"].items():
        t[name] = torch.zeros(shape)
    return RecordDict(
        {"tensors": ArrayRecord(torch_state_dict=t), "meta": ConfigRecord({"json": json.dumps(meta)})}
    )


WIRE_CASES = {
    "an int8 value outside -127..127": (_corrupt_int8, "malformed"),
    "a block without its scale": (_drop_scales, "malformed"),
    "another format than the run's": (
        lambda c: with_meta(c, wire={**meta_of(c)["wire"], "fmt": "int4"}),
        "malformed",
    ),
    "a shape its payload does not fill": (
        lambda c: with_meta(
            c,
            wire={
                **meta_of(c)["wire"],
                "shapes": {k: [s[0] * 2, *s[1:]] for k, s in meta_of(c)["wire"]["shapes"].items()},
            },
        ),
        "malformed",
    ),
    "float32 where the run encodes": (_float32_instead, "not encoded as comm.upload = int8"),
}


def test_a_corrupted_encoding_is_that_sites_failure_without_a_traceback(grid_driver, caplog):
    cases = list(WIRE_CASES.items())
    driver, grid = grid_driver(
        3, len(cases), False, "comm.upload=int8", "eval.personalized=false", "eval.every=100"
    )
    rounds = [0]
    run_round = driver.run_round

    def counted(r):
        rounds[0] = r
        return run_round(r)

    driver.run_round = counted
    grid.tamper = lambda node, kind, m, c: (
        cases[rounds[0] - 1][1][0](c) if node == 101 and kind == "train" else c
    )
    driver.setup()
    driver.run()
    rows = [json.loads(x) for x in (driver.run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    for (name, (_, reason)), row in zip(cases, rows, strict=True):
        assert row["n_updates"] == 2 and not row["skipped"], name
        assert reason in row["failed"]["1"] and "\n" not in row["failed"]["1"], (name, row["failed"])
    assert "Traceback" not in caplog.text


def test_each_round_counts_the_bytes_its_train_messages_take_on_flower(grid_driver):
    """The ledger counts the tensors (int8 payloads and scales); a Flower message also carries each array's
    NumPy header, the names, the metadata and the config. The row's flower_up_bytes / flower_down_bytes are
    the serialized records' sizes, so they exceed the ledger's by at least a header per array."""
    from flwr.common.serde import recorddict_to_proto

    driver, grid = grid_driver(2, 1, False, "comm.upload=int8", "eval.personalized=false")
    sent, replies = [], []

    def keep(node, kind, message, content):
        if kind == "train":
            sent.append(message.content)
            replies.append(content)
        return content

    grid.tamper = keep
    driver.setup()
    driver.run()
    row = [json.loads(x) for x in (driver.run_dir / "metrics.jsonl").read_text().splitlines()][1]
    assert row["flower_up_bytes"] == sum(recorddict_to_proto(r).ByteSize() for r in replies)
    assert row["flower_down_bytes"] == sum(recorddict_to_proto(m).ByteSize() for m in sent)
    arrays = sum(len(list(r["tensors"])) for r in replies)
    assert row["flower_up_bytes"] >= row["up_bytes"] + 64 * arrays  # a NumPy header per array, at least
    payload = sum(len(r["tensors"][k].data) for r in replies for k in r["tensors"])
    assert payload >= row["up_bytes"] and payload - row["up_bytes"] <= 256 * arrays


def _encoded_instead(content):
    """A float32 reply re-sent with each factor encoded as int8 (what a site whose run does not encode
    uploads might send)."""
    from fedllm.transport.codec import encode
    from fedllm.transport.wire import to_wire

    t, meta = _tensors(content), meta_of(content)
    wire = {k: encode(v, "int8", 64) for k, v in t.items() if k.startswith("factors.") and v.numel()}
    t, meta = to_wire({k: v for k, v in t.items() if k not in wire}, meta, wire)
    return RecordDict(
        {"tensors": ArrayRecord(torch_state_dict=t), "meta": ConfigRecord({"json": json.dumps(meta)})}
    )


@pytest.mark.parametrize(
    ("download", "reason"),
    [
        ("float32", "its metadata holds"),  # no codec in the run: its field is not the protocol's
        ("int8", "its upload is encoded, but comm.upload = float32"),  # the codec is on for downloads only
    ],
)
def test_an_encoded_upload_where_the_run_sends_float32_is_refused(grid_driver, caplog, download, reason):
    driver, grid = grid_driver(
        3, 1, False, f"comm.download={download}", "eval.personalized=false", "eval.every=100"
    )
    grid.tamper = lambda node, kind, m, c: _encoded_instead(c) if node == 101 and kind == "train" else c
    driver.setup()
    driver.run()
    row = json.loads((driver.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["n_updates"] == 2 and not row["skipped"]
    assert reason in row["failed"]["1"] and "\n" not in row["failed"]["1"], row["failed"]
    assert "Traceback" not in caplog.text


def test_a_personalized_evaluation_under_encoded_downloads_scores_the_servers_model(grid_driver):
    """comm.download=int8 encodes the train messages; the evaluate messages carry the global model as the
    server holds it (float32, no codec field: the simulation scores that same model), and the sites, whose
    codecs decode encoded starts, read it as it is."""
    driver, grid = grid_driver(2, 1, False, "comm.download=int8", "eval.every=1")
    sent = []
    grid.tamper = lambda node, kind, m, c: (sent.append((kind, m.content)), c)[1]
    driver.setup()
    driver.run()
    evaluations = [content for kind, content in sent if kind == "evaluate"]
    assert evaluations and not any("wire" in meta_of(c) for c in evaluations)
    assert all(v.dtype == torch.float32 for c in evaluations for v in _tensors(c).values())
    row = json.loads((driver.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert set(row["personal"]) == {"0", "1"}
    assert all(0 <= r["personal_acc"] <= 1 for r in row["personal"].values())
