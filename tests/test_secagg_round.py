"""Secure aggregation bound to what every site trains (issue 88): one config and one start per round (the
statement every site signs), each round of a federation trained once whatever the config, a threshold
colluders cannot split, a handshake that tells only what the protocol needs, and the launcher's sites pinned.

Each attack is played by the server against fedllm's real mod on real Flower messages (``tests/test_secagg``'s
harness), once as the sites behaved before (the check under test taken out: the server rebuilds the target's
vector) and once as they behave now (nothing of the target leaves)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from fedllm.aggregation.base import GlobalState
from fedllm.config import load_config
from fedllm.factors import LoraFactors
from fedllm.flower.site import expected_start
from fedllm.protocol import ClientStart
from fedllm.secagg import agreement
from fedllm.secagg.bounds import quantization_error
from tests.conftest import tiny_overrides
from tests.flower_grid import Federation
from tests.test_secagg import (
    StateSites,
    bound,
    clipped_vectors,
    protocol_round,
    server_sends,
    server_view,
    site_errors,
    start_of,
    task_identity,  # noqa: F401  (autouse: what Flower sets in a ServerApp's process)
    unmask_one,
)

TARGET = 100
MODULE = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def federation(tmp_path):
    """A federation per test: its sites' state folders keep the statements they signed for each round (a
    federation's round 1 signed in one test would refuse another test's round 1)."""
    return Federation(tmp_path / "federation")


def config(tmp_path, n: int = 4, *extra: str):
    return load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            f"federation.num_clients={n}",
            "federation.weighting=uniform",
            "flower.secure_aggregation=true",
            "secagg.clip_norm=1.0",
            "secagg.colluders=0",
            *extra,
        ),
    )


def previous_sites(monkeypatch) -> None:
    """The sites as they were before the round statement: every other check kept, the statement's
    signatures not required before masking."""
    from fedllm.secagg import guard

    monkeypatch.setattr(guard, "check_statement_signatures", lambda *a, **k: None)


# ------------------------------------------------------------------ one round, one config, one start
@pytest.mark.parametrize("sites", ["previous", "fedllm"])
@pytest.mark.parametrize("attack", ["config", "start"])
def test_a_server_that_sends_the_other_sites_another_round_cannot_isolate_one(
    tmp_path, monkeypatch, federation, sites, attack
):
    """The model-inconsistency attack (Pasquini et al., CCS 2022) on 4 bound sites: the target gets the run's
    config and start, the 3 others ``client.lr=1e-30`` (attack "config") or a start of A = 1e-30 cut from
    another global state (attack "start"), each consistent on its own, every protocol number as the config
    gives it. A site's vector here is what its training makes of what it got (its rate, or its start's A,
    times its own clipped change). As the sites were, 4 x the unmasked mean is the target's vector; fedllm's
    sites find that the others signed another statement and send no masked vector at all."""
    cfg = config(tmp_path)
    vectors = clipped_vectors(4, 200, seed=11)
    honest = GlobalState({MODULE: LoraFactors(torch.ones(32, 16), torch.full((16, 32), 0.5), 1.0)})
    inert = GlobalState({MODULE: LoraFactors(torch.full((32, 16), 1e-30), torch.zeros(16, 32), 1.0)})
    fitins, globals_ = {}, {}
    for k, n in enumerate(vectors):
        mine = cfg if n == TARGET or attack == "start" else config(tmp_path / "other", 4, "client.lr=1e-30")
        state = honest if n == TARGET or attack == "config" else inert
        start = expected_start(mine, state, k, 1)
        fitins[n], globals_[n] = start_of(mine, k, 1, start), agreement.encode_state(state)

    def deviate(stage, node, c):  # each site the global state its start is cut from
        if stage == agreement.STAGE:
            c[agreement.GLOBAL] = globals_[node]

    def trained(site, start):  # what the site's training makes of its rate and its start
        a = float(start.factors[MODULE].A.abs().max()) if start.factors else 1.0
        return site.cfg.client.lr / cfg.client.lr * a

    if sites == "previous":
        previous_sites(monkeypatch)
    server_sends(monkeypatch, deviate)
    errors = site_errors(monkeypatch)
    mean, nodes, grid = protocol_round(
        cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=bound(federation, vectors),
        fitins=fitins, scale=trained, global_state=honest,
    )  # fmt: skip
    if sites == "previous":
        assert nodes == sorted(vectors)
        assert np.abs(4 * mean - vectors[TARGET]).max() <= 4 * quantization_error(cfg) + 1e-6
    else:
        assert mean is None and nodes == []
        _, masked, _ = server_view(grid, TARGET)
        assert masked is None  # not even the target's masked vector left it
        assert sum("did not sign the statement this site signed" in e for e in errors) == 4, errors


@pytest.mark.parametrize("sites", ["previous", "fedllm"])
def test_signatures_collected_in_restarted_setups_cannot_isolate_one(
    tmp_path, monkeypatch, federation, sites
):
    """The same attack over three protocol instances of round 1 on the same sites (Flower's mod lets a server
    restart from a new setup): in the first every site is sent ``client.lr=1e-30`` and signs that statement,
    in the second every site the run's config and signs that one, each stopped before the collect stage
    (nothing trained, nothing claimed); in the third the target gets the run's config and the others the
    inert one, and the server relays to each side the signatures it collected on that side's statement. As
    the sites were (one statement per protocol instance), every check passes and 4 x the unmasked mean is
    the target's vector; fedllm's sites sign one statement per round of their federation, ever: the second
    instance's signing is refused at every site, and the third sends nothing of the target."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    import fedllm.secagg.flower as sf

    cfg, inert_cfg = config(tmp_path), config(tmp_path / "other", 4, "client.lr=1e-30")
    vectors = clipped_vectors(4, 200, seed=12)
    state = GlobalState({MODULE: LoraFactors(torch.ones(32, 16), torch.full((16, 32), 0.5), 1.0)})

    def fitins(target_cfg, others_cfg):
        return {
            n: start_of(target_cfg if n == TARGET else others_cfg, k, 1, expected_start(cfg, state, k, 1))
            for k, n in enumerate(vectors)
        }

    def trained(site, start):  # what the site's training makes of its rate
        return site.cfg.client.lr / cfg.client.lr

    if sites == "previous":
        monkeypatch.setattr(sf, "pledge_statement", lambda *a, **k: None)
    phase = {"now": 0}
    collected: dict[int, dict[int, bytes]] = {1: {}, 2: {}}

    def deviate(stage, node, c):
        if stage == "collect_masked_vectors":
            if phase["now"] in (1, 2):
                raise RuntimeError("the server stops the instance before the collect stage")
            side = collected[2] if node == TARGET else collected[1]  # each side its own statement's
            c[agreement.SIGNERS], c[agreement.SIGNATURES] = list(side), list(side.values())

    server_sends(monkeypatch, deviate)
    errors = site_errors(monkeypatch)
    states = StateSites(tmp_path / "sites", list(vectors))
    for phase["now"], sent in ((1, fitins(inert_cfg, inert_cfg)), (2, fitins(cfg, cfg))):
        _, _, grid = protocol_round(
            cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=bound(federation, vectors),
            fitins=sent, scale=trained, global_state=state, sites=states,
        )  # fmt: skip
        for node, stage, content in grid.received:
            if stage == agreement.STAGE:
                signature = content.config_records[RECORD_KEY_CONFIGS].get(agreement.SIGNATURE, b"")
                if signature:
                    collected[phase["now"]][node] = bytes(signature)
    phase["now"] = 3
    mean, nodes, grid = protocol_round(
        cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=bound(federation, vectors),
        fitins=fitins(cfg, inert_cfg), scale=trained, global_state=state, sites=states,
    )  # fmt: skip
    if sites == "previous":
        assert len(collected[1]) == len(collected[2]) == 4
        assert nodes == sorted(vectors)
        assert np.abs(4 * mean - vectors[TARGET]).max() <= 4 * quantization_error(cfg) + 1e-6
    else:
        assert len(collected[1]) == 4 and collected[2] == {}  # no site signed a second statement for round 1
        assert sum("other than the one this site signed" in e for e in errors) == 4 + 1, errors
        assert TARGET not in nodes and server_view(grid, TARGET)[1] is None  # the target sent nothing


