"""State bounded by what a round needs: the merged residual in its smallest exact form, one exact catch-up
for a client that missed merges (or the whole residual past the window), the same base for a returning
client as for one that never left."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES
from fedllm.factors import DenseDelta, LoraFactors, add_to_residual, numerical_rank, smallest_exact
from fedllm.protocol import ClientInfo
from fedllm.server import RoundPlan, Server, ServerPolicy
from tests.test_trust import honest

SHAPES = {"l0.q_proj": (12, 10), "l0.down_proj": (40, 30)}


def random_update(gen, rank: int) -> dict[str, LoraFactors]:
    return {
        k: LoraFactors(torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen), 0.5)
        for k, (o, i) in SHAPES.items()
    }


def test_the_residual_stays_exact_and_bounded_by_the_modules_size():
    gen = torch.Generator().manual_seed(0)
    residual, total = {}, {k: torch.zeros(o, i) for k, (o, i) in SHAPES.items()}
    for _ in range(40):
        update = random_update(gen, 3)
        residual = add_to_residual(residual, update)
        for k, f in update.items():
            total[k] += f.delta()
        for k, f in residual.items():
            o, i = SHAPES[k]
            assert f.numel() <= o * i  # never larger than the dense matrix, whatever the rounds
            assert_close(f.delta(), total[k], rtol=1e-4, atol=1e-4 * float(total[k].abs().max()))
    assert isinstance(residual["l0.q_proj"], DenseDelta) and isinstance(residual["l0.down_proj"], DenseDelta)


def test_a_repeated_direction_is_refactorized_to_its_true_rank():
    gen = torch.Generator().manual_seed(1)
    same = random_update(gen, 2)
    residual = {}
    for _ in range(5):  # the same rank-2 update five times: rank 2, not 10
        residual = add_to_residual(residual, same)
    f = residual["l0.down_proj"]
    assert isinstance(f, LoraFactors) and f.rank == 2
    assert_close(f.delta(), 5 * same["l0.down_proj"].delta(), rtol=1e-5, atol=1e-5)
    s = torch.linalg.svdvals(torch.randn(8, 6, generator=gen))
    assert numerical_rank(s, (8, 6)) == 6 and numerical_rank(torch.tensor([1.0, 1e-9]), (8, 6)) == 1
    # factors of rank r on a 12 x 10 module cost 22 r: kept up to rank 5 (110 < 120), dense from rank 6
    assert isinstance(smallest_exact(LoraFactors(torch.randn(5, 10), torch.randn(12, 5))), LoraFactors)
    assert isinstance(smallest_exact(LoraFactors(torch.randn(6, 10), torch.randn(12, 6))), DenseDelta)


def flora_server(window: int) -> Server:
    return Server(
        strategy=STRATEGIES["flora"](catchup_window=window),
        clients=[ClientInfo(k, r, 2.0, 10 * (k + 1)) for k, r in enumerate((4, 8, 4, 8))],
        modules=SHAPES,
        policy=ServerPolicy(clip_norm_ratio=0),
    )


def play(server: Server, rounds: int, present: dict[int, range]) -> dict[int, dict[str, torch.Tensor]]:
    """Rounds in which client k takes part when r is in present[k]; each client keeps its own dense base and
    applies every catch-up it downloads exactly as a site would. Returns each client's base."""
    bases = {k: {m: torch.zeros(o, i) for m, (o, i) in SHAPES.items()} for k in server.clients}
    at = dict.fromkeys(server.clients, 0)
    for r in range(1, rounds + 1):
        active = [k for k in server.clients if r in present[k]]
        plan = RoundPlan(r, active, [], {k: server.client_start(r, k) for k in active})
        for k in active:
            c = plan.starts[k].catchup
            if c is not None and c.to_round > at[k]:
                assert c.from_round in (at[k], 0)
                for m, f in c.update.items():
                    bases[k][m] = (bases[k][m] if c.from_round else torch.zeros_like(bases[k][m])) + f.delta()
                at[k] = c.to_round
        server.finish_round(plan, {k: honest(server, plan, k, size=0.1, seed=r) for k in active})
    return bases


