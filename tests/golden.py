"""Golden global adapters: every strategy, client algorithm and DP mode on one fixed seed.

The base is a small Llama with random weights drawn from a fixed seed (no pretraining, so it is the
same on every x86 CPU up to float rounding) and the built-in tokenizer; each case runs 2 rounds of 3
local steps on the built-in data and keeps its exported global update (B @ A per module, plus dense
modules). ``tests/data/golden_adapters.safetensors`` holds what the code gave when the fixture was
made; ``tests/test_golden.py`` checks that the code still gives it, within float tolerance, so that a
refactoring cannot change what a run computes without a test noticing.

    python -m tests.golden          # rewrite the fixture (only when a change of numbers is intended)
    python -m tests.golden CASE ... # add or rewrite those cases only
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parent / "data" / "golden_adapters.safetensors"

COMMON = [
    "data.builtin_examples_per_skill=12",
    "data.eval_size=16",
    "data.min_examples_per_client=4",
    "federation.num_clients=3",
    "federation.rounds=2",
    "federation.seed=3",
    "lora.ranks=[2,4,8]",
    "lora.trainable_modules=[]",
    "client.local_steps=3",
    "client.batch_size=4",
    "eval.benchmark=none",
    "eval.personalized=false",
    # the server's clip these golden runs were recorded with (its default then; now a simulation runs
    # without it): kept, so that the goldens still pin every strategy's arithmetic, HetLoRA's pruning included
    "aggregation.clip_norm_ratio=2",
]

# case name -> its overrides (besides COMMON)
CASES: dict[str, list[str]] = {
    "fedit": ["aggregation.name=fedit"],
    "flora": ["aggregation.name=flora"],
    "flexlora": ["aggregation.name=flexlora"],
    "florist": ["aggregation.name=florist", "aggregation.florist.fixed_rank=3"],
    "floral": ["aggregation.name=floral", "lora.ranks=[4]"],
    "fedex": ["aggregation.name=fedex"],
    "hetlora": ["aggregation.name=hetlora"],
    "hetlora_prune": ["aggregation.name=hetlora", "aggregation.hetlora.prune_gamma=0.5"],
    "fedsa_share": ["aggregation.name=fedsa", "aggregation.fedsa.share_b_every=1"],
    "ffa": ["aggregation.name=ffa"],
    "fedsvd": ["aggregation.name=fedsvd"],
    "rolora": ["aggregation.name=rolora"],
    "fedsb": ["aggregation.name=fedsb"],  # round 1 its initialization, round 2 R
    "fedit_fedadam": ["aggregation.name=fedit", "aggregation.server_opt=fedadam"],
    "ffa_fedavgm": ["aggregation.name=ffa", "aggregation.server_opt=fedavgm"],
    "local": ["aggregation.name=local"],
    "fedit_fedprox": ["aggregation.name=fedit", "client.algorithm=fedprox", "client.fedprox.mu=0.5"],
    "fedit_scaffold": ["aggregation.name=fedit", "client.algorithm=scaffold"],
    "fedit_perfedavg_fo": ["aggregation.name=fedit", "client.algorithm=perfedavg"],
    "fedit_perfedavg_hf": [
        "aggregation.name=fedit",
        "client.algorithm=perfedavg",
        "client.perfedavg.variant=hf",
    ],
    "floral_fedprox": ["aggregation.name=floral", "lora.ranks=[4]", "client.algorithm=fedprox"],
    "fedit_dense": ["aggregation.name=fedit", "lora.trainable_modules=[lm_head]"],
    "fedit_dropout": ["aggregation.name=fedit", "lora.dropout=0.1"],
    "dp_central_fedit": [
        "aggregation.name=fedit",
        "privacy.mode=central",
        "privacy.clip_norm=0.5",
        "privacy.noise_multiplier=0.3",
        "privacy.noise_seed=7",
    ],
    "dp_central_ffa": [
        "aggregation.name=ffa",
        "privacy.mode=central",
        "privacy.clip_norm=0.5",
        "privacy.noise_multiplier=0.3",
        "privacy.noise_seed=7",
    ],
    "dp_central_fedsb": [
        "aggregation.name=fedsb",
        "privacy.mode=central",
        "privacy.clip_norm=0.5",
        "privacy.noise_multiplier=0.3",
        "privacy.noise_seed=7",
    ],
    # what travels encoded (comm.*): the same cases also run on the Flower driver, where the encodings
    # themselves travel (tests/test_golden.py)
    "fedit_int8": ["aggregation.name=fedit", "comm.upload=int8", "comm.download=int8"],
    "flexlora_int4": ["aggregation.name=flexlora", "comm.upload=int4", "comm.download=int8"],
    "fedsb_int8": ["aggregation.name=fedsb", "comm.upload=int8"],
    "fedit_down_int8": ["aggregation.name=fedit", "comm.download=int8"],  # added after the codec move
    "dp_local_flexlora": [
        "aggregation.name=flexlora",
        "privacy.mode=local",
        "privacy.clip_norm=0.5",
        "privacy.noise_multiplier=0.05",
        "privacy.noise_seed=7",
    ],
}


def random_base(folder: Path) -> Path:
    """A 2-layer Llama (hidden 32) with seeded random weights and the built-in tokenizer, saved as a
    model folder that ``model.name`` can point at."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedllm.model.builtin_base import build_tokenizer

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(20261201)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_case(name: str, base: Path, run_dir: Path) -> dict[str, torch.Tensor]:
    """One case's exported global update, keyed ``<case>/<tensor>``."""
    from fedllm.config import load_config
    from fedllm.simulation import Simulation
    from tests.conftest import adapter_updates

    overrides = [f"model.name={base}", *COMMON, *CASES[name], f"output.dir={run_dir}"]
    sim = Simulation(load_config(None, overrides), run_dir)
    sim.setup()
    sim.run()
    return {f"{name}/{k}": v.contiguous() for k, v in adapter_updates(run_dir).items()}


