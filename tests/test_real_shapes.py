"""TinyLlama's real shapes (hidden 2048, intermediate 5632, GQA 32/4, vocabulary 32000), one decoder layer: a
round of every strategy with mixed ranks up to 64 on all seven projections, through the simulation's own round
loop on an in-memory model (the full-depth numbers are scripts/bench_real_shapes.py's)."""

from __future__ import annotations

import pytest
import torch

from data_prep.prompts import TokenizedExample
from fedllm.aggregation import STRATEGIES
from fedllm.config import load_config

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def one_layer():
    from fedllm.model.builtin_base import build_tokenizer, tinyllama_shaped

    return {"model": tinyllama_shaped(1), "tokenizer": build_tokenizer()}


def random_tokens(n: int, seq_len: int, vocab: int, seed: int) -> list[TokenizedExample]:
    g = torch.Generator().manual_seed(seed)
    return [
        TokenizedExample(ids, list(ids))
        for ids in torch.randint(3, vocab, (n, seq_len), generator=g).tolist()
    ]


@pytest.mark.parametrize(
    "strategy",
    [
        # Fed-SB's initialization takes a dense SVD of each module's averaged step (2048 x 5632 here): a
        # one-time cost of seconds per module on 2 CPU cores, so it runs with the slow tests
        pytest.param(s, marks=pytest.mark.slow) if s == "fedsb" else s
        for s in sorted(set(STRATEGIES) - {"local"})
    ],
)
def test_every_strategy_runs_at_tinyllama_shape(tmp_path, one_layer, strategy):
    from accelerate import Accelerator

    from fedllm.assembly import federation_on
    from fedllm.simulation import Simulation

    ranks = [16] if STRATEGIES[strategy].hook.local_params else [64, 16, 4]  # FLoRAL: C adaptors of one rank
    cfg = load_config(
        None,
        [
            f"aggregation.name={strategy}",
            "federation.num_clients=3",
            f"lora.ranks={ranks}",
            f"lora.target_modules={MODULES}",
            "lora.trainable_modules=[]",
            "client.local_steps=1",
            "client.batch_size=1",
            "eval.benchmark=none",
            "eval.personalized=false",
            "federation.rounds=1",
            # FedSA-LoRA: clients share B this round, so the global model has one (else it is the base)
            *(["aggregation.fedsa.share_b_every=1"] if strategy == "fedsa" else []),
            # Fed-SB's round 1 is its initialization: one step over init_examples micro-batches of 1
            *(["aggregation.fedsb.init_examples=1"] if strategy == "fedsb" else []),
        ],
    )
    model, vocab = one_layer["model"], one_layer["model"].config.vocab_size
    data = [(random_tokens(2, 48, vocab, k), []) for k in range(3)]
    driver = Simulation(
        cfg,
        tmp_path,
        federation=federation_on(cfg, Accelerator(cpu=True), model, one_layer["tokenizer"], data),
    )
    try:
        row = driver.run_round(1).row
        assert row["n_updates"] == 3, row["failed"]
        adapter, _, _ = driver.server.global_adapter()
        adapter = adapter or driver.server.state.residual  # FLoRA, FLoRIST: the round's update is in the base
        assert len(adapter) == len(MODULES)  # every projection of the layer
        base = driver.runtime.model.get_base_model()
        for key, f in adapter.items():
            module = base.get_submodule(key).base_layer
            assert f.B.shape[0] == module.out_features and f.A.shape[1] == module.in_features, key
            assert (
                f.A.shape[0] == f.B.shape[1] <= sum(driver.server.strategy.adapter_rank(r) for r in ranks * 3)
            )
            assert torch.isfinite(f.A).all() and torch.isfinite(f.B).all() and f.B.abs().sum() > 0, key
    finally:
        one_layer["model"] = driver.runtime.model.unload()  # the bare base for the next strategy
