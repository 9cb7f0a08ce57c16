"""Blockwise quantization of tensors for the wire: float16, bfloat16, int8 and int4 with absmax scales.

Written here (about 40 lines) rather than taken from bitsandbytes: its blockwise quantizer needs its
native library (CUDA, or a CPU build that not every install has), and a federation's sites are ordinary
machines; this one runs on any torch. Each tensor is flattened and cut into blocks of ``block`` values;
a block's float32 scale is its largest magnitude, its values are rounded to ``levels`` steps of it
(int8: -127..127, int4: -7..7, two per byte). The error of a value is at most half a step: ``scale /
(2 * levels)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
LEVELS = {"int8": 127, "int4": 7}
FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EncodingError(ValueError):
    """An encoded tensor that cannot be what it says it is (sizes, scales, values out of range)."""


@dataclass
class Encoded:
    """One tensor as it travels: its format, shape, payload bytes and (integer formats) block scales."""

    fmt: str
    shape: tuple[int, ...]
    payload: Tensor  # uint8 (integer formats) or the float dtype
    scales: Tensor | None = None  # float32, one per block
    block: int = 64

    @property
    def nbytes(self) -> int:
        """The bytes on the wire: payload plus scales (the shape and format are a few bytes of header)."""
        return self.payload.numel() * self.payload.element_size() + (
            0 if self.scales is None else self.scales.numel() * 4
        )


def encode(t: Tensor, fmt: str, block: int = 64) -> Encoded:
    """``t`` as ``fmt`` carries it. A value the format cannot carry raises :class:`EncodingError` rather than
    travel as inf (a change beyond float16's 65504 would arrive as inf, and an error-feedback residual
    computed from it would poison every later upload): non-finite input, or float16 overflow."""
    t = t.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise EncodingError(f"{int((~torch.isfinite(t)).sum())} non-finite value(s) cannot travel as {fmt}")
    if fmt in FLOATS:
        payload = t.to(FLOATS[fmt]).reshape(-1)
        if not bool(torch.isfinite(payload).all()):
            raise EncodingError(
                f"a value of magnitude {float(t.abs().max()):.3g} is beyond {fmt}'s largest, "
                f"{torch.finfo(FLOATS[fmt]).max:.6g}"
            )
        return Encoded(fmt, tuple(t.shape), payload, None, block)
    if fmt not in LEVELS:
        raise ValueError(f"comm.upload = {fmt!r}: expected one of {', '.join(FORMATS)}")
    levels, n = LEVELS[fmt], t.numel()
    flat = torch.nn.functional.pad(t.reshape(-1), (0, (-n) % block)).reshape(-1, block)
    scales = flat.abs().amax(1)
    q = torch.round(flat / scales.clamp_min(1e-30)[:, None] * levels).clamp(-levels, levels).to(torch.int16)
    q = q.reshape(-1)[:n]
    if fmt == "int8":
        payload = (q + 128).to(torch.uint8)
    else:  # two 4-bit values per byte
        u = torch.nn.functional.pad(q + 8, (0, n % 2)).to(torch.uint8).reshape(-1, 2)
        payload = u[:, 0] | (u[:, 1] << 4)
    return Encoded(fmt, tuple(t.shape), payload, scales, block)


def decode(e: Encoded) -> Tensor:
    """The float32 tensor ``e`` stands for; a malformed encoding raises :class:`EncodingError`."""
    n = math.prod(e.shape)
    if e.fmt in FLOATS:
        if e.payload.dtype != FLOATS[e.fmt] or e.payload.numel() != n:
            raise EncodingError(f"{e.fmt} payload of {e.payload.numel()} values for shape {list(e.shape)}")
        return e.payload.to(torch.float32).reshape(e.shape)
    if e.fmt not in LEVELS or e.payload.dtype != torch.uint8 or e.scales is None or e.block < 1:
        raise EncodingError(
            f"format {e.fmt!r} with a {e.payload.dtype} payload and scales {e.scales is not None}"
        )
    blocks = math.ceil(n / e.block)
    if (
        e.scales.dtype != torch.float32
        or e.scales.numel() != blocks
        or not bool(torch.isfinite(e.scales).all())
        or bool((e.scales < 0).any())
    ):
        raise EncodingError(
            f"{e.scales.numel()} {e.scales.dtype} scales for {blocks} blocks: expected float32, finite, >= 0"
        )
    if e.fmt == "int8":
        if e.payload.numel() != n:
            raise EncodingError(f"int8 payload of {e.payload.numel()} bytes for {n} values")
        q = e.payload.to(torch.int16) - 128
        if bool((q.abs() > LEVELS["int8"]).any()):
            raise EncodingError("int8 values beyond -127..127")
    else:
        if e.payload.numel() != math.ceil(n / 2):
            raise EncodingError(f"int4 payload of {e.payload.numel()} bytes for {n} values")
        q = torch.stack([e.payload & 15, e.payload >> 4], 1).reshape(-1)[:n].to(torch.int16) - 8
        if bool((q.abs() > LEVELS["int4"]).any()):
            raise EncodingError("int4 values beyond -7..7")
    levels = LEVELS[e.fmt]
    padded = torch.nn.functional.pad(q.to(torch.float32), (0, blocks * e.block - n)).reshape(blocks, e.block)
    return (padded * (e.scales[:, None] / levels)).reshape(-1)[:n].reshape(e.shape)


def wire_bytes(numel: int, fmt: str, block: int = 64) -> int:
    """The encoded size of a tensor of ``numel`` values (what :attr:`Encoded.nbytes` gives)."""
    if fmt in FLOATS:
        return numel * torch.tensor([], dtype=FLOATS[fmt]).element_size()
    per = numel if fmt == "int8" else math.ceil(numel / 2)
    return per + 4 * math.ceil(numel / block)