def test_a_round_of_bound_sites_signs_one_statement_and_sums_as_a_plain_round(tmp_path, federation):
    """The honest round: every bound site checks its start against the round's global state, signs the
    statement, finds every neighbour's signature on it, and the mean is the plain mean within the
    quantization: one more message a site."""
    cfg = config(tmp_path, 5)
    vectors = clipped_vectors(5, 100, seed=2)
    state = GlobalState({MODULE: LoraFactors(torch.randn(32, 16), torch.randn(16, 32), 1.0)})
    fitins = {n: start_of(cfg, k, 1, expected_start(cfg, state, k, 1)) for k, n in enumerate(vectors)}
    mean, nodes, grid = protocol_round(
        cfg, vectors, {n: 1 for n in vectors}, node_config=bound(federation, vectors), fitins=fitins,
        global_state=state,
    )  # fmt: skip
    assert nodes == sorted(vectors)
    assert np.abs(mean - np.mean(list(vectors.values()), axis=0)).max() <= quantization_error(cfg)
    stages = [stage for _, stage, _ in grid.received]
    assert stages.count(agreement.STAGE) == 5


@pytest.mark.parametrize(
    "edit, says",
    [
        ("cut", "is not its part of the round's global start"),  # a rank-4 site sent rows 4-8, not 0-4
        ("scale", "is not its part of the round's global start"),  # another scale folded in
        ("round", "a start of round 3 in the protocol's round 1"),
        ("client", "a start for client 1 at the site of client 0"),
        ("second", "a second round statement this round: a site signs one"),
    ],
)
def test_a_site_signs_only_its_own_part_of_one_global_start(tmp_path, monkeypatch, federation, edit, says):
    """Each way a server could hand a site a start that is not its share of the statement's global state,
    or ask it to sign two statements in one round, is refused at the statement stage, before anything is
    masked."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    cfg = config(tmp_path, 4)
    vectors = clipped_vectors(4, 50, seed=4)
    state = GlobalState({MODULE: LoraFactors(torch.randn(32, 16), torch.randn(16, 32), 1.0)})
    fitins = {n: start_of(cfg, k, 1, expected_start(cfg, state, k, 1)) for k, n in enumerate(vectors)}
    want = expected_start(cfg, state, 0, 1)
    f = want.factors[MODULE]
    changed = {
        "cut": ClientStart(1, {MODULE: LoraFactors(state.factors[MODULE].A[4:8], f.B, f.scale)}),
        "scale": ClientStart(1, {MODULE: LoraFactors(f.A, f.B * 2, f.scale / 2)}),
        "round": ClientStart(3, want.factors),
        "client": want,
    }
    if edit in changed:
        fitins[TARGET] = start_of(cfg, 1 if edit == "client" else 0, 1, changed[edit])
    if edit == "second":  # the statement stage asked twice of the target: the second with another state
        from tests.test_secagg import VectorGrid

        original = VectorGrid.send_and_receive

        def twice(self, messages, timeout=None):
            replies = original(self, messages, timeout)
            for m in messages:
                configs = m.content.config_records.get(RECORD_KEY_CONFIGS, {})
                if configs.get("stage") == agreement.STAGE and m.metadata.dst_node_id == TARGET:
                    again = copy.deepcopy(m)  # the same start, another layout: another statement
                    again.content.config_records[RECORD_KEY_CONFIGS]["fedllm-layout"] = '[["x", [1]]]'
                    replies += original(self, [again], timeout)
            return replies

        monkeypatch.setattr(VectorGrid, "send_and_receive", twice)
    errors = site_errors(monkeypatch)
    mean, _, grid = protocol_round(
        cfg, vectors, {n: 1 for n in vectors}, deviating=True, node_config=bound(federation, vectors),
        fitins=fitins, global_state=state,
    )  # fmt: skip
    assert any(says in e for e in errors), errors
    if edit != "second":
        assert mean is None and server_view(grid, TARGET)[1] is None


def test_the_statement_names_everything_a_round_shares():
    """Two sites' statements are equal exactly when the run, federation, round, plan token, config, layout
    and full-rank state all are: each one alone changes it."""
    base = dict(run_id=1, federation="registry:ab", round_idx=2, token="00ff", cfg_digest=b"c" * 32,
                layout='[["m", [4]]]', state=b"s" * 32)  # fmt: skip
    one = agreement.statement(**base)
    assert agreement.statement(**base) == one
    changes = {"run_id": 2, "federation": "registry:ac", "round_idx": 3, "token": "00fe",
               "cfg_digest": b"d" * 32, "layout": '[["m", [5]]]', "state": b"t" * 32}  # fmt: skip
    for key, value in changes.items():
        assert agreement.statement(**{**base, key: value}) != one, key


def test_the_full_rank_state_round_trips_and_its_digest_sees_one_ulp():
    state = GlobalState(
        {MODULE: LoraFactors(torch.randn(8, 4), torch.randn(6, 8), 1.0)},
        dense={"lm_head.weight": torch.randn(3, 2)},
        extras={"fedsvd.rounds": 2, "x": torch.arange(3.0)},
    )
    back, digest = agreement.decode_state(agreement.encode_state(state))
    assert torch.equal(back.factors[MODULE].A, state.factors[MODULE].A) and back.extras["fedsvd.rounds"] == 2
    nudged = copy.deepcopy(state)
    nudged.factors[MODULE].B[0, 0] = torch.nextafter(nudged.factors[MODULE].B[0, 0], torch.tensor(math.inf))
    assert agreement.decode_state(agreement.encode_state(nudged))[1] != digest
    with pytest.raises(agreement.Refused, match="the round's global state is unreadable"):
        agreement.decode_state(b"not a state")


# ------------------------------------------------------------------ once per round per federation
@pytest.mark.parametrize("sites", ["previous", "claim", "fedllm"])
@pytest.mark.parametrize("change", ["client.fedprox.mu=0.02", "client.sgd_lr=0.10000000000000002"])
def test_a_second_run_with_an_inert_key_or_one_ulp_does_not_give_a_sites_update(
    tmp_path, monkeypatch, federation, sites, change
):
    """Run 1: 4 bound sites, round 1. Run 2 on the same disks with a key that does not change a site's
    update (or one ulp of one that does), without the target: the others train round 1 again from the same
    start. Keyed by the config's digest, the once-per-round record let them (4 x S1 - 3 x S2 is the
    target's vector); keyed by the federation, fedllm's sites refuse run 2's training, and say nothing of
    their past. ``claim``: the statement's pledge off, so the federation-keyed claim alone must refuse."""
    from fedllm.secagg import flower as sf
    from tests.test_secagg import StateSites

    cfg = config(tmp_path)
    vectors = clipped_vectors(4, 200, seed=5)
    if sites in ("previous", "claim"):
        monkeypatch.setattr(sf, "pledge_statement", lambda *a, **k: None)  # (added after issue 88's review)
    if sites == "previous":
        monkeypatch.setattr(sf.agreement, "federation_of", lambda node_config, registry: "")
    errors = site_errors(monkeypatch)
    states = StateSites(tmp_path / "sites", list(vectors))
    first, nodes, _ = protocol_round(
        cfg, vectors, {n: 1 for n in vectors}, sites=states, node_config=bound(federation, vectors)
    )
    assert nodes == sorted(vectors)
    rest = {n: v for n, v in vectors.items() if n != TARGET}
    other = config(tmp_path, 4, change)
    second, _, _ = protocol_round(
        other,
        rest,
        {n: 1 for n in rest},
        deviating=True,
        sites=states,
        node_config=bound(federation, vectors),
    )
    if sites == "previous":
        got = 4 * first - 3 * second
        assert np.abs(got - vectors[TARGET]).max() <= 8 * quantization_error(cfg)
    else:
        assert second is None
        # refused at the statement (another config: another statement for round 1) or, were it the same
        # statement, at the training (the round's claim); either way no refusal names a round of the site's
        said = ("federation has had already",) + (
            ("other than the one this site signed",) if sites == "fedllm" else ()
        )
        refusals = [e for e in errors if any(w in e for w in said)]
        assert len(refusals) == 3 and not any("trained round" in e for e in refusals), errors


