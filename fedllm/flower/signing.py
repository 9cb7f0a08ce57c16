"""Replies that prove their sender: a site signs what it sends with its node key, the server verifies it.

Flower authenticates the *node that makes a request* (its key signs a timestamp), not the content of what
it pushes, and not the ``src_node_id`` a reply claims: a registered site could push a reply for another
site's message (README's deployment page, "what Flower checks"). So every reply of a fedllm site carries
an ECDSA (SHA-256) signature, made with the same private key its SuperNode authenticates with, over a
digest of the reply's content and of the id of the message it answers. The server verifies it against
the public key the operator registered for that client id (``flower.registry``) before it reads anything
else; a reply signed by another key, or not signed, is refused. The cryptography is the ``cryptography``
package's (which Flower itself uses); nothing here is home-made but the digest's layout.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

DOMAIN = b"fedllm-reply-v1\0"


def digest(reply_to: str, records: dict[str, Any]) -> bytes:
    """SHA-256 over the answered message id and a canonical form of the reply's records: JSON config
    values sorted by key, tensors by name with dtype, shape and bytes (the signature field itself left
    out)."""
    h = hashlib.sha256(DOMAIN)
    h.update(str(reply_to).encode() + b"\0")
    for name in sorted(records):
        record = records[name]
        h.update(f"record {name}\0".encode())
        if hasattr(record, "items") and _is_arrays(record):
            for key in sorted(record):
                arr = record[key]
                h.update(f"{key}\0{arr.dtype}\0{list(arr.shape)}\0".encode())
                h.update(hashlib.sha256(arr.data).digest())
        else:
            values = {k: v for k, v in dict(record).items() if k != "signature"}
            h.update(json.dumps(values, sort_keys=True, default=str).encode())
    return h.digest()


def _is_arrays(record) -> bool:
    first = next(iter(record.values()), None) if len(record) else None
    return first is not None and hasattr(first, "data") and hasattr(first, "shape")


def load_private_key(path: str | Path):
    """A site's node key: the OpenSSH private key ``ssh-keygen -t ecdsa`` wrote (or PEM)."""
    data = Path(path).read_bytes()
    if data.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----"):
        return serialization.load_ssh_private_key(data, password=None)
    return serialization.load_pem_private_key(data, password=None)


def sign(key, reply_to: str, records: dict[str, Any]) -> str:
    """The base64 signature of a reply (see :func:`digest`)."""
    return base64.b64encode(key.sign(digest(reply_to, records), ec.ECDSA(hashes.SHA256()))).decode()


def verify(public_pem: bytes, signature: Any, reply_to: str, records: dict[str, Any]) -> bool:
    """Whether ``signature`` was made over this reply (answering ``reply_to``) with the key of
    ``public_pem``."""
    if not isinstance(signature, str) or len(signature) > 1024:
        return False
    try:
        key = serialization.load_pem_public_key(public_pem)
        raw = base64.b64decode(signature, validate=True)
        key.verify(raw, digest(reply_to, records), ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
