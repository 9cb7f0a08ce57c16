"""Fewer bytes on the wire: uploads quantized blockwise, with error feedback, as a feature in its own room.

``comm.upload`` (float32, float16, bfloat16, int8, int4) says how each client's upload travels: the change
of each tensor it uploads (LoRA factors against the ones it started from, dense modules against their
download, extras) is encoded (:mod:`fedllm.transport.codec`), and what the server takes is the decoded
change added back to the start, as the server would rebuild it from the encoded payload. With
``comm.error_feedback`` (on by default) each client keeps the quantization residual of its last upload in
its own state and adds it to the next change before encoding, so that over rounds the sum of what
arrives equals the sum of the true changes up to the last residual (Seide et al. 2014; Karimireddy et
al., ICML 2019). The ledger counts the encoded bytes (payload plus scales), computed by the server from
each upload's shapes and the run's format, not taken from what a client says.

The feature hooks the core from outside only: an upload transform on the clients (after the privacy
clip and noise, if any: what is quantized is what would travel) and the server's rule for counting
upload bytes. ``comm.download`` says how each download travels (float32 by default; encoded from the
server's exact state every round, so no error accumulates; a strategy's ``download_budget_mb`` can bound
its size). In the Flower apps the encodings themselves travel: the feature's codec (``wire.py``) is what the
Flower driver and sites call, as every driver calls the run's codecs, without asking which are on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from fedllm.factors import LoraFactors
from fedllm.options import one_of, opt, positive
from fedllm.protocol import ClientStart, ClientUpdate, Feature, UploadContext, UploadTransform
from fedllm.transport.codec import FORMATS, Encoded, EncodingError, decode, encode, wire_bytes
from fedllm.transport.wire import KEY, TransportCodec, reference, update_tensors

EF = "comm.ef."  # the client-state prefix of the error-feedback residuals


@dataclass
class TransportOptions:
    """``comm.*``: how uploads travel."""

    upload: str = opt(
        "float32",
        "how each client's upload travels: float32, float16, bfloat16, or blockwise absmax int8 / int4 "
        "(the ledger counts the encoded bytes, scales included)",
        *one_of(*FORMATS),
    )
    error_feedback: bool = opt(
        True, "clients keep each upload's quantization residual and add it to the next (int8/int4/16-bit)"
    )
    block_size: int = opt(64, "values per quantization block (one float32 scale each)", positive, ">= 1")
    download: str = opt(
        "float32",
        "how each client's download travels (its factors, dense modules, extras and algorithm state, encoded "
        "from the server's exact state every round): float32, float16, bfloat16, int8 or int4",
        *one_of(*FORMATS),
    )


def _tensors(update: ClientUpdate) -> list[Tensor]:
    out = [t for f in update.factors.values() for t in (f.A, f.B) if t.numel()]
    return out + [t for t in update.dense.values()] + [t for t in update.extras.values()]


class QuantizedUpload(UploadTransform):
    """Each uploaded change encoded and decoded as it travels (see module docstring); the encodings are
    attached to the update for the transport's codec to send (the Flower apps, ``wire.py``)."""

    def __init__(self, fmt: str, error_feedback: bool = True, block: int = 64) -> None:
        self.fmt, self.error_feedback, self.block = fmt, error_feedback, block

    def _travel(self, key: str, change: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, Encoded]:
        residual = state.get(EF + key) if self.error_feedback else None
        sent = change + residual if residual is not None and residual.shape == change.shape else change
        try:
            enc = encode(sent, self.fmt, self.block)
        except EncodingError as e:
            raise EncodingError(f"comm.upload = {self.fmt}: the change of {key}: {e}") from None
        got = decode(enc)
        if self.error_feedback:
            state[EF + key] = (sent - got).detach().clone()
        return got, enc

    def apply(self, update: ClientUpdate, ctx: UploadContext) -> ClientUpdate:
        """The update as it arrives. Its residuals are written to the client's state only once every tensor
        has encoded: an upload refused part-way (a value its format cannot carry) leaves the state as it
        was, and the client's failure for the round is that one line."""
        wire: dict[str, Encoded] = {}
        values: dict[str, Tensor] = {}
        residuals = {k: v for k, v in ctx.state.items() if k.startswith(EF)}
        for name, t in update_tensors(update).items():
            ref = reference(update, ctx.start, ctx.started, name)
            got, wire[name] = self._travel(
                _state_key(name), t.float() - ref if ref is not None else t.float(), residuals
            )
            values[name] = ref + got if ref is not None else got.to(t.dtype)
        ctx.state.update(residuals)
        factors = {}
        for k, f in update.factors.items():
            a, b = values.get(f"factors.{k}.A", f.A), values.get(f"factors.{k}.B", f.B)
            factors[k] = LoraFactors(a, b, f.scale)
        update.factors = factors
        update.dense = {k: values[f"dense.{k}"] for k in update.dense}
        update.extras = {k: values[f"extras.{k}"] for k in update.extras}
        update.attachments = {**update.attachments, KEY: wire}
        return update