def test_a_new_federation_trains_from_round_one(tmp_path, monkeypatch, federation):
    """A new federation is the operator's act (``--node-config federation=ID``): the same disks train round
    1 again under a new id, and refuse it under the old one."""
    from fedllm.secagg.flower import claim_round
    from fedllm.secagg.guard import Refused

    claims = tmp_path / "claims.json"
    claim_round(claims, "id:study-1", 1)
    claim_round(claims, "id:study-1", 2)
    with pytest.raises(Refused, match="round 2 that this site's federation has had already"):
        claim_round(claims, "id:study-1", 2)
    claim_round(claims, "id:study-2", 1)
    assert agreement.federation_of({"federation": "study-2"}, None) == "id:study-2"
    named = agreement.federation_of({}, str(federation.registry))
    assert named.startswith("registry:") and agreement.federation_of({}, None) == ""


# ------------------------------------------------------------------ a threshold colluders cannot split
@pytest.mark.parametrize("n", [5, 7])
@pytest.mark.parametrize("colluders", [0, 1], ids=["threshold-for-no-colluder", "fedllm-default"])
def test_one_colluding_site_cannot_split_the_survivors(tmp_path, monkeypatch, federation, n, colluders):
    """A colluder X signs two survivors lists, L1 = {T, ..., X} shown to its half and L2 = {..., X} to the
    other, and hands the server its own shares of T's secrets. At the threshold of a strict majority alone
    (t = 3 of 5, 4 of 7) each list gathers t signatures: L1's sites return T's seed shares, L2's T's
    secret-key shares, and with X's the server strips every mask of T's vector. At fedllm's default (t >
    (n + 1) / 2: 4 of 5, 5 of 7) neither list reaches t, so no honest site answers the unmask."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE, Key

    from fedllm.flower.signing import load_private_key
    from fedllm.secagg import binding

    cfg = config(tmp_path, n, "secagg.reconstruction_threshold=0.6")
    vectors = clipped_vectors(n, 120, seed=9)
    nodes = sorted(vectors)
    x = nodes[-1]  # the colluder
    half = (n - 1) // 2
    first = [TARGET, *nodes[1:half]]  # T and its half
    second = nodes[half:-1]
    lists = {**{m: sorted([*first, x]) for m in first}, **{m: sorted([*second, x]) for m in second}, x: None}
    dead = {m: sorted(set(nodes) - set(lists[m])) for m in nodes if lists[m] is not None}
    key_x = load_private_key(federation.keys[x - 100])
    grid_box: dict = {}

    def deviate(stage, node, c):
        if stage == binding.CONSISTENCY and lists[node] is not None:
            c[binding.SURVIVORS] = lists[node]
        if stage == "unmask" and lists.get(node) is not None:
            mine = lists[node]
            c[Key.ACTIVE_NODE_ID_LIST], c[Key.DEAD_NODE_ID_LIST] = mine, dead[node]
            # the signatures on this site's own list: its half's, and the colluder's made for it
            ctx = grid_box["grid"].contexts[node]
            keyset = bytes(dict(ctx.state.config_records["fedllm-secagg-guard"])["keyset"])
            digest = binding.survivors_digest(1, keyset, mine)
            signers = [s for s in c[binding.SIGNERS] if s in mine and s != x]
            sigs = [
                sg for s, sg in zip(c[binding.SIGNERS], c[binding.SIGNATURES], strict=True) if s in signers
            ]
            c[binding.SIGNERS] = [*signers, x]
            c[binding.SIGNATURES] = [*sigs, binding.sign(key_x, digest)]

    from tests.test_secagg import VectorGrid

    original_init = VectorGrid.__init__

    def keep(self, *a, **k):
        original_init(self, *a, **k)
        grid_box["grid"] = self

    monkeypatch.setattr(VectorGrid, "__init__", keep)
    server_sends(monkeypatch, deviate)
    errors = site_errors(monkeypatch)
    protocol_round(
        cfg, vectors, {m: 1 for m in vectors}, deviating=True, node_config=bound(federation, vectors),
        colluders=colluders,
    )  # fmt: skip
    grid = grid_box["grid"]
    pk1, masked, replies = server_view(grid, TARGET)
    state = SecAggPlusState(**dict(grid.contexts[x].state.config_records[RECORD_KEY_STATE]))
    seeds = [state.rd_seed_share_dict[TARGET]] if TARGET in state.rd_seed_share_dict else []
    keys = [state.sk1_share_dict[TARGET]] if TARGET in state.sk1_share_dict else []
    for node, nids, shares in replies:
        share = dict(zip(nids, shares, strict=True)).get(TARGET)
        if share is not None and node in first:
            seeds.append(share)
        elif share is not None and node in second:
            keys.append(share)
    from fedllm.secagg import prg

    # the server draws the masks as the sites did (fedllm's generator)
    monkeypatch.setattr("flwr.common.secure_aggregation.secaggplus_utils.pseudo_rand_gen", prg.masks)
    rebuilt = unmask_one(cfg, TARGET, masked, pk1, seeds, {TARGET: keys})
    if colluders == 0:
        assert rebuilt is not None and np.abs(rebuilt - vectors[TARGET]).max() <= quantization_error(cfg)
    else:
        assert rebuilt is None and not replies
        assert any("survivors signed this survivors list" in e for e in errors), errors


def test_the_threshold_table_and_the_dropouts_it_tolerates():
    """t = max(Flower's from the fraction, floor((n + c) / 2) + 1): docs/trust.md's table."""
    from fedllm.secagg.guard import majority, threshold_for

    table = {(n, c): threshold_for(0.67, n, c) for n in (3, 4, 5, 7, 10) for c in (0, 1, 2)}
    assert [table[(n, 1)] for n in (3, 4, 5, 7, 10)] == [3, 3, 4, 5, 7]  # dropouts tolerated: 0, 1, 1, 2, 3
    assert [table[(n, 0)] for n in (3, 4, 5, 7, 10)] == [2, 3, 3, 5, 7]
    assert [table[(n, 2)] for n in (3, 4, 5, 7, 10)] == [3, 4, 4, 5, 7]
    for (n, c), t in table.items():  # withstands c colluders; one lower would not, unless the fraction set it
        assert majority(t, n, c)
        assert not majority(t - 1, n, c) or t == max(round(0.67 * n), 2)


# ------------------------------------------------------------------ the handshake
def test_a_pinned_sites_handshake_tells_no_histogram_and_no_length(tmp_path):
    """A pinned site answers the handshake with its id, rank and (under example weighting) the count of its
    own examples as its data holds them: a ``data.max_seq_len`` sweep by the server (which drops the
    examples that no longer keep a response token) and ``flower.share_data_stats=true`` read nothing. An
    unpinned site's count still follows the server's config, as before."""
    from fedllm.flower.site import Site

    def info(pinned: bool, *extra: str):
        cfg = load_config(
            None,
            tiny_overrides(
                tmp_path / "run", "federation.num_clients=2", "flower.share_data_stats=true", *extra
            ),
        )
        return Site(cfg, 0, tmp_path / f"site-{pinned}-{len(extra)}", pinned=pinned).info()

    sweep = [info(False, f"data.max_seq_len={m}") for m in (8, 64)]
    assert (
        sweep[0]["num-examples"] < sweep[1]["num-examples"] and "categories" in sweep[0]
    )  # a leak, unpinned
    pinned = [info(True, f"data.max_seq_len={m}") for m in (8, 64)]
    assert pinned[0] == pinned[1] and set(pinned[0]) == {"client-id", "rank", "num-examples"}
    assert pinned[0]["rank"] == 4


def test_a_pinned_sites_count_of_natural_instructions_tasks_follows_no_server_setting(tmp_path):
    """A site whose data is a Natural Instructions folder: a server sweeping ``data.heldout_tasks`` (one task
    held out at a time) or ``data.examples_per_task`` reads each task's size from an unpinned site's
    handshake count (a category histogram by another route); a pinned site counts its folder as it holds
    it, whatever the sweep."""
    from fedllm.flower.site import Site
    from tests.test_natural_instructions import TASKS, write_tasks

    folder = write_tasks(tmp_path / "ni")
    weighted = ("federation.num_clients=2", "federation.weighting=examples")

    def count(pinned: bool, *extra: str) -> int:
        cfg = load_config(None, tiny_overrides(tmp_path / "run", *weighted, *extra))
        where = tmp_path / f"site-{pinned}-{abs(hash(extra))}"
        return int(Site(cfg, 0, where, data_path=str(folder), pinned=pinned).info()["num-examples"])

    sweep = [f"data.heldout_tasks=[{name}]" for name in TASKS] + ["data.examples_per_task=2"]
    unpinned = {count(False, x) for x in sweep}
    assert len(unpinned) > 2  # each held-out task's size, read off the count
    assert {count(True, x) for x in sweep} == {sum(TASKS.values())}


# ------------------------------------------------------------------ the launcher
def test_the_launchers_secure_sites_are_pinned_and_its_plain_ones_are_not(tmp_path):
    """scripts/flower_sites.py writes each site's node config for run_flower_local.sh: a bound site of a
    secure run gets secure-aggregation='required' (a server asking it for a plain round is refused); a plain
    run's sites, and an unbound (--insecure) secure run's, do not (a pin needs the registry)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("flower_sites", Path("scripts/flower_sites.py"))
    sites = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sites)
    from flwr.common.config import parse_config_args

    from fedllm.flower.node import pinned_secure

    for bound_, secure, pinned in ((True, True, True), (True, False, False), (False, True, False)):
        out = tmp_path / f"{bound_}-{secure}"
        argv = [str(out), "default", *(["--bound"] if bound_ else []), "federation.num_clients=3",
                "flower.share_token_modules=true"]  # fmt: skip
        argv += ["flower.secure_aggregation=true", "secagg.clip_norm=1"] if secure else []
        assert sites.main(argv) == 0
        for k in range(3):
            text = (out / f"site-{k}" / "node-config").read_text().strip()
            node = parse_config_args([text])  # as flower-supernode --node-config reads it
            assert node["client-id"] == k and pinned_secure(node) == pinned, text
            assert ("registry" in node) == bound_ and ("sign-key" in node) == bound_


