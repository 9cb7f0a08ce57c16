"""The base's evaluation is computed once and reused by runs that would compute the same numbers: a
comparison's other variants reuse it with identical figures and answers; anything it depends on (the
model's files, the held-out sample, the benchmark, the evaluation settings) makes another key; a damaged
entry is recomputed; the local-only reference scores each client's own adapter."""

from __future__ import annotations

import json

import pytest

from fedllm.model import evaluation_cache
from tests.conftest import tiny_overrides

EVAL = [
    "eval.personalized=false",
    "eval.generate_size=4",
    "eval.max_new_tokens=4",
    "federation.rounds=1",
    "federation.seed=11",
]
FIGURES = ("eval_loss", "eval_token_acc", "accuracy", "rouge_l", "accuracy_categories", "rouge_l_tasks")


def _run(path, *extra):
    from fedllm.cli import main
    from fedllm.run.folder import RunFolder

    assert main(["run", *tiny_overrides(path, *EVAL, "eval.reuse_base=true", *extra)]) == 0
    answers = [json.loads(x) for x in (path / "generations.jsonl").read_text().splitlines()]
    return RunFolder(path).rows(), answers


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache of this test's own, so that no other test's entry is reused."""
    monkeypatch.setattr(evaluation_cache, "cache_folder", lambda: tmp_path / "evals")
    return tmp_path / "evals"


def test_another_variant_reuses_the_base_evaluation_with_identical_figures(tmp_path, own_cache):
    first, first_answers = _run(tmp_path / "fedit", "aggregation.name=fedit")
    assert "eval_reused" not in first[0] and len(list(own_cache.glob("*.json"))) == 1
    second, second_answers = _run(tmp_path / "flexlora", "aggregation.name=flexlora")
    assert second[0]["eval_reused"] is True
    assert "time_eval_loss_s" not in second[0]  # the first run's timings are not this run's
    recomputed, recomputed_answers = _run(
        tmp_path / "again", "aggregation.name=flexlora", "eval.reuse_base=false"
    )
    assert "eval_reused" not in recomputed[0]
    for key in FIGURES:  # what was reused is what evaluating again gives
        assert second[0][key] == first[0][key] == recomputed[0][key], key
    assert second_answers[0] == first_answers[0] == recomputed_answers[0]  # round 0's answers
    assert "eval_reused" not in second[1]  # after a round the model is the run's own


def test_what_the_evaluation_depends_on_makes_another_key(tmp_path, own_cache):
    _run(tmp_path / "a")
    _run(tmp_path / "limit", "eval.limit=2")  # another benchmark subset
    _run(tmp_path / "seed", "data.eval_size=8")  # another held-out sample
    _run(tmp_path / "tokens", "eval.max_new_tokens=3")  # other answers
    _run(tmp_path / "other_seed", "federation.seed=12")  # another held-out sample, as large
    assert len(list(own_cache.glob("*.json"))) == 5
    rows, _ = _run(tmp_path / "same", "aggregation.name=flora")  # nothing the evaluation reads differs
    assert rows[0]["eval_reused"] is True and len(list(own_cache.glob("*.json"))) == 5


def test_the_key_reads_the_held_out_rows_themselves(tmp_path):
    """The held-out set is read on demand from the token cache (a Sequence, not a list): the key must hold
    its rows, not its repr, which is the same for any two sets of the same class."""
    from collections.abc import Sequence

    from data_prep.prompts import TokenizedExample

    class Rows(Sequence):
        def __init__(self, ids):
            self.ids = ids

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return TokenizedExample([self.ids[i]], [self.ids[i]])

        def __repr__(self):
            return "Rows"

    def key(rows):
        return evaluation_cache.base_key(str(tmp_path), {}, rows, None, None, 8, "no")

    assert key(Rows([1, 2])) == key(Rows([1, 2])) != key(Rows([1, 3]))
    with pytest.raises(TypeError, match="cannot key on a object"):
        key([object()])


def test_the_key_follows_the_model_files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 10)

    def key():
        return evaluation_cache.base_key(str(model), {}, [], None, None, 8, "no")

    before = key()
    assert before == key()
    (model / "model.safetensors").write_bytes(b"y" * 11)
    assert key() != before
    assert evaluation_cache.base_key("org/hub-id", {}, [], None, None, 8, "no") is None  # nothing to read


def test_a_damaged_entry_is_evaluated_again(tmp_path, own_cache, caplog):
    first, _ = _run(tmp_path / "a")
    (entry,) = own_cache.glob("*.json")
    entry.write_text('{"eval_loss": ')  # torn
    again, _ = _run(tmp_path / "b")
    assert "eval_reused" not in again[0] and again[0]["eval_loss"] == first[0]["eval_loss"]
    assert "cannot be read" in caplog.text
    assert json.loads(entry.read_text())["eval_loss"] == first[0]["eval_loss"]  # rewritten whole


def test_local_only_scores_each_clients_own_adapter(tmp_path, own_cache):
    rows, answers = _run(
        tmp_path / "local",
        "aggregation.name=local",
        "federation.num_clients=3",
        "federation.clients_per_round=3",
    )
    last = rows[-1]
    scored = last["scored_clients"]
    assert sorted(scored) == ["0", "1", "2"]
    losses = [scored[c]["eval_loss"] for c in scored]
    assert len(set(losses)) == 3  # each its own adapter, not one global model three times
    assert last["eval_loss"] == pytest.approx(sum(losses) / 3)
    assert last["rouge_l"] == pytest.approx(sum(scored[c]["rouge_l"] for c in scored) / 3)
    assert sorted({a["client"] for a in answers[-1]["answers"]}) == [0, 1, 2]
    # local-only needs no communication: the round trip of a client's own adapter is its storage
    assert all(r["up_bytes"] == r["down_bytes"] == r["up_params"] == 0 for r in rows[1:] if "up_bytes" in r)
    assert any("up_bytes" in r for r in rows)  # (not vacuous: the training rows were read)
    mean_model, _ = _run(
        tmp_path / "mean",
        "aggregation.name=local",
        "aggregation.local.score=mean_adapter",
        "federation.num_clients=3",
        "federation.clients_per_round=3",
    )
    assert "scored_clients" not in mean_model[-1]
    assert mean_model[-1]["eval_loss"] not in losses


def test_general_prompts_are_scored_against_the_bases_own_answers(tmp_path, own_cache):
    from eval.general import GENERAL_PROMPTS
    from eval.rouge import rouge_l
    from fedllm.cli import main

    run = tmp_path / "run"
    rows, answers = _run(run, "eval.general_prompts=builtin", "federation.rounds=2")
    assert main(["run", "--resume", str(run), "federation.rounds=3"]) == 0  # the reference from the folder
    answers = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    from fedllm.run.folder import RunFolder

    rows = RunFolder(run).rows()
    general = {a["round"]: [x for x in a["answers"] if x["task"] == "general"] for a in answers}
    base = [x["answer"] for x in general[0]]
    assert [x["prompt"] for x in general[0]] == list(GENERAL_PROMPTS)
    assert json.loads((run / "general_reference.json").read_text()) == base
    assert rows[0]["general_agreement"] == 100.0
    for r in (1, 2, 3):
        mine = [x["answer"] for x in general[r]]
        want = rouge_l(mine, [[b] for b in base])
        assert [x["agreement"] for x in general[r]] == pytest.approx(want)
        assert rows[r]["general_agreement"] == pytest.approx(sum(want) / len(want))
    assert RunFolder(run).summary()["general_agreement_after"] == rows[-1]["general_agreement"]


def test_a_reused_evaluation_gives_the_general_prompts_reference(tmp_path, own_cache):
    _run(tmp_path / "a", "eval.general_prompts=builtin")
    second, _ = _run(tmp_path / "b", "eval.general_prompts=builtin", "aggregation.name=flexlora")
    assert second[0]["eval_reused"] is True and second[0]["general_agreement"] == 100.0
    assert not any(k.startswith("time_eval_") for k in second[0])  # no timing of the run that made it
    ref = [json.loads((tmp_path / r / "general_reference.json").read_text()) for r in ("a", "b")]
    assert ref[0] == ref[1] and len(ref[0]) == 20
    assert second[1]["general_agreement"] is not None  # scored against the reused reference


def test_only_the_bare_base_is_keyed(tmp_path):
    """A global model that computes anything else than the base is never stored or reused: a non-zero
    adapter product, other dense values, a bias; a zero product (peft's B at the start) is the base."""
    import torch

    from fedllm.config import load_config
    from fedllm.factors import LoraFactors
    from fedllm.simulation import Simulation

    sim = Simulation(load_config(None, tiny_overrides(tmp_path / "run")), tmp_path / "run")
    sim.setup()
    adapter, dense, biases = sim.server.global_adapter()
    assert sim.runtime.is_base(adapter, dense, biases)  # the run's own start
    key = next(iter(sim.runtime.module_shapes()))
    out_dim, in_dim = sim.runtime.module_shapes()[key]
    zero_b = {key: LoraFactors(torch.randn(4, in_dim), torch.zeros(out_dim, 4), 2.0)}
    assert sim.runtime.is_base(zero_b, dense, biases)
    trained = {key: LoraFactors(torch.randn(4, in_dim), torch.randn(out_dim, 4), 2.0)}
    assert not sim.runtime.is_base(trained, dense, biases)
    assert dense, "the default trains dense modules: the next case needs one"
    name = next(iter(dense))
    assert not sim.runtime.is_base(adapter, {**dense, name: dense[name] + 1e-3}, biases)
    assert not sim.runtime.is_base(adapter, dense, {key: torch.ones(out_dim)})


def test_local_only_skips_clients_that_never_trained(tmp_path, own_cache):
    rows, _ = _run(
        tmp_path / "local",
        "aggregation.name=local",
        "federation.num_clients=4",
        "federation.clients_per_round=1",
        "eval.personalized_clients=4",  # a fixed subset of all four: three have not trained after round 1
    )
    assert len(rows[-1]["scored_clients"]) == 1
