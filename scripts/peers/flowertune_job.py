"""Flower's FlowerTune LLM app (the leaderboard's template, rendered by ``scripts/peers/setup_peers.sh``) on
scripts/bench_peers.py's job, on Flower's Simulation Engine.

Runs in the app's own environment (its pyproject's pins: trl 0.8.1, peft 0.6.2, transformers 4.50.3, torch
2.4.0, Flower with Ray), not in fedllm's: it imports nothing of fedllm. The app's ClientApp runs in Ray's
workers, where a wrapper's monkeypatches do not reach, so the app is copied into ``--out`` and its files are
changed there, each change asserted to apply (the checkout itself is left as it is). Each change, and why:

1. ``models.py``: the template loads only 4- or 8-bit bases (bitsandbytes, which needs CUDA) in bfloat16:
   ``model.quantization = 0`` loads the base in float32 unquantized, without
   ``prepare_model_for_kbit_training``;
   the LoRA dropout (hard-coded 0.075) is read from ``model.lora.peft-lora-dropout`` (0.075 unless set);
2. ``dataset.py``: the partition is the benchmark's own (a local jsonl with a ``client_id``: flwr-datasets'
   ``NaturalIdPartitioner``), in place of a Hub dataset cut into IID shards; aligned runs only: the prompt
   gets the EOS after the response (fedllm's ``data.template=flowertune``; the template's has none);
3. ``client_app.py`` / ``strategy.py``: events (each round's start and end, each client's training start,
   first step and end, the communication tracker's bytes) appended to ``$BENCH_EVENTS``; the trainer's seed
   and ``report_to`` come from the run config (``train.training-arguments.seed``, ``report-to``: the template
   has neither key, and the config refuses keys it does not have);
4. the run config (``pyproject.toml``'s ``[tool.flwr.app.config]``, with the job's values) is handed to the
   apps in (a copy of) their context, as ``flwr run`` would (``run_simulation`` passes none).

    ft-venv/bin/python scripts/peers/flowertune_job.py --app PEERS/flowertune-app --model MODEL \
        --data DATA/train.jsonl --out OUT --events EVENTS.jsonl --seed 0 --clients 4 [--defaults] \
        [key=value ...]

Prints the final global adapter's folder on its last line.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import shutil
import sys
import time
from typing import Any

EVENT_CODE = """
def _event(name, **fields):
    import json, os, time
    path = os.environ.get("BENCH_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "event": name, **fields}) + "\\n")
"""


def patch(path: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in the app's file, once; the change must apply."""
    with open(path) as f:
        text = f.read()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: the change does not apply (the app is not the pinned template's)")
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def patch_app(app: str, aligned: bool) -> None:
    pkg = os.path.join(app, "flowertune")
    patch(
        os.path.join(pkg, "models.py"),
        """    else:
        raise ValueError(""",
        """    elif model_cfg.quantization == 0:  # (benchmark) a float32 base, unquantized
        quantization_config = None
    else:
        raise ValueError(""",
    )
    patch(
        os.path.join(pkg, "models.py"),
        """        torch_dtype=torch.bfloat16,""",
        """        torch_dtype=torch.bfloat16 if quantization_config is not None else torch.float32,""",
    )
    patch(
        os.path.join(pkg, "models.py"),
        """    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=model_cfg.gradient_checkpointing
    )""",
        """    if quantization_config is not None:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=model_cfg.gradient_checkpointing
        )
    elif model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()""",
    )
    patch(
        os.path.join(pkg, "models.py"),
        """        lora_dropout=0.075,""",
        """        lora_dropout=float(model_cfg.lora.get("peft_lora_dropout", 0.075)),""",
    )
    patch(
        os.path.join(pkg, "dataset.py"),
        """        partitioner = IidPartitioner(num_partitions=num_partitions)
        FDS = FederatedDataset(
            dataset=dataset_name,
            partitioners={"train": partitioner},
        )""",
        """        from flwr_datasets.partitioner import NaturalIdPartitioner

        partitioner = NaturalIdPartitioner(partition_by="client_id")
        FDS = FederatedDataset(
            dataset="json", data_files=dataset_name, partitioners={"train": partitioner}
        )""",
    )
    if aligned:
        patch(
            os.path.join(pkg, "dataset.py"),
            """            f"### Response: {example['response'][i]}"
        )""",
            """            f"### Response: {example['response'][i]}{EOS}"
        )""",
        )
        patch(
            os.path.join(pkg, "dataset.py"),
            """    tokenizer.pad_token = tokenizer.eos_token""",
            """    tokenizer.pad_token = tokenizer.eos_token
    global EOS
    EOS = tokenizer.eos_token""",
        )
        patch(
            os.path.join(pkg, "dataset.py"),
            "FDS = None  # Cache FederatedDataset",
            'FDS = None  # Cache FederatedDataset\nEOS = ""',
        )
    client = os.path.join(pkg, "client_app.py")
    patch(
        client,
        "# Flower ClientApp\napp = ClientApp()",
        EVENT_CODE + "\n# Flower ClientApp\napp = ClientApp()",
    )
    patch(
        client,
        """    # Parse config
    partition_id = context.node_config["partition-id"]""",
        """    _event("client_start", client=int(context.node_config["partition-id"]))
    # Parse config
    partition_id = context.node_config["partition-id"]""",
    )
    patch(
        client,
        """    # Do local training
    results = trainer.train()""",
        """    from transformers import TrainerCallback

    class _FirstStep(TrainerCallback):
        done = False

        def on_step_end(self, *a, **k):
            if not self.done:
                self.done = True
                _event("first_step", client=int(partition_id))

    trainer.add_callback(_FirstStep())
    # Do local training
    results = trainer.train()
    _event("client_end", client=int(partition_id), steps=int(trainer.state.global_step),
           loss=float(results.training_loss))""",
    )
    strategy = os.path.join(pkg, "strategy.py")
    patch(strategy, "class FlowerTuneLlm(FedAvg):", EVENT_CODE + "\n\nclass FlowerTuneLlm(FedAvg):")
    patch(
        strategy,
        """        messages = super().configure_train(server_round, arrays, config, grid)""",
        """        _event("round_start", round=int(server_round))
        messages = super().configure_train(server_round, arrays, config, grid)""",
    )
    patch(
        strategy,
        """        arrays, metrics = super().aggregate_train(server_round, replies)
""",
        """        arrays, metrics = super().aggregate_train(server_round, replies)
        _event("round_end", round=int(server_round), mb_total=float(self.comm_tracker.curr_comm_cost))
""",
    )


def run_config(app: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]`` (flattened, as ``context.run_config`` holds it) with
    ``overrides``; a key the app does not have is refused, as ``flwr run --run-config`` refuses it."""
    import tomllib

    with open(os.path.join(app, "pyproject.toml"), "rb") as f:
        tree = tomllib.load(f)["tool"]["flwr"]["app"]["config"]

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
        return out

    cfg = flat(tree)
    added = {
        "train.training-arguments.seed",
        "train.training-arguments.report-to",
        "model.lora.peft-lora-dropout",
    }
    unknown = set(overrides) - set(cfg) - added
    if unknown:
        raise SystemExit(f"run config: keys the app does not have: {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


def value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text.strip("'\""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--app", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="a jsonl with instruction, output and client_id")
    ap.add_argument("--out", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--cpus-per-client", type=float, default=1.0)
    ap.add_argument("--defaults", action="store_true", help="the template's prompt (no EOS)")
    args, rest = ap.parse_known_args()
    os.environ["BENCH_EVENTS"] = os.path.abspath(args.events)
    with open(args.events, "a") as f:
        f.write(json.dumps({"t": time.time(), "event": "process_start", "pid": os.getpid()}) + "\n")
    app = os.path.join(os.path.abspath(args.out), "app")
    shutil.rmtree(app, ignore_errors=True)
    shutil.copytree(args.app, app)
    patch_app(app, aligned=not args.defaults)
    overrides = {
        "model.name": os.path.abspath(args.model),
        "model.quantization": 0,
        "static.dataset.name": os.path.abspath(args.data),
        "strategy.fraction-train": 1.0,
        "train.training-arguments.seed": args.seed,
        "train.training-arguments.report-to": "none",
    }
    overrides.update({k: value(v) for k, v in (r.split("=", 1) for r in rest)})
    config = run_config(app, overrides)
    sys.path.insert(0, app)
    os.environ["PYTHONPATH"] = os.pathsep.join([app, os.environ.get("PYTHONPATH", "")])
    os.chdir(args.out)  # the ServerApp saves its adapters under ./results/<time>/peft_<round>

    import flowertune.client_app as client_module
    import flowertune.server_app as server_module
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    server, client = ServerApp(), ClientApp()

    def with_config(context: Any) -> Any:
        # a copy (the engine refuses a run config changed in place); its state is shared
        mine = copy.copy(context)
        mine.run_config = {**context.run_config, **config}
        return mine

    @server.main()
    def main_with_config(grid: Any, context: Any) -> None:
        server_module.main(grid, with_config(context))

    @client.train()
    def train_with_config(msg: Any, context: Any) -> Any:
        return client_module.train(msg, with_config(context))

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}},
    )
    with open(args.events, "a") as f:
        f.write(json.dumps({"t": time.time(), "event": "process_end"}) + "\n")
    final = sorted(
        glob.glob(os.path.join(args.out, "results", "*", "peft_*")), key=lambda p: int(p.rsplit("_", 1)[1])
    )
    print(os.path.abspath(final[-1]) if final else "no adapter saved")


if __name__ == "__main__":
    main()