def test_a_site_logs_what_it_refused(tmp_path, monkeypatch, federation, caplog):
    """A refusal is the site's error reply to the server and a line in the site's own log: the stage, the
    round, why."""
    import logging

    from flwr.app import Context, RecordDict

    from tests.test_secagg import VectorGrid, setup_message, vector_app

    app, _, _ = vector_app({TARGET: np.zeros(3)}, {TARGET: 1})
    ctx = Context(run_id=1, node_id=TARGET, node_config=federation.node_config(TARGET, 0), state=RecordDict(),
                  run_config={})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fedllm.secagg.flower"):
        (reply,) = VectorGrid(app, {TARGET: ctx}).send_and_receive([setup_message(TARGET, 5, 5, 3)])
    assert reply.has_error()
    assert (
        "secure aggregation: refused a setup message of round 1: threshold 3 of 5 neighbours" in caplog.text
    )


def test_every_key_of_the_config_a_site_is_sent_is_in_its_statement(tmp_path):
    """Different DP per site (no noise, a known noise seed), another rate, another clip, another seed: each a
    config no other site was sent, so each another statement (``round_terms``' digest covers every key)."""
    from fedllm.config import config_to_text
    from fedllm.flower.records import start_record
    from fedllm.flower.site import round_terms
    from fedllm.secagg.flower import _from_bytes, _to_bytes

    base = ["privacy.mode=distributed", "privacy.noise_multiplier=1.0", "privacy.delta=1e-5",
            "secagg.clip_norm=0"]  # fmt: skip

    def digest(*extra: str) -> bytes:
        cfg = config(tmp_path, 4, *base, *extra)
        content = _from_bytes(_to_bytes(start_record(ClientStart(round=1), config_to_text(cfg), 0, [])))
        return round_terms(config_to_text(cfg), content, GlobalState())[3]

    one = digest()
    assert digest() == one
    for change in ("privacy.noise_multiplier=0", "privacy.noise_seed=7", "client.lr=1e-30",
                   "privacy.clip_norm=2.0", "federation.seed=1", "client.fedprox.mu=0.02"):  # fmt: skip
        assert digest(change) != one, change


