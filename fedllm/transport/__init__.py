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
upload bytes. Downloads travel in float32 (FLoRIST can bound them:
``aggregation.florist.download_budget_mb``). In the Flower apps uploads still travel as float32
arrays of the decoded values: the encoded payload is not built there yet (the simulation counts its
bytes as if it were).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedllm.factors import LoraFactors
from fedllm.options import one_of, opt, positive
from fedllm.protocol import ClientUpdate, Feature, UploadContext, UploadTransform
from fedllm.transport.codec import FORMATS, decode, encode, wire_bytes

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


def _tensors(update: ClientUpdate) -> list[Tensor]:
    out = [t for f in update.factors.values() for t in (f.A, f.B) if t.numel()]
    return out + [t for t in update.dense.values()] + [t for t in update.extras.values()]


class QuantizedUpload(UploadTransform):
    """Each uploaded change encoded and decoded as it travels (see module docstring)."""

    def __init__(self, fmt: str, error_feedback: bool = True, block: int = 64) -> None:
        self.fmt, self.error_feedback, self.block = fmt, error_feedback, block

    def _travel(self, key: str, change: Tensor, state: dict[str, Tensor]) -> Tensor:
        residual = state.get(EF + key) if self.error_feedback else None
        sent = change + residual if residual is not None and residual.shape == change.shape else change
        got = decode(encode(sent, self.fmt, self.block))
        if self.error_feedback:
            state[EF + key] = (sent - got).detach().clone()
        return got

    def apply(self, update: ClientUpdate, ctx: UploadContext) -> ClientUpdate:
        start, started, state = ctx.start, ctx.started, ctx.state
        factors = {}
        for k, f in update.factors.items():
            ref = started[k].with_scale(f.scale) if k in started else LoraFactors(0 * f.A, 0 * f.B, f.scale)
            a = ref.A + self._travel(f"A.{k}", f.A - ref.A, state) if f.A.numel() else f.A
            b = ref.B + self._travel(f"B.{k}", f.B - ref.B, state) if f.B.numel() else f.B
            factors[k] = LoraFactors(a, b, f.scale)
        update.factors = factors
        update.dense = {
            k: start.dense[k] + self._travel(f"D.{k}", t - start.dense[k], state)
            if k in start.dense
            else self._travel(f"D.{k}", t, state)
            for k, t in update.dense.items()
        }
        update.extras = {
            k: start.extras[k] + self._travel(f"E.{k}", t - start.extras[k], state)
            if k in start.extras and start.extras[k].shape == t.shape
            else self._travel(f"E.{k}", t.float(), state).to(t.dtype)
            for k, t in update.extras.items()
        }
        return update


class TransportFeature(Feature):
    section = "comm"
    options = TransportOptions

    def upload_transforms(self, o: TransportOptions, cfg) -> list:
        return [] if o.upload == "float32" else [QuantizedUpload(o.upload, o.error_feedback, o.block_size)]

    def server_rules(self, rules, o: TransportOptions, cfg):
        if o.upload == "float32":
            return rules

        def upload_bytes(update: ClientUpdate) -> int:
            return sum(wire_bytes(t.numel(), o.upload, o.block_size) for t in _tensors(update))

        rules.upload_bytes = upload_bytes
        return rules


TRANSPORT = TransportFeature()

__all__ = ["TRANSPORT", "QuantizedUpload", "TransportOptions"]