@pytest.mark.parametrize(("window", "reset"), [(30, False), (3, True)])
def test_a_returning_client_gets_one_exact_catchup_and_the_same_base(window, reset):
    """Client 3 is away for rounds 3-9: it downloads one update (what it missed, or past the window the whole
    residual from its original base) and its base equals an always-present client's and the server's."""
    server = flora_server(window)
    present = {0: range(1, 12), 1: range(1, 12), 2: range(1, 12), 3: [1, 2, 10, 11]}
    downloads = []
    original = server.client_start

    def spy(r, k):
        start = original(r, k)
        if k == 3 and start.catchup is not None:
            downloads.append((r, start.catchup.from_round, start.catchup.to_round, start.numel()))
        return start

    server.client_start = spy
    bases = play(server, 11, present)
    assert [d[:3] for d in downloads] == [(2, 0, 1), (10, 0 if reset else 1, 9), (11, 9, 10)]
    missed = downloads[1][3]  # one update of what it missed, not eight: at most the residual's size
    assert missed <= sum(f.numel() for f in server.state.residual.values())
    residual, last = server.state.residual, server.merges.recent[-1][1]  # round 11's merge is in no base yet
    for m in SHAPES:
        assert_close(bases[3][m], bases[0][m], rtol=1e-4, atol=1e-5)
        assert_close(bases[0][m], residual[m].delta() - last[m].delta(), rtol=1e-4, atol=1e-5)
    assert len(server.merges.recent) <= window  # the server keeps at most the window


def test_a_runtime_catches_up_from_where_it_is_or_from_its_original_base(builtin_base):
    from transformers import AutoModelForCausalLM

    from fedllm.client.runtime import ClientRuntime
    from fedllm.config import load_config
    from fedllm.factors import lora_modules
    from fedllm.model.parallel import Layout
    from fedllm.protocol import Catchup

    cfg = load_config(None, ["lora.ranks=[4]", "lora.target_modules=[q_proj]"])
    runtime = ClientRuntime(
        model=AutoModelForCausalLM.from_pretrained(builtin_base),
        tokenizer=None,
        ranks=[4],
        lora_cfg=cfg.lora,
        client_cfg=cfg.client,
        seed=0,
        layout=Layout("clients", 0, 1),
        accelerator=None,
    )
    layers = {k: m.get_base_layer() for k, m in lora_modules(runtime.model, "r4").items()}
    original = {k: m.weight.detach().clone() for k, m in layers.items()}
    shapes = {k: tuple(m.weight.shape) for k, m in layers.items()}
    gen = torch.Generator().manual_seed(0)

    def update(rank):
        return {
            k: LoraFactors(torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen), 0.1)
            for k, (o, i) in shapes.items()
        }

    first, second, whole = update(2), update(3), update(5)
    runtime.catch_up(Catchup(0, 1, first))
    runtime.catch_up(Catchup(1, 3, second))
    for k, m in layers.items():
        assert_close(m.weight, original[k] + first[k].delta() + second[k].delta(), rtol=1e-5, atol=1e-6)
    runtime.catch_up(Catchup(1, 3, second))  # already has it: nothing happens
    with pytest.raises(RuntimeError, match="starts at round 2, but this base has the merges up to round 3"):
        runtime.catch_up(Catchup(2, 5, whole))
    runtime.catch_up(Catchup(0, 5, whole))  # the whole residual, from the original base
    for k, m in layers.items():
        assert_close(m.weight, original[k] + whole[k].delta(), rtol=1e-5, atol=1e-5)
    assert runtime.applied_round == 5


# ----------------------------------------------------------------- client state on disk, personal evaluation
def scaffold_cfg(run_dir, rounds: int, *extra: str):
    from fedllm.config import load_config
    from tests.conftest import tiny_overrides

    return load_config(
        None,
        tiny_overrides(
            run_dir,
            "client.algorithm=scaffold",
            "federation.num_clients=12",
            "federation.clients_per_round=3",
            f"federation.rounds={rounds}",
            "data.builtin_examples_per_skill=16",
            "client.personalize_steps=1",
            *extra,
        ),
    )


def simulate(cfg, run_dir, resume: bool = False):
    from fedllm.simulation import Simulation

    sim = Simulation(cfg, run_dir)
    sim.setup()
    return sim, sim.run(resume=resume)


