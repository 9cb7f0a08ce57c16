"""What a SuperNode's operator sets, read the same way by every part of a site: its node config, the node key
it signs with, and the federation's registry of node keys.

Below the site, the ClientApp and secure aggregation alike (it imports nothing of fedllm's config), so
that each reads the operator's settings in one place; a registry problem is a :class:`RegistryError` (a
``ValueError``), which the server's config layer reports as a ``ConfigError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RegistryError(ValueError):
    """A registry file or key that cannot be read: the message names the file, the line and why."""


def node_setting(node_config: Any, key: str, default: Any = None) -> Any:
    """A node-config value, ``default`` where it is missing or empty."""
    value = node_config.get(key, default) if node_config else default
    return value if value not in ("", None) else default


_KEYS: dict[str, object] = {}


def signing_key(node_config: Any) -> Any:
    """The site's node key for signing its replies (``sign-key`` in its node config), loaded once; None
    when the SuperNode runs without one (a plain deployment, the Simulation Engine)."""
    path = node_setting(node_config, "sign-key")
    if path is None:
        return None
    if path not in _KEYS:
        from fedllm.flower.signing import load_private_key

        _KEYS[path] = load_private_key(path)
    return _KEYS[path]


def pinned_secure(node_config: Any) -> bool:
    """Whether the SuperNode's operator pinned it to secure aggregation (its node config's
    ``secure-aggregation='required'``)."""
    return str(node_setting(node_config, "secure-aggregation", "")).lower() in ("required", "true", "1")


def pem_of(key_text: str, where: str) -> bytes:
    """A public key (OpenSSH ``ecdsa-sha2-...`` line or PEM) as Flower stores it: PEM SubjectPublicKeyInfo."""
    from cryptography.hazmat.primitives import serialization

    data = key_text.strip().encode()
    try:
        key = (
            serialization.load_pem_public_key(data)
            if data.startswith(b"-----BEGIN")
            else serialization.load_ssh_public_key(data)
        )
    except (ValueError, TypeError) as e:
        raise RegistryError(f"{where}: not a public key ({e})") from None
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_registry(path: str, num_clients: int | None) -> dict[bytes, int]:
    """``{PEM public key: client id}`` from lines ``K: <OpenSSH public key or path to a .pub file>``;
    ``num_clients`` None: any client ids, not necessarily all of them (a site's copy, read before it knows
    the run's config)."""
    file = Path(path)
    if not file.is_file():
        raise RegistryError(f"flower.registry (or a site's registry): {path} is not a file")
    out: dict[bytes, int] = {}
    seen: set[int] = set()
    for i, line in enumerate(file.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"flower.registry {path}, line {i}"
        head, sep, key = line.partition(":")
        if not sep or not head.strip().isdigit():
            raise RegistryError(f"{where}: expected 'client-id: public key', got {line[:60]!r}")
        k = int(head)
        if num_clients is not None and not 0 <= k < num_clients:
            raise RegistryError(f"{where}: client id {k} is outside 0..{num_clients - 1}")
        if k in seen:
            raise RegistryError(f"{where}: client id {k} is registered twice")
        key = key.strip()
        if not key.startswith(("ecdsa-", "ssh-", "-----BEGIN")):  # a path to the key file
            key_path = (file.parent / key).expanduser()
            if not key_path.is_file():
                raise RegistryError(f"{where}: {key} is neither a public key nor a file")
            key = key_path.read_text()
        pem = pem_of(key, where)
        if pem in out:
            raise RegistryError(f"{where}: this key is already registered for client {out[pem]}")
        out[pem] = k
        seen.add(k)
    missing = sorted(set(range(num_clients)) - seen) if num_clients is not None else []
    if missing:
        raise RegistryError(f"flower.registry {path}: no key for clients {missing}")
    return out
