"""Every reply a site sends, parsed in one guarded place before the ServerApp uses any of it.

A site can be buggy or hostile, and on Flower its reply is a RecordDict the server did not write. Each
parser here accepts exactly what the protocol defines (the records, their kinds and their fields, their
types, their sizes) and raises :class:`BadReply` with a one-line reason otherwise; the driver makes that
the site's failure for the round (or, at the handshake, a refused site), logs it and writes it to
``metrics.jsonl``. Nothing a site sends raises out of the ServerApp. With a registry, a reply must also
carry a valid signature of the site's registered key (``fedllm/flower/signing.py``), checked first.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from fedllm.checks import one_line
from fedllm.flower.signing import verify
from fedllm.protocol import ClientUpdate, Codec, decode_update

MAX_META_CHARS = 1 << 16  # a reply's JSON metadata: ids, counts, scales and a few metrics
EVALUATION_KEYS = ("global_loss", "global_acc", "personal_loss", "personal_acc")
INFO_KEYS = {"client-id", "rank", "num-examples", "num-test", "categories"}
UPDATE_KEYS = {"client_id", "num_examples", "scales", "metrics", "round", "token"}


class BadReply(ValueError):
    """A reply the server cannot use; the message is the one-line reason."""


def _records(content: Any, expected: set[str]) -> dict[str, Any]:
    """The reply's records by name, exactly ``expected`` of them."""
    try:
        names = set(content.keys())
    except Exception:
        raise BadReply(f"the reply is a {type(content).__name__}, not a record dict") from None
    if names != expected:
        raise BadReply(f"the reply holds records {sorted(names)[:8]}, expected {sorted(expected)}")
    return {name: content[name] for name in names}


def _kind(record: Any, kind: str, name: str) -> Any:
    if type(record).__name__ != kind:
        raise BadReply(f"record {name!r} is a {type(record).__name__}, expected a {kind}")
    return record


