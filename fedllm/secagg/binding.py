"""SecAgg+'s keys bound to the sites' identities, and the survivors' consistency round (Bell et al. 2020).

Flower 1.42's SecAgg+ relays every site's public keys through the server unauthenticated: a server that hands
a site its own keys in place of its real neighbours' reads every share that site sends them (its mask seed's
and its secret key's), and so its whole update. And a server may show different sites different survivor
lists, each consistent on its own. fedllm's sites close both, with the keys they already have: the node key
each site signs its replies with (``--node-config sign-key=PATH``) and the federation's registry of those
keys (``--node-config registry=PATH``: lines ``client-id: public key``, the file the server's
``flower.registry`` reads, handed to every site by the federation, not by the server).

* **Keys**: a site's setup reply carries its client id and an ECDSA signature, by its node key, over its
  two SecAgg+ public keys, its node id and the run; fedllm's ServerApp relays each neighbour's beside its
  keys in the share-keys message; a site with a registry checks every neighbour's against the key the
  registry holds for the client claimed, each client at most once, before it shares anything.
* **Survivors**: before the unmask stage fedllm's ServerApp sends each survivor the list of survivors; each
  signs it (with the digest of the round's keys it checked, so a signature counts for this round only) and
  signs one list per round; the unmask message carries the signatures, and a site answers only a list it
  signed itself and at least the threshold of registered neighbours signed too. Two different lists cannot
  each gather a strict majority of signatures from sites that sign once.

The signatures are the ``cryptography`` package's ECDSA (SHA-256), as fedllm's signed replies; nothing here
is home-made but the digests' layout.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

PREFIX = (
    "fedllm-"  # fedllm's own entries in Flower's protocol records (removed before Flower's mod reads one)
)
SIGNATURE, CLIENT = "fedllm-keys-signature", "fedllm-client"  # in a site's setup reply
NEIGHBOUR_SIGNATURE, NEIGHBOUR_CLIENT = "fedllm-sig:", "fedllm-client:"  # + node id, in share-keys
CONSISTENCY = "fedllm-consistency"  # the stage fedllm adds between collect and unmask
SURVIVORS, SURVIVORS_SIGNATURE = "fedllm-survivors", "fedllm-survivors-signature"
SIGNERS, SIGNATURES = "fedllm-signers", "fedllm-signatures"  # in the unmask message
START, LAYOUT = "fedllm-start", "fedllm-layout"  # what a site's FitIns config carries
# the round statement (fedllm/secagg/agreement.py): its stage, the full-rank state it carries, a site's
# signature in its reply, and every site's in the collect message
STATEMENT = "fedllm-agreement"
GLOBAL = "fedllm-global"
STATEMENT_SIGNATURE = "fedllm-statement-signature"
STATEMENT_SIGNERS, STATEMENT_SIGNATURES = "fedllm-statement-signers", "fedllm-statement-signatures"

_KEYS = b"fedllm-secagg-keys-v1\0"
_SURVIVORS = b"fedllm-secagg-survivors-v1\0"


def _framed(*parts: bytes | str | int) -> bytes:
    """Each part length-prefixed: integers as unsigned 64-bit (Flower's run and node ids are random 64-bit
    values), text as UTF-8."""
    out = b""
    for part in parts:
        if isinstance(part, int):
            if not 0 <= part < 2**64:
                raise ValueError(f"{part}: not an unsigned 64-bit id")
            data = part.to_bytes(8, "big")
        else:
            data = part.encode() if isinstance(part, str) else bytes(part)
        out += struct.pack(">I", len(data)) + data
    return out


def setup_digest(group: str, setup: dict[str, Any]) -> bytes:
    """The round as a site's setup message shows it: its group (the round's label) and every parameter."""
    return hashlib.sha256(_framed(group, *(f"{k}={setup[k]!r}" for k in sorted(setup)))).digest()


def keys_digest(run_id: int, node_id: int, client: int, round_of: bytes, pk1: bytes, pk2: bytes) -> bytes:
    """What a site signs of its setup reply: the run, its node id, the client it claims to be, the round's
    setup (:func:`setup_digest`: a signature made for another round or setup does not count here), its
    keys."""
    return hashlib.sha256(_KEYS + _framed(run_id, node_id, client, round_of, pk1, pk2)).digest()


def keyset_digest(public_keys: dict[int, list[bytes]]) -> bytes:
    """The round's keys as a site checked them (every neighbour's, by node id): binds a survivors signature
    to this round."""
    h = hashlib.sha256(b"fedllm-secagg-keyset-v1\0")
    for nid in sorted(public_keys):
        pk1, pk2 = public_keys[nid]
        h.update(_framed(nid, pk1, pk2))
    return h.digest()


def survivors_digest(run_id: int, keyset: bytes, survivors: list[int]) -> bytes:
    return hashlib.sha256(_SURVIVORS + _framed(run_id, keyset, *sorted(survivors))).digest()


def sign(key: Any, digest: bytes) -> bytes:
    return bytes(key.sign(digest, ec.ECDSA(hashes.SHA256())))


def verify(public_pem: bytes, signature: object, digest: bytes) -> bool:
    """Whether ``signature`` (DER bytes) was made over ``digest`` by the key of ``public_pem``."""
    if not isinstance(signature, bytes) or not 0 < len(signature) <= 256:
        return False
    try:
        key = serialization.load_pem_public_key(public_pem)
        key.verify(signature, digest, ec.ECDSA(hashes.SHA256()))  # type: ignore[union-attr,call-arg]
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


_REGISTRIES: dict[str, dict[int, bytes]] = {}


def registry(path: str) -> dict[int, bytes]:
    """A site's copy of the federation's registry: ``{client id: PEM public key}`` (read once a process)."""
    if path not in _REGISTRIES:
        from fedllm.flower.node import load_registry

        _REGISTRIES[path] = {k: pem for pem, k in load_registry(path, None).items()}
    return _REGISTRIES[path]
