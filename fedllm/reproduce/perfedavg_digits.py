"""Per-FedAvg's experiment (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Section 5), run by fedllm's own
Per-FedAvg and SFT client algorithms and server, on scikit-learn's bundled ``load_digits`` images.

The paper's user partition, scaled to the 1,797 digits: half of the users hold ``a`` images of each of
classes 0-4, the other half ``a/2`` images of one class of 0-4 and ``a`` of one class of 5-9; each user's
held-out images follow its own mix (half as many). The model is the paper's MLP (hidden 80 and 60, ELU).
Methods: FedAvg (plain SGD) followed by one local step, Per-FedAvg FO and HF, each evaluated after one step
of size alpha on the user's own training data, on its held-out images; uniform server weights, a share of
the users per round, plain SGD at a constant step (the paper's setting, ``client.preset=paper``). Accuracy
is averaged over users; seeds change the partition, the initialization and the sampling; the differences
to FedAvg are paired per seed with a 95% t interval, whichever way they fall.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fedllm.aggregation.fedit import FedIT
from fedllm.client.module_runtime import ModuleClient, ModuleRuntime
from fedllm.client.perfedavg import PerFedAvg
from fedllm.client.sft import SFT
from fedllm.protocol import ClientInfo
from fedllm.reproduce import common
from fedllm.server import Sampling, Server, ServerPolicy

NAME = "perfedavg-digits"
METHODS = ("fedavg", "perfedavg_fo", "perfedavg_hf")


def load_digits_data() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError(
            "perfedavg-digits needs scikit-learn's bundled digits: pip install 'fedllm[reproduce]'"
        ) from None
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def partition(labels: np.ndarray, users: int, a: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each user's (train, held-out) indices (see module docstring)."""
    rng = np.random.default_rng(seed)
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in range(10)}
    shift = int(rng.integers(5))  # which class of 5-9 goes with which of 0-4: the seed's

    def take(c: int, n: int) -> list[int]:
        if len(pools[c]) < n:
            raise ValueError(f"digits: class {c} has too few images left for this partition (lower --a)")
        return [pools[c].pop() for _ in range(n)]

    out = []
    for u in range(users):
        if u < users // 2:  # a images of each of classes 0-4
            parts = [(c, a) for c in range(5)]
        else:  # a/2 of one class of 0-4 and a of one class of 5-9 (in turn, so no class runs out)
            v = u - users // 2
            parts = [(v % 5, a // 2), (5 + (v + shift) % 5, a)]
        train = [i for c, n in parts for i in take(c, n)]
        test = [i for c, n in parts for i in take(c, max(1, n // 2))]
        out.append((np.array(train), np.array(test)))
    return out


class MLP(torch.nn.Module):
    """The paper's network: 64 -> 80 -> 60 -> 10 with ELU, cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 80),
            torch.nn.ELU(),
            torch.nn.Linear(80, 60),
            torch.nn.ELU(),
            torch.nn.Linear(60, 10),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.net(x), y))


def batches_for(x: torch.Tensor, y: torch.Tensor, batch_size: int):
    def batches(round_idx: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            idx = torch.randint(len(x), (batch_size,), generator=g)
            yield {"x": x[idx], "y": y[idx]}

    return batches


def run(method: str, args, seed: int) -> float:
    """One method, one seed: the users' mean held-out accuracy after one personalization step."""
    images, labels = load_digits_data()
    parts = partition(labels, args.users, args.a, seed)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    torch.manual_seed(seed)
    model = MLP()
    dense = [name for name, _ in model.named_parameters()]
    algorithm = (
        SFT("sgd") if method == "fedavg" else PerFedAvg(alpha=args.alpha, variant=method.split("_")[1])
    )
    work = {
        "steps": args.local_steps,
        "lr": args.beta,
        "sgd_lr": args.beta,
        "batch_size": args.batch_size,
        "scheduler": "constant",
        "max_grad_norm": 0.0,
    }
    runtime = ModuleRuntime(model, algorithm, work, dense, seed=seed)
    params = dict(model.named_parameters())
    server = Server(
        strategy=FedIT(),
        clients=[ClientInfo(u, 1, 1.0, len(parts[u][0])) for u in range(args.users)],
        modules={},
        sampling=Sampling(seed=seed, clients_per_round=max(1, round(args.fraction * args.users))),
        dense={k: params[k].detach().clone() for k in dense},
        policy=ServerPolicy(clip_norm_ratio=0.0, weighting="uniform"),
    )
    clients = {
        u: ModuleClient(u, len(tr), batches_for(x[tr], y[tr], args.batch_size))
        for u, (tr, _) in enumerate(parts)
    }
    common.federate(server, runtime, clients, args.rounds, progress=f"{method} seed {seed}")
    accs = []
    for u, (_, te) in enumerate(parts):
        start = server.client_start(args.rounds + 1, u)
        # one step of size alpha on the user's own training data (Per-FedAvg personalizes with alpha itself)
        runtime.personalize(clients[u], start, steps=1, sgd_lr=args.alpha, personalize_lr=args.alpha)
        with torch.no_grad():
            accs.append(float((model.net(x[te]).argmax(1) == y[te]).float().mean()))
    return float(np.mean(accs))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", type=int, default=20, help="users (default 20; the paper's MNIST run: 50)")
    p.add_argument("--a", type=int, default=10, help="images per class a (default 10, scaled to the digits)")
    p.add_argument("--fraction", type=float, default=0.2, help="share of users per round (default 0.2)")
    p.add_argument("--rounds", type=int, default=300, help="communication rounds (default 300)")
    p.add_argument("--local-steps", type=int, default=10, help="local steps tau (default 10)")
    p.add_argument("--batch-size", type=int, default=10, help="batch size of every gradient (default 10)")
    p.add_argument("--alpha", type=float, default=0.05, help="inner / personalization step (default 0.05)")
    p.add_argument("--beta", type=float, default=0.05, help="outer / FedAvg step (default 0.05)")
    common.add_common_arguments(p, "runs/reproduce-perfedavg-digits")
    p.set_defaults(seeds=5)


QUICK = {"rounds": 10}


def main(args: argparse.Namespace) -> int:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    seeds = common.seeds_of(args)
    acc = {m: [run(m, args, s) for s in seeds] for m in METHODS}
    methods: dict[str, Any] = {}
    for m in METHODS:
        methods[m] = {"accuracy": {**common.mean_std(acc[m]), "per_seed": acc[m]}}
        if m != "fedavg":
            methods[m]["vs_fedavg"] = paired(acc[m], acc["fedavg"])
    results = {
        "users": args.users,
        "a": args.a,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "alpha": args.alpha,
        "beta": args.beta,
        "fraction": args.fraction,
        "seeds": seeds,
        "methods": methods,
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot(results, out)
    common.write_results(out, NAME, results)
    lines = [
        f"Per-FedAvg on the digits: {args.users} users, a={args.a}, {args.rounds} rounds of tau="
        f"{args.local_steps}, alpha={args.alpha}, beta={args.beta}, seeds {seeds}"
    ]
    for m in METHODS:
        a = methods[m]["accuracy"]
        text = f"  {m:<13} accuracy after one step {a['mean']:.4f} +/- {a['std']:.4f}"
        if "vs_fedavg" in methods[m]:
            d = methods[m]["vs_fedavg"]
            text += (
                f"   vs FedAvg {100 * d['diff']:+.1f} points [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
            )
        lines.append(text)
    lines.append(f"results {out / 'results.json'}; plots {', '.join(results['plots'])}")
    summary = {
        "reproduction": NAME,
        "accuracy": {m: methods[m]["accuracy"]["mean"] for m in METHODS},
        "output": str(out),
    }
    return common.finish(summary, "\n".join(lines))


def paired(values: list[float], baseline: list[float]) -> dict[str, float]:
    """The mean per-seed difference with its 95% Student-t interval (``fedllm compare``'s rule)."""
    from fedllm.run.compare import paired as paired_t

    d = paired_t(values, baseline)
    return {k: (float(v) if not isinstance(v, bool) else v) for k, v in d.items()}


def plot(results: dict[str, Any], out: Path) -> list[str]:
    plt, fig, axes = common.figure(1, 5.5, 4.0)
    ax = axes[0]
    labels = {
        "fedavg": "FedAvg + 1 step",
        "perfedavg_fo": "Per-FedAvg (FO)",
        "perfedavg_hf": "Per-FedAvg (HF)",
    }
    for i, m in enumerate(METHODS):
        vals = results["methods"][m]["accuracy"]["per_seed"]
        ax.scatter([i] * len(vals), vals, color="#888888", s=12, zorder=3)
        ax.errorbar(
            i,
            np.mean(vals),
            yerr=np.std(vals, ddof=1) if len(vals) > 1 else 0,
            fmt="o",
            capsize=5,
            color="#3366aa",
            zorder=4,
        )
    ax.set_xticks(range(len(METHODS)), [labels[m] for m in METHODS], fontsize=9)
    ax.set_ylabel("users' held-out accuracy after one step")
    ax.set_title(
        f"digits, {results['users']} users, a={results['a']}, {results['rounds']} rounds", fontsize=9
    )
    ax.grid(alpha=0.3, axis="y")
    return common.save_figure(plt, fig, out, "perfedavg_digits")