def test_a_site_pledges_one_statement_per_round_of_its_federation(tmp_path):
    """The record itself: the same statement again (a restart of the same round) is signed again; another for
    that round of that federation is refused, in a later call as in a later Flower run (the file is the
    record, not the process); another federation's round of the same number is its own; the refusal names no
    statement of the site's."""
    from fedllm.secagg import flower as sf

    pledges = tmp_path / "client-0-secagg-statements.json"
    one, other = bytes(32), bytes([1]) * 32
    sf.pledge_statement(pledges, "fed-a", 1, one)
    sf.pledge_statement(pledges, "fed-a", 1, one)
    with pytest.raises(sf.guard.Refused, match="other than the one this site signed") as refused:
        sf.pledge_statement(pledges, "fed-a", 1, other)
    assert one.hex() not in str(refused.value) and other.hex() not in str(refused.value)
    sf.pledge_statement(pledges, "fed-b", 1, other)
    sf.pledge_statement(pledges, "fed-a", 2, other)
    assert json.loads(pledges.read_text()) == {
        "fed-a/1": one.hex(),
        "fed-a/2": other.hex(),
        "fed-b/1": other.hex(),
    }
    with pytest.raises(sf.guard.Refused):  # nothing about the file's handle survives between calls
        sf.pledge_statement(pledges, "fed-b", 1, one)


@pytest.mark.parametrize("damage", ['{"fed-a/1": "00', "[]", "\udcff", '{"fed-a": "x", "fed-a/1": 1}'])
def test_a_site_whose_record_does_not_read_refuses_rather_than_forgets(tmp_path, damage):
    """A pledge or claim record damaged outside fedllm (cut short, another JSON value, bytes that are not
    UTF-8, values of the wrong type) refuses the round instead of starting an empty record (which would let
    the site sign a second statement, or train a round again); the damaged file is left as it was."""
    from fedllm.secagg import flower as sf

    for record in (tmp_path / "client-0-secagg-statements.json", tmp_path / "client-0-secagg-claims.json"):
        record.write_bytes(damage.encode("utf-8", "surrogateescape"))
        before = record.read_bytes()
        with pytest.raises(sf.guard.Refused, match=f"record {record.name} does not read"):
            if "statements" in record.name:
                sf.pledge_statement(record, "fed-a", 1, bytes(32))
            else:
                sf.claim_round(record, "fed-a", 1)
        assert record.read_bytes() == before