def _meta(records: dict[str, Any]) -> tuple[dict, dict]:
    """The ``meta`` ConfigRecord: its ``json`` object and its other fields."""
    config = dict(_kind(records["meta"], "ConfigRecord", "meta"))
    text = config.pop("json", None)
    if not isinstance(text, str) or len(text) > MAX_META_CHARS:
        raise BadReply("its metadata is not a JSON text of at most 64 KB")
    try:
        meta = json.loads(text)
    except ValueError:
        raise BadReply("its metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise BadReply(f"its metadata is a JSON {type(meta).__name__}, not an object")
    return meta, config


def check_signature(records: dict[str, Any], key: bytes | None, reply_to: str) -> None:
    """With a registered key, the reply must be signed by it over its content and the message it answers."""
    if key is None:
        return
    meta = records.get("meta")
    signature = dict(meta).get("signature") if meta is not None and hasattr(meta, "keys") else None
    if not verify(key, signature, reply_to, records):
        raise BadReply("its signature does not verify with the key registered for this client")


def _int(value: Any, name: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadReply(f"{name} is {value!r}, expected an integer >= {low}")
    return value


def parse_info(content: Any) -> dict:
    """A handshake reply: who the site is and how many examples it trains on. Its signature is checked by
    the driver once the claim is known to come from the client's registered key (:func:`check_signature`)."""
    records = _records(content, {"meta"})
    info, rest = _meta(records)
    if set(rest) - {"signature"} or set(info) - INFO_KEYS:
        fields = sorted(set(info) | set(rest))[:8]
        raise BadReply(f"its handshake holds fields {fields} beyond the protocol's")
    _int(info.get("client-id"), "client-id")
    _int(info.get("num-examples"), "num-examples")
    if "rank" in info:
        _int(info["rank"], "rank", 1)
    if "num-test" in info:
        _int(info["num-test"], "num-test")
    if "categories" in info:
        try:
            cats = json.loads(info["categories"]) if isinstance(info["categories"], str) else None
        except ValueError:
            cats = None
        if not isinstance(cats, dict) or not all(isinstance(v, int) for v in cats.values()):
            raise BadReply("categories is not a JSON object of counts")
    return info


def parse_update(
    content: Any, max_bytes: int, key: bytes | None, reply_to: str, codecs: list[Codec]
) -> ClientUpdate:
    """A train reply as a ClientUpdate (its claims are then checked by the server's ``accept``): exactly a
    ``tensors`` ArrayRecord of at most ``max_bytes`` and a ``meta`` of the protocol's fields and types, plus
    the fields of the run's codecs, each decoded by its codec (what a codec needs once the driver knows the
    site's start is kept in the update's ``attachments``, for ``Codec.received``)."""
    records = _records(content, {"tensors", "meta"})
    arrays = _kind(records["tensors"], "ArrayRecord", "tensors")
    meta, rest = _meta(records)
    if set(rest) - {"signature"}:
        raise BadReply(f"its metadata holds fields {sorted(rest)[:8]} beyond the protocol's")
    keys = UPDATE_KEYS | {c.key for c in codecs}
    if set(meta) - keys or not {"client_id", "num_examples", "scales", "metrics"} <= set(meta):
        raise BadReply(f"its metadata holds {sorted(meta)[:8]}, expected {sorted(keys)}")
    _int(meta["client_id"], "client_id")
    _int(meta["num_examples"], "num_examples")
    scales, metrics = meta["scales"], meta["metrics"]
    numbers = isinstance(scales, dict) and all(
        isinstance(k, str)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and 0 < v < 1e15
        for k, v in scales.items()
    )
    if not numbers:
        raise BadReply("its scales are not a mapping of module names to finite positive numbers")
    if not isinstance(metrics, dict):
        raise BadReply("its metrics are not a mapping")
    size = 0
    for name in arrays:
        arr = arrays[name]
        data = getattr(arr, "data", None)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise BadReply(f"tensor {str(name)[:80]!r} carries no array data")
        size += len(data)
        if size > max_bytes:
            raise BadReply(f"its tensors exceed {max_bytes:,} bytes, the most its expected update can take")
    check_signature(records, key, reply_to)
    tensors = dict(arrays.to_torch_state_dict())
    for name, t in tensors.items():  # the protocol's dtypes (records.py): float32, or a codec's own
        owner = next((c for c in codecs if c.owns(name)), None)
        allowed = owner.dtypes if owner is not None else (torch.float32,)
        if t.dtype not in allowed:
            raise BadReply(f"tensor {name[:80]!r} is {t.dtype}, not {' or '.join(map(str, allowed))}")
    notes = {}
    for codec in reversed(codecs):
        try:
            tensors, meta, notes[codec.key] = codec.decode_update(tensors, meta, max_bytes)
        except ValueError as e:
            raise BadReply(one_line(str(e))) from None
    try:
        update = decode_update(tensors, meta)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BadReply(one_line(f"its tensors do not match its metadata ({type(e).__name__}: {e})")) from None
    update.attachments = {k: v for k, v in notes.items() if v is not None}
    return update


def parse_evaluation(content: Any, key: bytes | None = None, reply_to: str = "") -> dict[str, float]:
    """An evaluate reply: the site's own held-out numbers for the global and its personalized model."""
    records = _records(content, {"metrics", "meta"})
    meta, rest = _meta(records)
    if meta or set(rest) - {"signature"}:
        raise BadReply("its evaluation's metadata holds fields beyond the protocol's")
    metrics = dict(_kind(records["metrics"], "MetricRecord", "metrics"))
    unknown = sorted(set(metrics) - set(EVALUATION_KEYS))
    if unknown:
        raise BadReply(f"its evaluation holds {unknown[:8]} beyond {list(EVALUATION_KEYS)}")
    for k, v in metrics.items():
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > 1e15:
            raise BadReply(f"{k} = {v!r} is not a finite number")
    check_signature(records, key, reply_to)
    return {k: float(v) for k, v in metrics.items()}
