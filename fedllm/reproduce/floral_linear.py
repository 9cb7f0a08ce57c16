"""FLoRAL's synthetic linear task (Almansoori et al., "Collaborative and Efficient Personalization with
Mixtures of Adaptors", arXiv 2410.03497, Section 5 and Figure 2; reference code zeligism/FLoRAL), run by
fedllm's FLoRAL strategy, its client-side mixture and its server.

K clients in C interleaved clusters (client k in cluster k mod C) each fit ``y = (x W_c + b)[:, :3]`` with
``W_c = W + 2 u_c v_c`` (a rank-1 difference per cluster) from a handful of examples; a linear model 10 -> 3
with rank-1 adaptors. Methods:

* ``fedavg``: one shared model (the base alone, federated);
* ``local``: the base federated, one rank-1 adaptor per client that never leaves it;
* ``floral``: the base federated (weights proportional to the clients' example counts), C rank-1 adaptors
  averaged with their routers' weights, each client's router its own (fedllm's FLoRAL with the
  reference's settings: plain SGD, zero-initialized routers with U[0, 1) noise, LoRA preconditioning,
  bias adaptors);
* ``floral_oracle``: FLoRAL with each client's router fixed on its true cluster.

Reported: each method's test MSE on the clients' held-out examples (one number per seed), and for FLoRAL
the share of clients whose router's argmax is their true cluster, up to a relabelling of the adaptors.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fedllm.aggregation.fedit import FedIT
from fedllm.aggregation.floral import FLoRAL, FloralOptions
from fedllm.aggregation.local import LocalOnly
from fedllm.client.module_runtime import ModuleClient, ModuleRuntime
from fedllm.client.runtime import HOOK
from fedllm.client.sft import SFT
from fedllm.protocol import ClientInfo
from fedllm.reproduce import common
from fedllm.server import Sampling, Server, ServerPolicy

NAME = "floral-linear"
METHODS = ("fedavg", "local", "floral", "floral_oracle")
LABELS = {
    "fedavg": "FedAvg",
    "local": "local adaptor",
    "floral": "FLoRAL",
    "floral_oracle": "FLoRAL, optimal router",
}
DIM, DIM_OUT, RANK = 10, 3, 1


def synthetic(clients: int, clusters: int, samples: int, seed: int) -> tuple[list, list]:
    """Each client's (x, y) examples (see module docstring; written from the paper's description)."""
    g = torch.Generator().manual_seed(seed + 27)
    W = torch.randn(DIM, DIM, generator=g) / DIM**0.5
    u = torch.randn(clusters, DIM, RANK, generator=g) / DIM**0.5
    v = torch.randn(clusters, RANK, DIM, generator=g) / RANK**0.5
    bias = torch.randn(DIM, generator=g) / DIM**0.5
    g = torch.Generator().manual_seed(seed + 11)
    xs, ys = [], []
    for k in range(clients):
        x = torch.randn(samples, DIM, generator=g)
        y = (x @ (W + 2.0 * u[k % clusters] @ v[k % clusters]) + bias)[:, :DIM_OUT]
        xs.append(x)
        ys.append(y)
    return xs, ys


class Linear(torch.nn.Module):
    """The task's model: ``linear`` 10 -> 3 with a squared-error loss (per output, as torch's MSELoss)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, DIM_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=torch.nn.functional.mse_loss(self.linear(x), y))


def model_for(method: str, clusters: int, seed: int) -> tuple[torch.nn.Module, list[str], str | None]:
    """The model, its federated base parameters and its adapter (none for FedAvg)."""
    torch.manual_seed(seed)
    model = Linear()
    if method == "fedavg":
        return model, ["linear.weight", "linear.bias"], None
    from peft import LoraConfig, inject_adapter_in_model

    rank = RANK * (1 if method == "local" else clusters)
    model = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=["linear"]), model)
    for name, p in model.named_parameters():
        if "base_layer" in name:
            p.requires_grad_(True)  # the base is federated, not frozen
    return model, ["linear.base_layer.weight", "linear.base_layer.bias"], "default"


