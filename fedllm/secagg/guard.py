"""What a site refuses of a server's SecAgg+ messages: the protocol's guarantee held against the server it
hides from, not only against one that follows it.

Flower 1.42's ``secaggplus_mod`` believes the parameters and lists the server sends. A server that deviates
from the protocol's messages could then read a site's exact update without any site colluding (reproduced
on fedllm's main of 2026-12-03, ``tests/test_secagg.py``):

* list the target as both surviving and dropped in the unmask message: every site returns the share of the
  target's private mask seed *and* of its key-agreement secret, which together remove every mask from the
  target's masked vector;
* run a round of one site (``sample_num=1``, ``threshold=1``): the masks cancel over nobody;
* set the threshold at or below half the neighbourhood and send different sites different lists: one half
  returns the seed shares, the other half the secret-key shares.

So a site refuses, before it answers (a refusal is the site's error reply; nothing of the round leaves it):

* at **setup**: a round of fewer sites than its floor (``--node-config secagg-min-sites=N``, never below 3),
  a neighbourhood of fewer than 3, a threshold that is not a strict majority of the neighbourhood (below it,
  two disjoint sets of honest neighbours can each answer one kind of share), or below the site's own floor
  (``secagg-min-threshold=F``, a fraction of the neighbourhood);
* at **share keys** and **collect masked vectors**: fewer neighbours' keys, or fewer of their key shares,
  than the setup announced (a site masks with every neighbour or with none: handed a few, its pairwise
  masks would be those few's, whose secret keys the others could then be asked for one by one);
* a protocol message of another type than Flower's ``train`` (its mod passes those to the training step
  unmasked), and a second secure training for a round it already trained in (two sums over sets that
  differ by one site would give that site's update);
* at **collect masked vectors** (:func:`check_round_config`, when the site reads the run's config): a round
  smaller than ``federation.min_clients`` of the config the server sent, or a threshold below what that
  config's ``secagg.reconstruction_threshold`` gives (the server's parameters must be the ones it promised);
* at **unmask**: surviving and dropped lists that overlap, repeat a node, name a node the site shared no keys
  with, list the site itself as dropped or omit it from the survivors, or hold fewer survivors than the
  round's quorum (the sum of fewer sites than the floor is never unmasked).

What the checks above cannot stop alone, and what does (``fedllm/secagg/binding.py``): a server that
invents sites, or swaps its own keys in for a real neighbour's, and one that shows different sites different
survivor lists. Sites that hold their node key and the federation's registry sign their SecAgg+ keys and
check every neighbour's, and sign one survivors list a round; the unmask is answered only for that list,
signed by a threshold. Every setup parameter is checked against the run's config before the site trains
(:func:`check_round_config`, from ``fedllm.secagg.flower.admitted``), and the masks come from a full-seed
stream (``fedllm/secagg/prg.py``). docs/trust.md says what each covers, with its test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

STATE = "fedllm-secagg-guard"  # the site's record of the round's quorum, between the protocol's stages


class Refused(ValueError):
    """A protocol message the site will not answer (its error reply names why)."""


COLLUDERS = 1  # the colluding sites a site tolerates unless its operator says otherwise (secagg-colluders)


@dataclass(frozen=True)
class Floor:
    """What the site's operator set it to accept (its node config), whatever the server sends: the smallest
    round, the smallest threshold (a fraction of the neighbourhood) and the colluding sites it tolerates."""

    sites: int = 3
    threshold: float = 0.0
    colluders: int = COLLUDERS

    @classmethod
    def of(cls, node_config: Any) -> Floor:
        def get(key: str, default: Any) -> Any:
            value = node_config.get(key, default) if node_config else default
            return default if value in ("", None) else value

        try:
            sites = int(get("secagg-min-sites", 3))
            threshold = float(get("secagg-min-threshold", 0.0))
            colluders = int(get("secagg-colluders", COLLUDERS))
        except (TypeError, ValueError) as e:
            raise Refused(
                "node config secagg-min-sites / secagg-min-threshold / secagg-colluders: expected an "
                f"integer, a fraction and an integer ({e})"
            ) from None
        if not 0.0 <= threshold <= 1.0:
            raise Refused(f"node config secagg-min-threshold={threshold}: expected a fraction in [0, 1]")
        if colluders < 0:
            raise Refused(f"node config secagg-colluders={colluders}: expected an integer >= 0")
        return cls(max(3, sites), threshold, colluders)


def flower_threshold(reconstruction_threshold: float, share_num: int) -> int:
    """The threshold Flower's ``SecAggPlusWorkflow`` derives from a fractional
    ``reconstruction_threshold``."""
    return max(round(reconstruction_threshold * share_num), 2)


def majority(threshold: int, share_num: int, colluders: int = 0) -> bool:
    """Whether ``threshold`` shares leave no room for two sets of neighbours that each reach it, even with
    ``colluders`` sites in both: ``2 t > n + c``. Two sets that each reach t share at least ``2 t - n`` sites,
    so below that bound ``c`` colluders who sign (and answer) for both could let a server gather a seed's
    shares from one set and the secret key's from the other; at or above it no two such sets exist."""
    return 2 * threshold > share_num + colluders


