"""OpenFedLLM's ``main_sft.py``, unchanged, from its own checkout, on scripts/bench_peers.py's job.

Runs in OpenFedLLM's own environment (``scripts/peers/setup_peers.sh``: torch 2.0.1, transformers 4.31,
peft 0.4, trl 0.7.2), not in fedllm's: it imports nothing of fedllm. ``main_sft.py`` reads its names with
``from utils import *`` and ``from federated_learning import *``, so the changes below are made to those
modules before it runs (``runpy``), and its own code stays as it is. Each change, and why:

1. **data**: ``get_dataset`` / ``process_sft_dataset`` / ``split_dataset`` give each client the benchmark's
   own chats (``DATA/client-K.jsonl``: instruction, response), in place of a Hub dataset shuffled and cut by
   ``--seed`` into IID shards (its loaders know only named datasets);
2. **tokenizer**: ``AutoTokenizer.from_pretrained(..., use_fast=False)`` asks for a slow tokenizer, which a
   BPE checkpoint without ``vocab.json`` does not have: the fast one is loaded (the same vocabulary);
3. **trainer seed**: ``get_training_args`` passes no seed (HF's 42 at every seed of a study): it gets
   ``--seed``;
4. **RoPE base**: transformers 4.31's Llama has no ``rope_theta`` (its rotary base is fixed at 10,000);
   SmolLM2's is 100,000, so without this the model is another model (logits off by up to 4.3 on the
   benchmark's probes): the attention's rotary embedding takes the config's ``rope_theta``
   (:func:`rope_base_from_config`, which ``scripts/bench_peers.py prepare`` also applies when it checks the
   logits);
5. aligned runs only (not with ``--defaults``): the **prompt** (``TEMPLATE_DICT["alpaca"]``) becomes
   FlowerTune's with the EOS after the response (fedllm's ``data.template=flowertune``), and the **learning
   rate** stays ``--learning_rate`` in every round (``cosine_learning_rate`` otherwise anneals it to 1e-6 over
   the rounds);
6. **events**: the time each round starts and ends, and each client's training starts, takes its first step
   and ends, appended to ``--events`` (what the benchmark's round and start-up times are read from).

    ofl-venv/bin/python scripts/peers/openfedllm_job.py --repo PEERS/openfedllm --model MODEL --data DATA \
        --out OUT --events EVENTS.jsonl --seed 0 [--defaults] [main_sft.py's own arguments ...]

Prints the final global adapter's folder on its last line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import runpy
import sys
import time
from typing import Any

FLOWERTUNE_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n### Instruction:\n{}\n### Response: {}{}"
)


def rope_base_from_config() -> None:
    """Give transformers 4.31's Llama attention the config's ``rope_theta`` as its rotary base (that version
    knows no such key and uses 10,000): a no-op where the library reads it itself."""
    import inspect

    from transformers.models.llama import configuration_llama, modeling_llama

    if "rope_theta" in inspect.signature(configuration_llama.LlamaConfig.__init__).parameters:
        return
    # transformers 4.31's API (the peer's venv), which the typed venv's transformers 5 lacks
    original = modeling_llama.LlamaAttention._init_rope  # type: ignore[attr-defined]

    def init_rope(self: Any) -> None:
        if self.config.rope_scaling is not None:
            original(self)
            return
        base = float(getattr(self.config, "rope_theta", 10000.0))
        self.rotary_emb = modeling_llama.LlamaRotaryEmbedding(  # type: ignore[call-arg]
            self.head_dim, max_position_embeddings=self.max_position_embeddings, base=base
        )

    modeling_llama.LlamaAttention._init_rope = init_rope  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="a folder of client-K.jsonl files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--defaults", action="store_true", help="its own prompt and learning-rate schedule")
    args, rest = ap.parse_known_args()
    for name in ("repo", "model", "data", "out", "events"):  # the run changes into --out
        setattr(args, name, os.path.abspath(getattr(args, name)))
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, args.repo)

    def event(name: str, **fields: Any) -> None:
        with open(args.events, "a") as f:
            f.write(json.dumps({"t": time.time(), "event": name, **fields}) + "\n")

    event("process_start", pid=os.getpid())
    rope_base_from_config()
    clients = sorted(glob.glob(os.path.join(args.data, "client-*.jsonl")))
    # config.py parses the command line when it is imported: main_sft.py's arguments are set first
    sys.argv = ["main_sft.py", "--seed", str(args.seed), "--num_clients", str(len(clients)), *rest]
    os.chdir(args.out)
    os.makedirs("output", exist_ok=True)
    import config
    import datasets
    import federated_learning
    import transformers
    import utils
    import utils.template
    from transformers import TrainerCallback

    local = [datasets.Dataset.from_json(p) for p in clients]
    everything = datasets.concatenate_datasets(local)
    utils.get_dataset = lambda name, local_dir: everything
    utils.process_sft_dataset = lambda name, dataset, sample: dataset
    federated_learning.split_dataset = lambda fed_args, script_args, dataset: local

    slow = transformers.AutoTokenizer.from_pretrained

    def fast(*a: Any, **k: Any) -> Any:
        k["use_fast"] = True
        return slow(*a, **k)

    transformers.AutoTokenizer.from_pretrained = fast  # type: ignore[method-assign]
    training_args = config.get_training_args

    def seeded(script_args: Any, lr: float) -> Any:
        out = training_args(script_args, lr)
        out.seed = script_args.seed
        return out

    config.get_training_args = seeded
    if not args.defaults:
        utils.template.TEMPLATE_DICT["alpaca"] = (FLOWERTUNE_PROMPT, "\n### Response:")
        utils.cosine_learning_rate = lambda round_idx, num_rounds, lr, lr_min: lr
    pick = federated_learning.get_clients_this_round

    def clients_this_round(fed_args: Any, round_idx: int) -> Any:
        event("round_start", round=round_idx + 1)
        return pick(fed_args, round_idx)

    federated_learning.get_clients_this_round = clients_this_round
    aggregate = federated_learning.global_aggregate

    def global_aggregate(*a: Any, **k: Any) -> Any:
        out = aggregate(*a, **k)
        event("round_end", round=int(a[5]) + 1)  # (fed_args, global_dict, locals, counts, clients, round)
        return out

    federated_learning.global_aggregate = global_aggregate
    make_trainer = federated_learning.get_fed_local_sft_trainer

    class FirstStep(TrainerCallback):
        def __init__(self) -> None:
            self.done = False

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if not self.done:
                self.done = True
                event("first_step")

    def trainer(**kwargs: Any) -> Any:
        event("client_start")
        t = make_trainer(**kwargs)
        t.add_callback(FirstStep())
        train = t.train

        def timed(*a: Any, **k: Any) -> Any:
            out = train(*a, **k)
            event("client_end", steps=int(t.state.global_step), loss=float(out.training_loss))
            return out

        t.train = timed
        return t

    federated_learning.get_fed_local_sft_trainer = trainer
    runpy.run_path(os.path.join(args.repo, "main_sft.py"), run_name="__main__")
    event("process_end")
    final = sorted(glob.glob(os.path.join(args.out, "output", "*", "checkpoint-*")))
    print(os.path.abspath(final[-1]) if final else "no adapter saved")


if __name__ == "__main__":
    main()
