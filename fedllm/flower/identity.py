"""Who a SuperNode is: the operator's registry of site keys, and the one binding of each client id to a node.

A site's ``--node-config client-id=K`` is a claim. With SuperNode
authentication on (``flower-superlink --enable-supernode-auth``), Flower knows
each node's public key (``grid.get_nodes()``, ``NodeInfo.public_key``, PEM);
the operator's registry (``flower.registry``) maps each key to exactly one
client id, so a node answers for K only with K's key. Without a registry
(plain mode) a claim is believed unless another live node already holds the
id: the first live binding holds, a restarted site takes its id back once the
old node is gone, and the server warns that identities are unauthenticated.
Every refusal is logged, every time the node asks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fedllm.config import ConfigError, token_modules
from fedllm.flower import node

log = logging.getLogger(__name__)


def pem_of(key_text: str, where: str) -> bytes:
    """A public key (OpenSSH ``ecdsa-sha2-...`` line or PEM) as Flower stores it: PEM SubjectPublicKeyInfo."""
    try:
        return node.pem_of(key_text, where)
    except node.RegistryError as e:
        raise ConfigError(str(e)) from None


def load_registry(path: str, num_clients: int | None) -> dict[bytes, int]:
    """``{PEM public key: client id}`` of the operator's registry (:func:`fedllm.flower.node.load_registry`),
    a problem reported as the config's error."""
    try:
        return node.load_registry(path, num_clients)
    except node.RegistryError as e:
        raise ConfigError(str(e)) from None


@dataclass
class Bindings:
    """client id -> node id, granted only to the node whose key (or, in plain mode, whose first live claim)
    holds that id."""

    registry: dict[bytes, int] | None = None
    nodes: dict[int, int] = field(default_factory=dict)  # client id -> node id
    refused: dict[int, str] = field(default_factory=dict)  # node id -> why (the latest refusal)

    def key_of(self, client_id: int) -> bytes | None:
        """The public key (PEM) registered for ``client_id``; None without a registry."""
        if self.registry is None:
            return None
        return next((pem for pem, k in self.registry.items() if k == client_id), None)

    def forget_gone(self, live: set[int]) -> None:
        self.nodes = {k: n for k, n in self.nodes.items() if n in live}

    def claim(self, node_id: int, client_id: int, key: bytes | None) -> str | None:
        """Bind ``node_id`` to ``client_id`` if it may hold it; returns why not (also logged), or None."""
        why = None
        if self.registry is not None:
            owner = self.registry.get(key or b"")
            if owner is None:
                why = "its key is not in flower.registry" if key else "it has no authenticated key"
            elif owner != client_id:
                why = f"its key is registered for client {owner}"
        holder = self.nodes.get(client_id)
        if why is None and holder is not None and holder != node_id:
            why = f"live node {holder} already holds client {client_id}"
        held = [k for k, n in self.nodes.items() if n == node_id and k != client_id]
        if why is None and held:
            why = f"it already holds client {held[0]}"
        if why is not None:
            self.refused[node_id] = why
            log.warning("node %s claims client %d: refused (%s)", node_id, client_id, why)
            return why
        self.nodes[client_id] = node_id
        self.refused.pop(node_id, None)
        return None


def refuse_token_modules(cfg) -> None:
    """Refuse sharing token-indexed dense modules on Flower unless the operator accepted what they reveal."""
    shared = token_modules(cfg)
    if shared and not cfg.flower.share_token_modules:
        raise ConfigError(
            f"lora.trainable_modules shares {shared}: their rows are indexed by tokens, so the rows a site "
            "changes reveal which tokens its data holds; use lora.trainable_modules=[] across organizations, "
            "or set flower.share_token_modules=true to accept it"
        )