def threshold_for(fraction: float, share_num: int, colluders: int) -> int:
    """The round's threshold: Flower's from ``secagg.reconstruction_threshold``, raised to the smallest
    that ``colluders`` cannot split (:func:`majority`): ``floor((n + c) / 2) + 1``."""
    return max(flower_threshold(fraction, share_num), (share_num + colluders) // 2 + 1)


def check_setup(configs: Any, floor: Floor) -> None:
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    sample, share, threshold = (int(configs[k]) for k in (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD))
    if sample < floor.sites:
        raise Refused(
            f"a secure round of {sample} site(s): this site takes part only in rounds of at least "
            f"{floor.sites} (node config secagg-min-sites, never below 3): the sum of fewer would reveal too "
            "much of each"
        )
    if share != sample:
        raise Refused(
            f"a neighbourhood of {share} in a round of {sample}: this site takes part only where every site "
            "is every other's neighbour (secagg.num_shares=1): in smaller, overlapping neighbourhoods a "
            "server can show each site a view consistent on its own and unmask one of them"
        )
    if not majority(threshold, share) or threshold > share:
        raise Refused(
            f"threshold {threshold} of {share} neighbours: not a strict majority, so two disjoint sets of "
            "neighbours could hand the server both kinds of one site's shares"
        )
    if not majority(threshold, share, floor.colluders):
        raise Refused(
            f"threshold {threshold} of {share} neighbours: {floor.colluders} colluding site(s) could sign "
            f"for two sets of neighbours that each reach it (this site needs t > (n + c) / 2, t >= "
            f"{(share + floor.colluders) // 2 + 1}; node config secagg-colluders={floor.colluders})"
        )
    if threshold < math.ceil(floor.threshold * share - 1e-9):
        raise Refused(
            f"threshold {threshold} of {share} neighbours is below this site's floor "
            f"(node config secagg-min-threshold={floor.threshold:g})"
        )


def canonical(node_id: object) -> bool:
    """Whether a node id is written as Flower writes one (``str(int(k)) == k``: digits, no sign, no
    leading zero): Flower reads each key of the share-keys message with ``int()``, so "101" and "0101"
    would be one neighbour to it and two to a count of the keys."""
    return (
        isinstance(node_id, str) and node_id.isascii() and node_id.isdigit() and str(int(node_id)) == node_id
    )


def check_share_keys(configs: Any, share_num: int, nid: int, extra: tuple[str, ...] = ()) -> None:
    """Every neighbour the setup announced, each once and the site itself among them: a server that hands
    a site fewer (the rest "dropped"), or one neighbour under two spellings, makes it mask with a few only,
    whose secret keys a threshold of the others can then hand over one by one. The price: a site that drops
    before sharing its keys fails the round. ``extra``: prefixes of fedllm's own keys in the message."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    keys = [k for k in configs if k != Key.STAGE and not k.startswith(extra)]
    odd = [k for k in keys if not canonical(k)]
    if odd:
        raise Refused(
            f"node id(s) {odd[:4]} not written as Flower writes one (digits, no leading zero): one node "
            "under two spellings is one neighbour to Flower and two to a count"
        )
    if len(keys) != share_num:
        raise Refused(
            f"{len(keys)} neighbours' keys where the setup announced {share_num}: this site masks with every "
            "neighbour or with none"
        )
    if str(nid) not in keys:
        raise Refused("the share-keys message leaves this site out of its own round")


def check_collect(configs: Any, neighbours: set[int], nid: int) -> None:
    """The key shares of every neighbour it shared keys with: with fewer, its masked vector would carry the
    pairwise masks of those few only (see :func:`check_share_keys`)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    sources = {int(n) for n in configs[Key.SOURCE_LIST]}
    missing = neighbours - sources - {nid}
    if missing or len(configs[Key.SOURCE_LIST]) != len(sources):
        raise Refused(
            f"key shares from {len(sources)} of its {len(neighbours) - 1} neighbours (missing "
            f"{sorted(missing)[:8]}): this site masks with every neighbour or with none"
        )


def pinned(sample_num: int, share_num: int, cfg: Any) -> dict[str, Any]:
    """Every setup parameter as the run's config implies it for a round of ``sample_num`` sites: what
    fedllm's ServerApp sends (:class:`fedllm.secagg.flower.SecureExchange`), and all a site accepts."""
    from fedllm.secagg.bounds import clipping_range, quantization_bits, uniform

    want: dict[str, Any] = {
        "share_num": sample_num,  # every site every other's neighbour
        "threshold": threshold_for(
            float(cfg.secagg.reconstruction_threshold), share_num, int(cfg.secagg.colluders)
        ),
        "clipping_range": float(clipping_range(cfg)),
        "target_range": 2 ** quantization_bits(cfg),
        "mod_range": 2 ** int(cfg.secagg.modulus_bits),
    }
    if uniform(cfg):
        want["max_weight"] = 1.0
    return want


def check_round_config(state: Any, cfg: Any, floor: Floor) -> int:
    """At the collect stage, before the site trains or masks anything: the round's setup against the run's
    config the server sent. A round of ``least`` to the config's sample of sites; every parameter exactly
    what the config implies (:func:`pinned`): a modulus of 2 or a target range of 1 would make the masked
    reply the sign of every value, in the clear; a threshold below the config's, fewer shares to unmask a
    site. The round's quorum, which the unmask stage requires of the survivors, is returned."""
    from fedllm.secagg.bounds import per_round, uniform

    sample_num = int(state.sample_num)
    least = max(floor.sites, int(cfg.federation.min_clients))
    if not least <= sample_num <= per_round(cfg):
        raise Refused(
            f"a secure round of {sample_num} sites: the run's own config samples {per_round(cfg)} a round, "
            f"and this site takes part in rounds of at least {least} (federation.min_clients, its floor)"
        )
    want = pinned(sample_num, int(state.share_num), cfg)
    got = {k: getattr(state, k) for k in want}
    differ = [f"{k}={got[k]!r} (the config gives {v!r})" for k, v in want.items() if got[k] != v]
    if differ:
        raise Refused("the round's setup is not the run's config: " + ", ".join(differ))
    if not uniform(cfg) and not 1 <= float(state.max_weight) < 2**31:
        raise Refused(f"max_weight={state.max_weight!r}: expected an example count (1 to 2^31)")
    return least


def check_unmask(configs: Any, nid: int, neighbours: set[int], share_num: int, least: int) -> None:
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    active = [int(n) for n in configs[Key.ACTIVE_NODE_ID_LIST]]
    dead = [int(n) for n in configs[Key.DEAD_NODE_ID_LIST]]
    if len(set(active)) != len(active) or len(set(dead)) != len(dead):
        raise Refused("the unmask message repeats a node")
    if set(active) & set(dead):
        raise Refused(
            f"the unmask message lists node(s) {sorted(set(active) & set(dead))} as both surviving and "
            "dropped: both kinds of their shares would unmask their update"
        )
    if nid in dead or nid not in active:
        raise Refused("the unmask message does not list this site among the survivors")
    strangers = (set(active) | set(dead)) - neighbours
    if strangers:
        raise Refused(f"the unmask message names node(s) {sorted(strangers)} this site shared no keys with")
    if len(active) < min(least, share_num):
        raise Refused(
            f"{len(active)} surviving site(s): below the round's quorum of {min(least, share_num)}; the sum "
            "of fewer is never unmasked"
        )


def check_bound_keys(
    configs: Any, registry: dict[int, bytes], run_id: int, round_of: bytes, nid: int, own_client: int
) -> dict[int, int]:
    """Every neighbour's keys signed by the node key the federation's registry holds for the client it
    claims (:mod:`fedllm.secagg.binding`) for this round's setup (``round_of``, as this site saw it), each
    client once, the site's own entry its own client: a server that swaps in keys of its own (to read the
    shares a site sends) or answers for nodes that do not exist has no registered key to sign them with,
    and a signature made for another round or another setup does not count. Returns node id -> client
    id."""
    import fedllm.secagg.binding as binding

    clients: dict[int, int] = {}
    for k, keys in configs.items():
        if not canonical(k):
            continue
        client = configs.get(binding.NEIGHBOUR_CLIENT + k)
        signature = configs.get(binding.NEIGHBOUR_SIGNATURE + k)
        if not isinstance(client, int) or isinstance(client, bool) or client not in registry:
            raise Refused(f"node {k}'s keys claim no client the federation's registry holds ({client!r})")
        pk1, pk2 = (bytes(x) for x in keys)
        if not binding.verify(
            registry[client], signature, binding.keys_digest(run_id, int(k), client, round_of, pk1, pk2)
        ):
            raise Refused(
                f"node {k}'s keys are not signed by client {client}'s registered key: a server's keys in "
                "place of a neighbour's would read the shares this site sends it"
            )
        if client in clients.values():
            raise Refused(f"client {client} appears as two nodes of one round")
        clients[int(k)] = client
    if clients.get(nid) != own_client:
        raise Refused(
            f"the share-keys message names this site as client {clients.get(nid)}, not {own_client}"
        )
    return clients


def check_survivors(survivors: list[int], nid: int, neighbours: set[int], least: int) -> None:
    """A survivors list a site signs: each node once, the site among them, only its neighbours, at least
    the round's quorum."""
    if len(set(survivors)) != len(survivors):
        raise Refused("the survivors list repeats a node")
    if nid not in survivors:
        raise Refused("the survivors list leaves this site out")
    strangers = set(survivors) - neighbours
    if strangers:
        raise Refused(f"the survivors list names node(s) {sorted(strangers)} this site shared no keys with")
    if len(survivors) < least:
        raise Refused(f"{len(survivors)} survivors: below the round's quorum of {least}")


def check_statement_signatures(
    configs: Any, clients: dict[int, int], registry: dict[int, bytes], digest: bytes
) -> None:
    """Before the site masks (``fedllm.secagg.agreement``): every neighbour of the round signed, with the
    key the registry holds for its client, the very statement this site signed (one config, one start, one
    round of one federation). A server that sent another site another config or start has no signature of
    that site over this statement to show."""
    import fedllm.secagg.binding as binding

    nodes = list(configs.get(binding.STATEMENT_SIGNERS, []))
    signatures = list(configs.get(binding.STATEMENT_SIGNATURES, []))
    valid = {
        n
        for n, s in zip(nodes, signatures, strict=False)
        if n in clients and binding.verify(registry[clients[n]], s, digest)
    }
    missing = sorted(set(clients) - valid)
    if missing:
        raise Refused(
            f"node(s) {missing[:8]} did not sign the statement this site signed for the round (its config, "
            "start and round): they may have been sent another model or config, and a sum with theirs could "
            "be this site's update alone"
        )


def check_survivor_signatures(
    configs: Any,
    survivors: list[int],
    signed: list[int],
    clients: dict[int, int],
    registry: dict[int, bytes],
    digest: bytes,
    threshold: int,
) -> None:
    """Before any unmask share leaves: the survivors the unmask message lists are the list this site signed,
    and at least ``threshold`` of them (registered, distinct) signed that same list for this round's keys.
    Sites sign one list a round, so a server cannot gather a strict majority for two lists and ask one half
    for a site's seed and the other for its secret key."""
    import fedllm.secagg.binding as binding

    if sorted(survivors) != sorted(signed):
        raise Refused("the unmask message's survivors are not the list this site signed for the round")
    nodes, signatures = list(configs.get(binding.SIGNERS, [])), list(configs.get(binding.SIGNATURES, []))
    valid = {
        n
        for n, s in zip(nodes, signatures, strict=False)
        if n in survivors and n in clients and binding.verify(registry[clients[n]], s, digest)
    }
    if len(valid) < threshold:
        raise Refused(
            f"{len(valid)} of the survivors signed this survivors list; the unmask needs {threshold} (the "
            "threshold): without them the server could show other sites another list"
        )