def strategy_for(method: str, clusters: int, args):
    if method == "fedavg":
        return FedIT()
    if method == "local":
        return LocalOnly()
    return FLoRAL.from_options(
        FloralOptions(
            num_adaptors=clusters,
            router_lr=0.0 if method == "floral_oracle" else args.router_lr,
            router_noise=1.0,
            precondition_eps=1e-5,
            bias_adaptors=True,
        )
    )


def batches_for(x: torch.Tensor, y: torch.Tensor, batch_size: int):
    """A client's epoch of shuffled batches each round, from the seed of the round's local work."""

    def batches(round_idx: int, seed: int):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        while True:
            for i in range(0, len(x), batch_size):
                idx = order[i : i + batch_size]
                yield {"x": x[idx], "y": y[idx]}

    return batches


def run(method: str, args, seed: int) -> dict[str, Any]:
    """One method, one seed: the clients' test MSE and (FLoRAL) the routers' clusters."""
    k, c = args.clients, args.clusters
    xs, ys = synthetic(k, c, args.samples, seed)
    n_train = int(args.train_share * args.samples)
    model, dense, adapter = model_for(method, c, seed)
    strategy = strategy_for(method, c, args)
    steps = math.ceil(n_train / args.batch_size)  # one local epoch
    work = {
        "steps": steps,
        "lr": args.lr,
        "sgd_lr": args.lr,
        "batch_size": args.batch_size,
        "scheduler": "constant",
        "max_grad_norm": 0.0,
    }
    runtime = ModuleRuntime(model, SFT("sgd"), work, dense, strategy.client_hook(), adapter, seed)
    params = dict(model.named_parameters())
    server = Server(
        strategy=strategy,
        clients=[ClientInfo(i, RANK, 1.0, n_train) for i in range(k)],
        modules=runtime.module_shapes(),
        sampling=Sampling(seed=seed, clients_per_round=k),
        dense={name: params[name].detach().clone() for name in dense},
        policy=ServerPolicy(clip_norm_ratio=0.0),
    )
    clients = {
        i: ModuleClient(i, n_train, batches_for(xs[i][:n_train], ys[i][:n_train], args.batch_size))
        for i in range(k)
    }
    if method == "floral_oracle":  # the reference's optimal router: ~1 on the client's cluster, ~0 elsewhere
        for i, client in clients.items():
            logits = torch.full((c,), -100.0)
            logits[i % c] = 0.0
            client.state = {f"{HOOK}all": logits}

    def test_mse(r: int) -> float:
        """The clients' mean held-out MSE, each on its own model after round ``r``."""
        losses = []
        for i, client in clients.items():
            start = server.client_start(r + 1, i)
            runtime.switch_in(client, start)
            with torch.no_grad(), runtime.view(client, start, "global" if method == "fedavg" else "own"):
                model.eval()
                losses.append(float(model(xs[i][n_train:], ys[i][n_train:]).loss))
                model.train()
        return float(np.mean(losses))

    every = max(1, args.rounds // 30)
    curve: list[tuple[int, float]] = []
    common.federate(
        server,
        runtime,
        clients,
        args.rounds,
        lambda r: curve.append((r, test_mse(r))) if r % every == 0 or r == args.rounds else None,
        progress=f"{method} seed {seed}",
    )
    out: dict[str, Any] = {"test_mse": curve[-1][1], "curve": curve}
    if method == "floral":
        picked = [int(torch.argmax(client.state[f"{HOOK}all"])) for client in clients.values()]
        truth = [i % c for i in range(k)]
        out["router_correct"] = max(
            sum(perm[p] == t for p, t in zip(picked, truth, strict=True)) / k
            for perm in itertools.permutations(range(c))
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=10, help="K clients (default 10)")
    p.add_argument("--clusters", type=int, default=2, help="C clusters (default 2)")
    p.add_argument("--rounds", type=int, default=300, help="communication rounds (default 300)")
    p.add_argument("--samples", type=int, default=8, help="examples per client (default 8, the paper's)")
    p.add_argument("--train-share", type=float, default=0.8, help="of them for training (default 0.8)")
    p.add_argument("--batch-size", type=int, default=4, help="local batch size (default 4)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD step of the model and adaptors (default 0.1)")
    p.add_argument("--router-lr", type=float, default=0.1, help="SGD step of the routers (default 0.1)")
    common.add_common_arguments(p, "runs/reproduce-floral-linear")


QUICK = {"rounds": 40}


def plot(results: dict[str, Any], out: Path) -> list[str]:
    plt, fig, axes = common.figure(2, 6.0, 4.2)
    ax = axes[0]
    for m, color in zip(METHODS, ["#999999", "#cc8844", "#3366aa", "#88aadd"], strict=True):
        rounds, mean = zip(*results["methods"][m]["curve"], strict=True)
        ax.semilogy(rounds, mean, color=color, label=LABELS[m])
    ax.set_xlabel("communication round")
    ax.set_ylabel("clients' test MSE (mean over seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    means = [results["methods"][m]["test_mse"]["mean"] for m in METHODS]
    stds = [results["methods"][m]["test_mse"]["std"] for m in METHODS]
    ax.bar(
        range(len(METHODS)), means, yerr=stds, capsize=4, color=["#999999", "#cc8844", "#3366aa", "#88aadd"]
    )
    ax.set_yscale("log")
    ax.set_xticks(range(len(METHODS)), [LABELS[m].replace(", ", "\n") for m in METHODS], fontsize=8)
    ax.set_ylabel("clients' test MSE (mean +/- std over seeds)")
    ax.set_title(
        f"synthetic linear task: K={results['clients']}, C={results['clusters']}, "
        f"{results['samples']} examples per client, {results['rounds']} rounds",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")
    return common.save_figure(plt, fig, out, "floral_linear")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    seeds = common.seeds_of(args)
    per_seed = {m: [run(m, args, s) for s in seeds] for m in METHODS}
    methods = {
        m: {
            "test_mse": {
                **common.mean_std([r["test_mse"] for r in rows]),
                "per_seed": [r["test_mse"] for r in rows],
            },
            "curve": [
                (rd, float(np.mean([r["curve"][j][1] for r in rows])))
                for j, (rd, _) in enumerate(rows[0]["curve"])
            ],
            **({"router_correct": [r["router_correct"] for r in rows]} if m == "floral" else {}),
        }
        for m, rows in per_seed.items()
    }
    results = {
        "clients": args.clients,
        "clusters": args.clusters,
        "samples": args.samples,
        "rounds": args.rounds,
        "lr": args.lr,
        "router_lr": args.router_lr,
        "seeds": seeds,
        "methods": methods,
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot(results, out)
    common.write_results(out, NAME, results)
    best_baseline = min(methods[m]["test_mse"]["mean"] for m in ("fedavg", "local"))
    lines = [
        f"FLoRAL synthetic linear task: K={args.clients}, C={args.clusters}, {args.samples} examples per "
        f"client, {args.rounds} rounds, seeds {seeds}"
    ]
    for m in METHODS:
        t = methods[m]["test_mse"]
        lines.append(f"  {m:<14} test MSE {t['mean']:.4f} +/- {t['std']:.4f}")
    lines.append(f"  FLoRAL's routers on their true cluster: {methods['floral']['router_correct']}")
    lines.append(f"results {out / 'results.json'}; plots {', '.join(results['plots'])}")
    summary = {
        "reproduction": NAME,
        "test_mse": {m: methods[m]["test_mse"]["mean"] for m in METHODS},
        "floral_over_best_baseline": methods["floral"]["test_mse"]["mean"] / best_baseline,
        "router_correct": methods["floral"]["router_correct"],
        "output": str(out),
    }
    return common.finish(summary, "\n".join(lines))
