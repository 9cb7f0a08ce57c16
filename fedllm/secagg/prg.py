"""The masks of SecAgg+ from a cryptographic stream keyed by the whole shared secret.

Flower 1.42's ``pseudo_rand_gen`` folds each seed to 32 bits (XOR of its 4-byte words; a pairwise seed is
base64 text, so only 28 of them vary) and draws the mask from numpy's ``RandomState`` (Mersenne Twister):
whoever holds a site's masked vector and its pairwise secrets (a server told the site dropped after it sent
its vector, which the workflow itself does for a late vector) finds its private mask by trying the 2^32
seeds, about 2 minutes on one core (Flower issue #7522; fix proposed in #7570). Its draw also stops one
short of the field (``randint(0, M - 1)`` excludes ``M - 1``): with a modulus of 2 every mask is 0.

:func:`masks` keeps Flower's signature and replaces the generator on both ends (a fedllm site's mod and
fedllm's ServerApp workflow): ChaCha20 (the ``cryptography`` package's, which Flower itself depends on)
keyed by SHA-256 of a domain tag and the whole seed, read as 64-bit words whose low bits are the mask in the
field ``[0, M)``: exactly uniform, as fedllm's modulus is a power of two (``2^secagg.modulus_bits``, at most
2^62, so that Flower's int64 sums of masks wrap within a multiple of the field).
Nothing of the protocol changes but the stream: key agreement, secret sharing and dropout recovery stay
Flower's. Both ends must use it, or the masks do not cancel and the round's sum is refused as out of range.
"""

from __future__ import annotations

import hashlib
import importlib
import math

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

DOMAIN = b"fedllm-secagg-mask-v1\0"
# the modules of Flower 1.42 that draw masks, each holding its own name for the generator
FLOWER_MODULES = (
    "flwr.client.mod.secure_aggregation.secaggplus_mod",
    "flwr.server.workflow.secure_aggregation.secaggplus_workflow",
)


def masks(seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Masks of the given shapes, uniform over ``[0, num_range)``, from the whole ``seed`` (see the module
    docstring); int64 arrays, as Flower's generator returns."""
    if not 2 <= num_range <= 2**62 or num_range & (num_range - 1):
        raise ValueError(
            f"a mask's field of {num_range}: expected a power of two, 2 to 2^62 (fedllm's modulus)"
        )
    sizes = [math.prod(d) for d in dimensions_list]
    key = hashlib.sha256(DOMAIN + bytes(seed)).digest()
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(8 * sum(sizes))), dtype="<u8")
    words = words & np.uint64(num_range - 1)  # a power of two: the low bits, exactly uniform
    out, start = [], 0
    for dims, n in zip(dimensions_list, sizes, strict=True):
        out.append(words[start : start + n].astype(np.int64).reshape(dims))
        start += n
    return out


def install() -> None:
    """Make Flower's SecAgg+ mod and workflow draw their masks from :func:`masks` in this process."""
    for name in FLOWER_MODULES:
        importlib.import_module(name).pseudo_rand_gen = masks