def test_client_state_lives_on_disk_and_a_resume_reads_it_back(tmp_path, builtin_base):
    """SCAFFOLD's c_k: no client keeps state in memory between rounds, checkpoints hold only the index (no
    client tensors), old versions are pruned, and a run stopped after round 2 then resumed ends where an
    uninterrupted run ends."""
    from fedllm.files import read_jsonl, round_checkpoints
    from fedllm.run import checkpoint as ckpt
    from tests.conftest import assert_close_updates

    ref, summary = simulate(scaffold_cfg(tmp_path / "ref", 4), tmp_path / "ref")
    assert all(not c.state for c in ref.clients)  # state is read for a round's clients only
    files = sorted(p.name for p in (tmp_path / "ref" / "clients").iterdir())
    _, tensors, meta = ckpt.load_latest(tmp_path / "ref")
    assert not any(k.startswith("client.") for k in tensors)
    index = meta["client_state"]
    trained = {k for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl")[1:] for k in r["sampled"]}
    assert {int(k) for k in index} == trained and 0 < len(trained) < 12
    kept = {  # the versions the kept checkpoints (two by default) refer to, and no other
        f"client-{k}-r{r}.safetensors"
        for p in round_checkpoints(tmp_path / "ref")
        for k, r in ckpt.load_checkpoint(p)[1]["client_state"].items()
    }
    assert files == sorted(kept) and len(files) < 4 * 3

    simulate(scaffold_cfg(tmp_path / "cut", 2), tmp_path / "cut")
    sim, _ = simulate(scaffold_cfg(tmp_path / "cut", 4), tmp_path / "cut", resume=True)
    assert sim.store.index == ref.store.index
    assert_close_updates(tmp_path / "ref", tmp_path / "cut", 1e-5)
    rows = read_jsonl(tmp_path / "ref" / "metrics.jsonl")[1:]
    personal = [
        r for r in rows if "personal" in r
    ]  # (a round whose sampled clients hold no test data has none)
    assert personal  # personalized evaluation visits the round's sampled clients only (the default)
    assert all({int(k) for k in r["personal"]} <= set(r["sampled"]) for r in personal)
    assert summary["personalized_on"] == "each evaluation round's sampled clients"


# ----------------------------------------------------------------------------------- data at scale
def test_partitioning_meets_the_minimum_in_one_pass_and_names_the_option():
    import time

    from data_prep.partition import dirichlet, shards
    from data_prep.schema import DataError

    cats = [f"c{i % 8}" for i in range(200_000)]

    def timed(k):
        t = time.perf_counter()
        parts = dirichlet(cats, k, 0.1, seed=0, min_size=8)
        return time.perf_counter() - t, parts

    small, _ = timed(16)
    large, parts = timed(4096)
    flat = [i for p in parts for i in p]
    assert min(len(p) for p in parts) >= 8 and sorted(flat) == list(range(200_000))  # a partition, topped up
    # one draw and a heap, no retries and no scan per moved example: 256x the clients is far from 256x time
    assert large < 30 * small + 0.5, (small, large)
    parts = shards(cats, 1000, 2, seed=0, min_size=150)
    assert min(len(p) for p in parts) >= 150 and sorted(i for p in parts for i in p) == list(range(200_000))
    with pytest.raises(DataError, match=r"data.min_examples_per_client = 8 needs 8000 examples.*has 3400"):
        dirichlet(cats[:3400], 1000, 0.5, seed=0, min_size=8)


def test_tokens_are_cached_per_data_tokenizer_template_and_length(tmp_path, builtin_base):
    from transformers import AutoTokenizer

    from data_prep.builtin_skills import instruction_examples
    from data_prep.prompts import tokenize_example
    from data_prep.tokenized import tokenize_cached

    tok = AutoTokenizer.from_pretrained(builtin_base)
    examples = instruction_examples(6, seed=0)
    rows, row_of = tokenize_cached(examples, tok, "plain", 40, tmp_path)
    again, _ = tokenize_cached(examples, tok, "plain", 40, tmp_path)  # read back, not tokenized again
    assert len(list(tmp_path.glob("tokens-*.arrow"))) == 1 and len(again) == len(rows)
    for i, e in enumerate(examples):  # batched and cached tokens equal one-at-a-time tokenization
        one = tokenize_example(e, tok, "plain", 40)
        assert (one is None) == (row_of[i] < 0)
        if one is not None:
            got = rows.select_table_rows([row_of[i]])[0]
            assert got == one and rows.lengths()[row_of[i]] == len(one.input_ids)
    picked = rows.select([3, 0, 4, 1])  # a batch's read in one call: the rows, in the batch's order
    assert picked.take([2, 0, 3]) == [picked[2], picked[0], picked[3]]
    _assert_batches_read_from_buffers_are_collated_rows(picked, [2, 0, 3, 2], tok.pad_token_id)
    for change in [(examples[:-1], "plain", 40), (examples, "alpaca", 40), (examples, "plain", 24)]:
        tokenize_cached(change[0], tok, change[1], change[2], tmp_path)
    assert len(list(tmp_path.glob("tokens-*.arrow"))) == 4  # every change is a new cache file


def _assert_batches_read_from_buffers_are_collated_rows(rows, positions, pad_id) -> None:
    """``TokenRows.batch`` (numpy gathers on the token buffers) gives what collating the rows gives."""
    from data_prep.prompts import collate

    got, want = rows.batch(positions, pad_id), collate(rows.take(positions), pad_id)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_batch_reads_from_token_buffers_equal_collated_rows_in_every_table_layout():
    """One chunk, several chunks (a table concatenated from parts: offsets per chunk), and a table seen
    through an indices mapping (read row by row instead)."""
    import datasets

    from data_prep.tokenized import TokenRows

    ids = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15], [16, 17, 18]]
    labels = [[-100, 6, 7], [8], [-100, -100, 11, 12, 13], [14, 15], [-100, 17, 18]]

    def table(lo: int, hi: int):
        rows = {"input_ids": ids[lo:hi], "labels": labels[lo:hi], "length": [len(i) for i in ids[lo:hi]]}
        return datasets.Dataset.from_dict(rows).with_format("numpy")

    one = table(0, 5)
    parts = datasets.concatenate_datasets([table(0, 2), table(2, 5)]).with_format("numpy")
    assert parts.data.column("input_ids").num_chunks == 2
    mapped = one.select([4, 3, 2, 1, 0])
    for t in (one, parts, mapped):
        rows = TokenRows(t).select([4, 2, 0, 3, 1])
        for positions in ([0, 1, 2, 3, 4], [3, 3, 1], [2]):
            _assert_batches_read_from_buffers_are_collated_rows(rows, positions, pad_id=0)
    assert TokenRows(mapped)._columns() is None and TokenRows(parts)._columns() is not None