# the cases the Flower driver runs too (tests/test_golden.py): its encodings travel as bytes
ON_FLOWER = ("fedit", "fedit_int8", "flexlora_int4", "fedsb_int8", "fedit_down_int8")


def run_case_on_flower(
    name: str, base: Path, run_dir: Path, monkeypatch, traffic: list | None = None
) -> dict[str, torch.Tensor]:
    """One case through the Flower ServerApp and ClientApp (real records, real parsing, this process's
    sites: ``tests/flower_grid.py``), its exported global update keyed as :func:`run_case`'s; ``traffic``
    gets each train message's (start, reply) contents as they travelled."""
    from fedllm.config import load_config
    from fedllm.flower import client_app, server_app
    from tests.conftest import adapter_updates
    from tests.flower_grid import Sent, SiteGrid

    monkeypatch.setattr(server_app, "Message", Sent)
    monkeypatch.setattr(client_app, "Message", lambda content, reply_to: content)
    overrides = [f"model.name={base}", *COMMON, *CASES[name], f"output.dir={run_dir}"]
    cfg = load_config(None, overrides)
    grid = SiteGrid(run_dir.parent / f"{name}-sites", cfg.federation.num_clients)

    def keep(node, kind, message, content):
        if kind == "train" and traffic is not None:
            traffic.append((message.content, content))
        return content

    grid.tamper = keep
    driver = server_app.FlowerDriver(cfg, run_dir, grid, startup_timeout_s=5)
    driver.setup()
    driver.run()
    return {f"{name}/{k}": v.contiguous() for k, v in adapter_updates(run_dir).items()}


def main(out: Path = FIXTURE, only: list[str] | None = None) -> int:
    """Write the fixture: every case, or only the cases named (the others' tensors kept as they are)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    unknown = sorted(set(only or []) - set(CASES))
    if unknown:
        print(f"unknown cases {unknown}; the cases are {sorted(CASES)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    names = only or list(CASES)
    tensors: dict[str, torch.Tensor] = {}
    if only and out.exists():
        tensors = {k: v for k, v in load_file(str(out)).items() if k.split("/", 1)[0] not in names}
    with tempfile.TemporaryDirectory() as tmp:
        base = random_base(Path(tmp) / "base")
        for name in names:
            tensors.update(run_case(name, base, Path(tmp) / name))
            print(f"{name}: done", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    print(f"wrote {len(tensors)} tensors of {len({k.split('/', 1)[0] for k in tensors})} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(only=sys.argv[1:] or None))
