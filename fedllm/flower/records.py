"""fedllm's messages as Flower records: tensors in an ArrayRecord, metadata as JSON in a ConfigRecord.

Every tensor travels as float32 (an ArrayRecord cannot hold bfloat16), except the tensors a feature's
codec adds (``Feature.codec``: e.g. a quantized transport's payload bytes and scales), which keep their
dtype. A start and an update go through the protocol's encoding, then each of the run's codecs in order;
they are read back in reverse (the codecs are a required argument: a forgotten one would send plain
float32 unnoticed). Each start message (train and evaluate) also carries the run's resolved config, so
every site works with the server's settings.
"""

from __future__ import annotations

import json

import torch

from fedllm.protocol import (
    ClientStart,
    ClientUpdate,
    Codec,
    decode_start,
    encode_start,
    encode_update,
)


def _record(tensors: dict[str, torch.Tensor], meta: dict, codecs: list[Codec], **config):
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    def kept(name: str) -> bool:  # a codec's own tensors (encoded payloads) keep their dtype
        return any(c.owns(name) for c in codecs)

    arrays = ArrayRecord(
        torch_state_dict={
            k: v.detach().to("cpu") if kept(k) else v.detach().to("cpu", torch.float32)
            for k, v in tensors.items()
        }
    )
    return RecordDict({"tensors": arrays, "meta": ConfigRecord({"json": json.dumps(meta), **config})})


def _parts(content) -> tuple[dict[str, torch.Tensor], dict, dict]:
    tensors = dict(content["tensors"].to_torch_state_dict()) if "tensors" in content else {}
    config = dict(content["meta"])
    return tensors, json.loads(config.pop("json")), config


def start_record(start: ClientStart, config_text: str, client_id: int, codecs: list[Codec]):
    """What the server sends a site: its start as the run's codecs send it, the run's config and its
    client id."""
    tensors, meta = encode_start(start)
    for codec in codecs:
        tensors, meta = codec.encode_start(start, tensors, meta)
    return _record(tensors, meta, codecs, config=config_text, **{"client-id": client_id})


def start_config(content) -> tuple[str, int]:
    """The run's config and the client id a start message carries (what a site needs to know its codecs
    before it reads the start itself)."""
    config = dict(content["meta"])
    return str(config["config"]), int(config["client-id"])


def read_start(content, codecs: list[Codec]) -> ClientStart:
    """A start message as the server built it, each codec's encoding read back in reverse order."""
    tensors, meta, _ = _parts(content)
    for codec in reversed(codecs):
        tensors, meta = codec.decode_start(tensors, meta)
    return decode_start(tensors, meta)


def update_record(update: ClientUpdate, codecs: list[Codec]):
    """A site's train reply: its update's tensors as the run's codecs send them (e.g. a quantized change's
    payload and scales), the rest as float32."""
    tensors, meta = encode_update(update)
    for codec in codecs:
        tensors, meta = codec.encode_update(update, tensors, meta)
    return _record(tensors, meta, codecs)


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
