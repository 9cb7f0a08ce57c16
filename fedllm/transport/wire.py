"""Encoded uploads on a real wire (the Flower apps): what a site sends and how the server rebuilds it.

In the simulation :class:`~fedllm.transport.QuantizedUpload` encodes each uploaded change and decodes it
at once. Across organizations the encoded change itself travels: a site's reply carries, for each tensor
its transport encodes, the payload (uint8 bytes: int8 values, int4 pairs, or the 16-bit floats' bytes)
and the float32 block scales in place of the float32 tensor, with the format, block size and shape in its
metadata. The server decodes them (a malformed encoding is that site's failure for the round, with the
codec's reason) and adds each change to the reference it knows the site started from, the one the site
subtracted: its download's factors (or the round's fresh init, which the server derives from the seed
as the site does), its dense modules, its extras. So what the server aggregates is what the simulation
aggregates with the same transport. The ledger counts the tensors' bytes (payloads and scales); a Flower
message also carries each array's NumPy header (about 128 bytes), the names, the JSON metadata and the
config, which the ServerApp counts apart as the serialized records' size (``flower_up_bytes``,
``flower_down_bytes`` in each round's row).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedllm.factors import Adapter, LoraFactors
from fedllm.protocol import ClientStart, ClientUpdate, Codec, leading_block
from fedllm.transport.codec import FLOATS, FORMATS, Encoded, EncodingError, decode

KEY = "wire"  # the metadata field, the attachments' key, and the prefix of the payload tensors
WIRE = KEY + "."  # message tensors of encoded payloads: wire.<name>.payload / wire.<name>.scales


def reference(update: ClientUpdate, start: ClientStart, started: Adapter, name: str) -> Tensor | None:
    """What the change of message tensor ``name`` is measured from (None: from zero), the same on the client
    (``started``: the factors it trained from) and on the server (its own derivation of them)."""
    part, _, rest = name.partition(".")
    if part == "factors":
        key, kind = rest.rsplit(".", 1)
        f = update.factors[key]
        if key not in started:
            return None
        ref = started[key].with_scale(f.scale)
        return ref.A if kind == "A" else ref.B
    if part == "dense":
        return start.dense.get(rest)
    value = update.extras[rest]
    ref = start.extras.get(rest)
    ref = None if ref is None else leading_block(ref, value)  # Fed-SB: a rank-r_k client's block of R
    return ref if ref is not None and ref.shape == value.shape else None


def update_tensors(update: ClientUpdate) -> dict[str, Tensor]:
    """Every tensor of ``update`` that a transport encodes, by message name (empty factors travel as is)."""
    out = {}
    for key, f in update.factors.items():
        for kind, t in (("A", f.A), ("B", f.B)):
            if isinstance(f, LoraFactors) and t.numel():
                out[f"factors.{key}.{kind}"] = t
    out.update({f"dense.{k}": t for k, t in update.dense.items()})
    out.update({f"extras.{k}": t for k, t in update.extras.items()})
    return out


def to_wire(
    tensors: dict[str, Tensor], meta: dict, wire: dict[str, Encoded]
) -> tuple[dict[str, Tensor], dict]:
    """A reply's tensors with each encoded one replaced by its payload bytes and scales (``meta['wire']``
    says how to read them)."""
    out = {k: v for k, v in tensors.items() if k not in wire}
    shapes, fmt, block = {}, None, None
    for name, e in wire.items():
        fmt, block = e.fmt, e.block
        out[f"{WIRE}{name}.payload"] = e.payload.contiguous().view(torch.uint8)
        if e.scales is not None:
            out[f"{WIRE}{name}.scales"] = e.scales.contiguous()
        shapes[name] = list(e.shape)
    return out, {**meta, "wire": {"fmt": fmt, "block": block, "shapes": shapes}}


def from_wire(tensors: dict[str, Tensor], wire: Any, max_numel: int) -> tuple[dict[str, Tensor], list[str]]:
    """The reply's tensors with every encoded one decoded to its change, and their names. Anything that does
    not decode to what the metadata says raises ValueError with the reason (the site's failure)."""
    if not isinstance(wire, dict) or set(wire) != {"fmt", "block", "shapes"}:
        raise ValueError("its wire metadata is not {fmt, block, shapes}")
    fmt, block, shapes = wire["fmt"], wire["block"], wire["shapes"]
    if fmt not in FORMATS or fmt == "float32":
        raise ValueError(f"its wire format {str(fmt)[:20]!r} is not one of {', '.join(FORMATS[1:])}")
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= 1 << 20:
        raise ValueError(f"its block size {block!r} is not an integer in 1..2^20")
    if not isinstance(shapes, dict) or not shapes:
        raise ValueError("its wire shapes are not a mapping that names the tensors it encodes")
    out = {k: v for k, v in tensors.items() if not k.startswith(WIRE)}
    names = []
    for name, shape in shapes.items():
        ok = isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        if not ok or not isinstance(name, str) or math.prod(shape) > max_numel:
            raise ValueError(f"its wire shape of {str(name)[:80]!r} is not a list of sizes within its update")
        payload = tensors.get(f"{WIRE}{name}.payload")
        if payload is None or payload.dtype != torch.uint8 or name in out:
            raise ValueError(f"its encoded {name[:80]!r} has no uint8 payload (or also travels unencoded)")
        if fmt in FLOATS:
            if payload.numel() % 2 or payload.dim() != 1:
                raise ValueError(
                    f"its {fmt} payload of {name[:80]!r} is not a row of an even number of bytes"
                )
            enc = Encoded(fmt, tuple(shape), payload.contiguous().view(FLOATS[fmt]), None, block)
        else:
            enc = Encoded(fmt, tuple(shape), payload, tensors.get(f"{WIRE}{name}.scales"), block)
        try:
            out[name] = decode(enc)
        except EncodingError as e:
            raise ValueError(f"its encoded {name[:80]!r} is malformed: {e}") from None
        names.append(name)
    extra = sorted(
        k for k in tensors if k.startswith(WIRE) and k.rsplit(".", 1)[0][len(WIRE) :] not in shapes
    )
    if extra:
        raise ValueError(f"its payloads {extra[:4]} are named in no wire shape")
    return out, names


def rebuild(update: ClientUpdate, changed: list[str], start: ClientStart, started: Adapter) -> ClientUpdate:
    """``update`` whose tensors ``changed`` hold decoded changes, with each change added to its reference
    (the server's own derivation of what the site started from). A change whose shape is not its
    reference's (encoded against another rank) raises ValueError: the site's failure."""

    def added(name: str, ref: Tensor | None, change: Tensor) -> Tensor:
        if ref is None:
            return change
        if ref.shape != change.shape:
            raise ValueError(
                f"its change of {name[:80]!r} has shape {list(change.shape)}, its reference {list(ref.shape)}"
            )
        return ref + change

    for name in changed:
        part, _, rest = name.partition(".")
        if part == "factors":
            key, kind = rest.rsplit(".", 1)
            f = update.factors[key]
            value = added(name, reference(update, start, started, name), getattr(f, kind))
            update.factors[key] = (
                LoraFactors(value, f.B, f.scale) if kind == "A" else LoraFactors(f.A, value, f.scale)
            )
        else:
            table = update.dense if part == "dense" else update.extras
            table[rest] = added(name, reference(update, start, started, name), table[rest])
    return update


class TransportCodec(Codec):
    """The transport's wire format (``Feature.codec``): the encodings a download or an upload carries
    (attached by :class:`~fedllm.transport.QuantizedDownload` / :class:`~fedllm.transport.QuantizedUpload`)
    travel as payload bytes and scales; the server decodes an upload's changes and adds each to its own
    reference. An upload not encoded as ``comm.upload`` says is refused (the site's failure)."""

    key = KEY
    dtypes = (torch.uint8, torch.float32)

    def __init__(self, upload: str) -> None:
        self.upload = upload

    def encode_start(self, start: ClientStart, tensors: dict, meta: dict) -> tuple[dict, dict]:
        wire = start.attachments.get(KEY)
        return to_wire(tensors, meta, wire) if wire else (tensors, meta)

    def decode_start(self, tensors: dict, meta: dict) -> tuple[dict, dict]:
        meta = dict(meta)
        wire = meta.pop(KEY, None)
        if wire is None:
            return tensors, meta
        tensors, _ = from_wire(tensors, wire, 1 << 40)  # the server took the same values as the start
        return tensors, meta

    def encode_update(self, update: ClientUpdate, tensors: dict, meta: dict) -> tuple[dict, dict]:
        wire = update.attachments.get(KEY)
        return to_wire(tensors, meta, wire) if wire else (tensors, meta)

    def decode_update(self, tensors: dict, meta: dict, max_numel: int) -> tuple[dict, dict, Any]:
        meta = dict(meta)
        wire = meta.pop(KEY, None)
        if wire is None:
            return tensors, meta, None
        tensors, changed = from_wire(tensors, wire, max_numel)
        return tensors, meta, {"changed": changed, "fmt": wire["fmt"]}

    def received(self, update: ClientUpdate, start: ClientStart, started: Adapter) -> ClientUpdate:
        note = update.attachments.pop(KEY, None) or {}
        changed = note.get("changed", [])
        if self.upload == "float32" and changed:
            raise ValueError("its upload is encoded, but comm.upload = float32")
        if self.upload != "float32" and (not changed or note.get("fmt") != self.upload):
            raise ValueError(f"its upload is not encoded as comm.upload = {self.upload} says")
        if not changed:
            return update
        try:
            return rebuild(update, changed, start, started)
        except (KeyError, ValueError) as e:
            raise ValueError(f"its encoded changes do not fit what it started from ({e})") from None


__all__ = ["KEY", "TransportCodec", "from_wire", "rebuild", "reference", "to_wire", "update_tensors"]
