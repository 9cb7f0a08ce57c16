"""fedllm's messages as Flower records: tensors in an ArrayRecord, metadata as JSON in a ConfigRecord.

Every tensor travels as float32 (an ArrayRecord cannot hold bfloat16), except a quantized upload's
encoded changes, which travel as their payload bytes and scales (``fedllm/transport/wire.py``); and
each message also carries the run's resolved config, so every site trains
with the server's settings.
"""

from __future__ import annotations

import json

import torch

from fedllm.protocol import (
    ClientStart,
    ClientUpdate,
    decode_start,
    encode_start,
    encode_update,
)


def _record(tensors: dict[str, torch.Tensor], meta: dict, **config):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from fedllm.transport.wire import WIRE

    arrays = ArrayRecord(  # encoded payloads (fedllm/transport/wire.py) keep their bytes
        torch_state_dict={
            k: v.detach().to("cpu") if k.startswith(WIRE) else v.detach().to("cpu", torch.float32)
            for k, v in tensors.items()
        }
    )
    return RecordDict({"tensors": arrays, "meta": ConfigRecord({"json": json.dumps(meta), **config})})


def _parts(content) -> tuple[dict[str, torch.Tensor], dict, dict]:
    tensors = dict(content["tensors"].to_torch_state_dict()) if "tensors" in content else {}
    config = dict(content["meta"])
    return tensors, json.loads(config.pop("json")), config


def start_record(start: ClientStart, config_text: str, client_id: int):
    """What the server sends a site: its start (encoded where ``comm.download`` encodes it), the run's config
    and its client id."""
    tensors, meta = encode_start(start)
    if start.wire:
        from fedllm.transport.wire import to_wire

        tensors, meta = to_wire(tensors, meta, start.wire)
    return _record(tensors, meta, config=config_text, **{"client-id": client_id})


def read_start(content) -> tuple[ClientStart, str, int]:
    tensors, meta, config = _parts(content)
    wire = meta.pop("wire", None)
    if wire is not None:  # an encoded download: its values decoded (the server took the same as the start)
        from fedllm.transport.wire import from_wire

        tensors, _ = from_wire(tensors, wire, 1 << 40)
    return decode_start(tensors, meta), config["config"], int(config["client-id"])


def update_record(update: ClientUpdate):
    """A site's train reply: its update's tensors, each one its transport encodes as the encoded change
    (payload and scales, ``comm.upload``), the rest as float32."""
    tensors, meta = encode_update(update)
    if update.wire:
        from fedllm.transport.wire import to_wire

        tensors, meta = to_wire(tensors, meta, update.wire)
    return _record(tensors, meta)


def evaluation_record(metrics: dict[str, float]):
    """A site's evaluation reply: its numbers, and a metadata record for its signature."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    return RecordDict({"metrics": MetricRecord(metrics), "meta": ConfigRecord({"json": "{}"})})


def record_bytes(content) -> int:
    """The bytes a message's content takes serialized as Flower sends it (its protobuf): the arrays' data
    with each one's NumPy header (about 128 bytes), their names, the JSON metadata and the config; 0 for
    content that is not a record dict (a malformed reply)."""
    from flwr.app import RecordDict
    from flwr.common.serde import recorddict_to_proto

    if not isinstance(content, RecordDict):
        return 0
    try:
        return int(recorddict_to_proto(content).ByteSize())
    except Exception:  # content Flower itself could not serialize never travelled as such
        return 0


def signed(records, key, reply_to: str):
    """``records`` with a site's signature (``fedllm/flower/signing.py``) in its ``meta`` record; as they
    are without a key (a plain deployment)."""
    if key is not None:
        from fedllm.flower.signing import sign

        records["meta"]["signature"] = sign(key, reply_to, records)
    return records


def info_record(info: dict, config_text: str | None = None):
    """A handshake: the server's query (the config) or a site's reply (who it is, how much it trains on)."""
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict(
        {"meta": ConfigRecord({"json": json.dumps(info), **({"config": config_text} if config_text else {})})}
    )


def read_info(content) -> tuple[dict, str | None]:
    config = dict(content["meta"])
    return json.loads(config["json"]), config.get("config")