def test_length_grouped_batches_pad_less_cover_every_example_and_stay_shuffled():
    import random

    from fedllm.client.base import epoch_batches

    lengths = [random.Random(i).randint(5, 120) for i in range(400)]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    plain = epoch_batches(lengths, 8, random.Random(0))
    grouped = epoch_batches(lengths, 8, random.Random(0), group_by_length=True)
    assert sorted(i for b in grouped for i in b) == list(range(400))
    assert padding(grouped) < 0.2 * padding(plain)
    widths = [max(lengths[i] for i in b) for b in grouped]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)  # batch order shuffled
    assert grouped == epoch_batches(lengths, 8, random.Random(0), group_by_length=True)  # seeded
    # off, the batches are exactly the plain shuffled ones (runs without it are unchanged)
    order = list(range(400))
    random.Random(0).shuffle(order)
    assert plain == [order[i : i + 8] for i in range(0, 400, 8)]


def test_a_flora_catchup_reveals_the_sum_not_each_clients_factors(gen):
    """FLoRA's stacked merge holds every sampled client's own B_k; what a site downloads (its catch-up) is
    the same update as the SVD of the sum, in which no client's B_k columns appear."""
    from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, example_weights
    from fedllm.server.catchup import MergeLog
    from tests.conftest import random_factors

    key = "m.q_proj"
    ups = [ClientUpdate(k, 10 + 5 * k, {key: random_factors(2, 40, 24, 1.0, gen)}) for k in range(3)]
    res = STRATEGIES["flora"]().aggregate(ups, GlobalState())
    log = MergeLog([0, 1, 2])
    log.add(1, res.merged)
    down = log.catchup(0, res.state.residual).update[key]
    p = example_weights(ups)
    dense = sum(w * u.factors[key].delta() for w, u in zip(p, ups, strict=True))
    assert torch.allclose(down.delta(), dense, rtol=1e-5, atol=1e-6)

    def nearest(cols: torch.Tensor, b: torch.Tensor) -> float:  # closest column, relative, up to sign
        d = torch.minimum((cols - b[:, None]).norm(dim=0), (cols + b[:, None]).norm(dim=0))
        return float(d.min() / b.norm())

    own = [u.factors[key].folded().B for u in ups]
    stacked = res.merged[key].folded().B
    assert max(nearest(stacked, b[:, j]) for b in own for j in range(2)) < 1e-6  # the stack holds each B_k
    assert min(nearest(down.folded().B, b[:, j]) for b in own for j in range(2)) > 1e-2  # the download not


def test_a_large_federations_ranks_are_summarized_not_listed():
    from fedllm.assembly import describe_ranks

    assert describe_ranks([4, 8]) == "[4, 8]"
    text = describe_ranks([2, 4, 8] * 333 + [2])
    assert text == "2 (334 clients), 4 (333 clients), 8 (333 clients)"