def _state_key(name: str) -> str:
    """The error-feedback residual's name in the client's state: A.<module>, B.<module>, D.<dense>, E.<x>."""
    part, _, rest = name.partition(".")
    if part == "factors":
        key, kind = rest.rsplit(".", 1)
        return f"{kind}.{key}"
    return f"{'D' if part == 'dense' else 'E'}.{rest}"


def start_tensors(start: ClientStart) -> dict[str, Tensor]:
    """Every tensor of a download that a transport encodes, by message name (as ``encode_start`` names
    them); catch-up merges are refused with an encoded download (see :class:`QuantizedDownload`)."""
    out = {}
    for key, f in (start.factors or {}).items():
        for kind, t in (("A", f.A), ("B", f.B)):
            if t.numel():
                out[f"factors.{key}.{kind}"] = t
    for prefix, part in (("dense.", start.dense), ("extras.", start.extras), ("algo.", start.algo)):
        out.update({prefix + k: t for k, t in part.items() if t.numel() and t.is_floating_point()})
    return out


class QuantizedDownload:
    """Each client's download encoded as it leaves the server; the client gets the decoded values, which are
    also what the server takes as the client's start (its reference for the update that comes back).

    Encoded from the server's exact state every round: FedIT's global factors, FlexLoRA's SVD, dense
    modules, SCAFFOLD's control variate are downloaded whole each time, so an encoding's error never
    accumulates and needs no residual. A strategy that merges updates into the clients' bases (FLoRA,
    FLoRIST, FedEx-LoRA) would need one (its bases would drift from the server's by every merge's error):
    not built, refused by the config."""

    def __init__(self, fmt: str, block: int = 64) -> None:
        self.fmt, self.block = fmt, block

    def __call__(self, start: ClientStart) -> ClientStart:
        wire = {name: encode(t, self.fmt, self.block) for name, t in start_tensors(start).items()}
        got = {name: decode(e) for name, e in wire.items()}
        factors = None
        if start.factors is not None:
            factors = {
                k: LoraFactors(got.get(f"factors.{k}.A", f.A), got.get(f"factors.{k}.B", f.B), f.scale)
                for k, f in start.factors.items()
            }

        def part(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
            return {k: got[prefix + k].to(t.dtype) if prefix + k in got else t for k, t in tensors.items()}

        return replace(
            start,
            factors=factors,
            dense=part("dense.", start.dense),
            extras=part("extras.", start.extras),
            algo=part("algo.", start.algo),
            attachments={**start.attachments, KEY: wire},
        )

    def nbytes(self, start: ClientStart) -> int:
        encoded = start_tensors(start)
        rest = start.numel() - sum(t.numel() for t in encoded.values())
        return sum(wire_bytes(t.numel(), self.fmt, self.block) for t in encoded.values()) + 4 * rest


class TransportFeature(Feature):
    section = "comm"
    options = TransportOptions

    def check_config(self, o: TransportOptions, cfg) -> None:
        from fedllm.aggregation import STRATEGIES

        if o.download != "float32" and STRATEGIES[cfg.aggregation.name].merges_into_base:
            raise ValueError(
                f"comm.download = {o.download} with aggregation.name = {cfg.aggregation.name}: its clients "
                "merge every round's update into their base, where an encoding's error would accumulate "
                "(a server-side residual is not built); use comm.download=float32, or fedit, flexlora, "
                "hetlora, fedsa, ffa"
            )

    def client_state(self, o: TransportOptions, cfg) -> str:
        on = o.upload != "float32" and o.error_feedback
        return f"comm.upload = {o.upload} with comm.error_feedback = true" if on else ""

    def upload_transforms(self, o: TransportOptions, cfg) -> list:
        return [] if o.upload == "float32" else [QuantizedUpload(o.upload, o.error_feedback, o.block_size)]

    def codec(self, o: TransportOptions, cfg) -> TransportCodec | None:
        on = o.upload != "float32" or o.download != "float32"
        return TransportCodec(o.upload) if on else None

    def server_policy(self, policy, o: TransportOptions, cfg):
        if o.download != "float32":
            down = QuantizedDownload(o.download, o.block_size)
            policy.download_transform, policy.download_bytes = down, down.nbytes
        if o.upload == "float32":
            return policy

        def upload_bytes(update: ClientUpdate) -> int:
            return sum(wire_bytes(t.numel(), o.upload, o.block_size) for t in _tensors(update))

        policy.upload_bytes = upload_bytes
        return policy


TRANSPORT = TransportFeature()

__all__ = ["TRANSPORT", "QuantizedDownload", "QuantizedUpload", "TransportOptions"]
