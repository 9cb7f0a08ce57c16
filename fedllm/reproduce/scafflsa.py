"""SCAFFLSA (Mangold et al., "SCAFFLSA: Taming Heterogeneity in Federated Linear Stochastic Approximation
and TD Learning", NeurIPS 2024; reference code pmangold/scafflsa), run by fedllm's own code.

Federated linear stochastic approximation: agent c solves ``A_c theta = b_c`` from samples
``(A_c(Z), b_c(Z))``. **FedLSA** takes H local steps ``theta <- theta - eta (A_c(Z) theta - b_c(Z))`` and the
server averages; with heterogeneous agents it converges to ``theta* + theta~``, biased by (Theorem 4.1)
``theta~ = (I - Gamma_H)^-1 rho_H``, ``Gamma_H = mean_c (I - eta A_c)^H``,
``rho_H = mean_c (I - (I - eta A_c)^H)(theta*_c - theta*)``. **SCAFFLSA** (Algorithm 2) subtracts a control
variate ``xi_c`` in each local step and updates it after the mean, ``xi_c += (theta_{t+1} - theta^c_H) /
(eta H)``; it removes the bias and keeps the linear speed-up in the number of agents.

Both run through fedllm: the clients are :class:`~fedllm.client.sft.SFT` (plain SGD) and
:class:`~fedllm.client.scaffold.Scaffold` (whose ``g - c_k + c`` with uniform weights is SCAFFLSA's
``g - xi_c``, ``xi_c = c_k - c``) on a one-parameter torch model whose loss has the gradient
``A(Z) theta - b(Z)`` (a semi-gradient: the coefficient is held constant); the server is fedllm's
:class:`~fedllm.server.Server` with FedIT averaging theta as a dense module, uniform weights, full
participation, no clipping, a constant step (the paper's setting: ``client.preset=paper``).

Problems: the paper's federated TD(0) on Garnet MDPs (30 states, 2 actions, branching 2, 8 features,
gamma 0.95; homogeneous agents are small perturbations of one MDP, heterogeneous ones alternate between two
MDPs with rewards of opposite sign, as in its Appendix G), written here from that description; or a problem
file (``--problem FILE.npz``: ``A`` (N, d, d) and ``b`` (N, d), each agent's expected system, ``theta0``
(d,), optional ``noise_A``, ``noise_b``: each step draws ``A_c + noise_A G`` and ``b_c + noise_b g``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fedllm.aggregation.fedit import FedIT
from fedllm.client.base import ClientAlgorithm
from fedllm.client.module_runtime import ModuleClient, ModuleRuntime
from fedllm.client.scaffold import Scaffold, ScaffoldServer
from fedllm.client.sft import SFT
from fedllm.protocol import AlgorithmServer, ClientInfo
from fedllm.reproduce import common
from fedllm.server import Sampling, Server, ServerPolicy

NAME = "scafflsa"
METHODS = ("fedlsa", "scafflsa")


# ---- problems ----------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """N agents' expected systems (``A`` N x d x d, ``b`` N x d), a start, and how one sample is drawn."""

    A: np.ndarray
    b: np.ndarray
    theta0: np.ndarray
    draw: Any = None  # (rng, agent, n) -> (n x d x d, n x d) samples; None: noise-free (the expected system)
    source: str = ""
    noise: dict[str, float] = field(default_factory=dict)

    @property
    def agents(self) -> int:
        return self.A.shape[0]

    @property
    def dim(self) -> int:
        return self.A.shape[1]

    def theta_star(self) -> np.ndarray:
        """The solution of the averaged system (uniform weights)."""
        return np.linalg.solve(self.A.mean(0), self.b.mean(0))

    def theta_agent(self, c: int) -> np.ndarray:
        return np.linalg.solve(self.A[c], self.b[c])

    def predicted_bias(self, eta: float, local_steps: int) -> np.ndarray:
        """FedLSA's bias theta~ = (I - Gamma_H)^-1 rho_H (Theorem 4.1)."""
        eye = np.eye(self.dim)
        powers = [np.linalg.matrix_power(eye - eta * self.A[c], local_steps) for c in range(self.agents)]
        gamma = np.mean(powers, axis=0)
        star = self.theta_star()
        rho = np.mean([(eye - g) @ (self.theta_agent(c) - star) for c, g in enumerate(powers)], axis=0)
        return np.linalg.solve(eye - gamma, rho)

    def samples(self, rng: np.random.Generator, agent: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.draw is None:
            return np.repeat(self.A[agent][None], n, 0), np.repeat(self.b[agent][None], n, 0)
        return self.draw(rng, agent, n)


def garnet(
    agents: int,
    heterogeneous: bool,
    seed: int = 0,
    states: int = 30,
    actions: int = 2,
    branching: int = 2,
    features: int = 8,
    gamma: float = 0.95,
) -> Problem:
    """Federated TD(0) with linear features on Garnet MDPs (see module docstring).

    Each state-action pair leads to ``branching`` random successor states; the policy takes one random
    action per state. Homogeneous agents perturb one transition kernel and one reward vector by U(0, 0.02);
    heterogeneous agents alternate between two kernels, and odd agents' rewards are negated. A sample is a
    state from the agent's stationary distribution and its successor: ``A(Z) = phi(s) (phi(s) - gamma
    phi(s'))^T``, ``b(Z) = r(s) phi(s)``.
    """
    rng = np.random.default_rng(seed)

    def kernel() -> np.ndarray:
        k = np.zeros((states, actions, states))
        for s in range(states):
            for a in range(actions):
                k[s, a, rng.choice(states, branching, replace=False)] = 1.0
        return k

    bases = [kernel(), kernel()] if heterogeneous else [kernel()]
    reward = rng.uniform(0.0, 1.0, states)
    phi = rng.uniform(0.0, 1.0, (states, features))
    phi /= phi.sum(1, keepdims=True)
    policy = np.zeros((states, actions))
    for s in range(states):
        policy[s, rng.integers(actions)] = 1.0
    chains, rewards, stationary = [], [], []
    for c in range(agents):
        k = bases[c % len(bases)]
        k = k + rng.uniform(0.0, 0.02, k.shape) * (k > 0)
        k /= k.sum(2, keepdims=True)
        p = np.einsum("sa,sat->st", policy, k)
        if heterogeneous:
            r = reward * (1.0 if c % 2 == 0 else -1.0)
        else:
            r = reward + rng.uniform(0.0, 0.02, states)
        evals, evecs = np.linalg.eig(p.T)
        mu = np.abs(np.real(evecs[:, np.argmin(np.abs(evals - 1.0))]))
        chains.append(p)
        rewards.append(r)
        stationary.append(mu / mu.sum())
    A = np.stack(
        [
            np.einsum("s,si,sj->ij", mu, phi, phi - gamma * p @ phi)
            for mu, p in zip(stationary, chains, strict=True)
        ]
    )
    b = np.stack([np.einsum("s,s,si->i", mu, r, phi) for mu, r in zip(stationary, rewards, strict=True)])
    cum = [np.cumsum(p, 1) for p in chains]

    def draw(sample_rng: np.random.Generator, agent: int, n: int):
        s = sample_rng.choice(states, n, p=stationary[agent])
        u = sample_rng.random(n)
        nxt = np.minimum((cum[agent][s] < u[:, None]).sum(1), states - 1)
        a = phi[s][:, :, None] * (phi[s] - gamma * phi[nxt])[:, None, :]
        return a, rewards[agent][s][:, None] * phi[s]

    problem = Problem(
        A, b, np.zeros(features), draw, f"garnet(agents={agents}, heterogeneous={heterogeneous})"
    )
    problem.theta0 = problem.theta_star() + 1.0  # the reference's start
    return problem


def load_problem(path: str | Path) -> Problem:
    """A problem file (see module docstring); every array is checked before anything runs."""
    path = Path(path)
    try:
        data = np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--problem {path}: not a readable .npz file ({e})") from None
    for key in ("A", "b", "theta0"):
        if key not in data:
            raise ValueError(
                f"--problem {path}: no array {key!r} (expected A (N, d, d), b (N, d), theta0 (d,))"
            )
    A, b, theta0 = (np.asarray(data[k], dtype=np.float64) for k in ("A", "b", "theta0"))
    if A.ndim != 3 or A.shape[1] != A.shape[2] or b.shape != A.shape[:2] or theta0.shape != A.shape[1:2]:
        raise ValueError(
            f"--problem {path}: shapes A {A.shape}, b {b.shape}, theta0 {theta0.shape}; expected (N, d, d), "
            "(N, d), (d,)"
        )
    noise_a = float(data["noise_A"]) if "noise_A" in data else 0.0
    noise_b = float(data["noise_b"]) if "noise_b" in data else 0.0
    if min(noise_a, noise_b) < 0:
        raise ValueError(f"--problem {path}: noise_A and noise_b must be >= 0")

    def draw(rng: np.random.Generator, agent: int, n: int):
        d = A.shape[1]
        return A[agent] + noise_a * rng.standard_normal((n, d, d)), b[agent] + noise_b * rng.standard_normal(
            (n, d)
        )

    noisy = noise_a > 0 or noise_b > 0
    return Problem(A, b, theta0, draw if noisy else None, str(path), {"noise_A": noise_a, "noise_b": noise_b})


# ---- the model and the federation ----------------------------------------------------------------------


class LinearSA(torch.nn.Module):
    """One parameter theta; the loss ``((A theta' - b) . theta)`` with theta' held constant has the gradient
    ``A theta - b``: an SGD step on it is the LSA update."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))

    def forward(self, A: torch.Tensor, b: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=((A @ self.theta.detach() - b) * self.theta).sum())


def batches_for(problem: Problem, agent: int, seed: int, local_steps: int):
    """Each round's H samples of ``agent`` from its own generator of (seed, agent, round)."""

    def batches(round_idx: int, _work_seed: int):
        rng = np.random.default_rng([seed, agent, round_idx])
        a, b = problem.samples(rng, agent, local_steps)
        a, b = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b))
        for i in range(local_steps):
            yield {"A": a[i], "b": b[i]}

    return batches


def federation(
    problem: Problem, method: str, local_steps: int, eta: float, seed: int, clip_norm_ratio: float = 0.0
) -> tuple[Server, ModuleRuntime, dict[int, ModuleClient]]:
    """fedllm's server, a runtime of the method's client algorithm on the LSA model, and the agents: the
    paper's setting (plain SGD at a constant step, no clipping, uniform weights, full participation)
    unless ``clip_norm_ratio`` asks the server to clip."""
    algorithm: ClientAlgorithm = Scaffold("sgd") if method == "scafflsa" else SFT("sgd")
    server_half = ScaffoldServer() if method == "scafflsa" else AlgorithmServer()
    n = problem.agents
    work = {
        "steps": local_steps,
        "lr": eta,
        "sgd_lr": eta,
        "batch_size": 1,
        "scheduler": "constant",
        "max_grad_norm": 0.0,
    }
    runtime = ModuleRuntime(LinearSA(problem.dim), algorithm, work, dense=["theta"], seed=seed)
    server = Server(
        strategy=FedIT(),
        clients=[ClientInfo(c, 1, 1.0, 1) for c in range(n)],
        modules={},
        algorithm=server_half,
        sampling=Sampling(seed=seed, clients_per_round=n),
        dense={"theta": torch.as_tensor(problem.theta0, dtype=torch.float32)},
        policy=ServerPolicy(clip_norm_ratio=clip_norm_ratio, weighting="uniform"),
    )
    clients = {c: ModuleClient(c, 1, batches_for(problem, c, seed, local_steps)) for c in range(n)}
    return server, runtime, clients


def control_variates(server: Server, runtime: ModuleRuntime, clients: dict[int, ModuleClient]) -> dict:
    """Each client's c_k as it takes effect at its next round (its pending one settled as the server says)."""
    from fedllm.client.runtime import ALGO, settle_pending

    out = {}
    for k, client in clients.items():
        download = server.algorithm.download(1, k)
        state = settle_pending(
            client.state,
            server.last_aggregated[k],
            lambda old, new, d=download: runtime.algorithm.settle(old, new, d),
        )
        out[k] = unprefix_theta(state, ALGO)
    return out


def unprefix_theta(state: dict, prefix: str) -> np.ndarray | None:
    t = state.get(f"{prefix}theta")
    return None if t is None else t.double().numpy()


def run(
    problem: Problem,
    method: str,
    local_steps: int,
    rounds: int,
    eta: float,
    seed: int,
    progress=None,
    at_fixed_point: bool = False,
):
    """One run: the per-round squared error to theta*, the final theta, and (SCAFFLSA) the agents' xi.
    ``at_fixed_point``: SCAFFLSA's agents start from their limit control variates
    ``xi*_c = A_c theta* - b_c`` (the reference's ``xi0="xilim"``), so that only the noise is measured."""
    server, runtime, clients = federation(problem, method, local_steps, eta, seed)
    star = problem.theta_star()
    if at_fixed_point and method == "scafflsa":  # xi_c = c_k - c with c = mean c_k = 0 at the limit
        from fedllm.client.runtime import ALGO

        for c, client in clients.items():
            xi = problem.A[c] @ star - problem.b[c]
            client.state = {f"{ALGO}theta": torch.as_tensor(xi, dtype=torch.float32)}
    mse = []
    common.federate(
        server,
        runtime,
        clients,
        rounds,
        lambda r: mse.append(float(np.sum((server.state.dense["theta"].double().numpy() - star) ** 2))),
        progress,
    )
    theta = server.state.dense["theta"].double().numpy()
    xi = None
    if method == "scafflsa":  # xi_c = c_k - c, from the clients' own state and the server's c
        c = server.algorithm.c.get("theta", torch.zeros(problem.dim)).double().numpy()
        xi = [ck - c for ck in control_variates(server, runtime, clients).values()]
    return mse, theta, xi


# ---- the paper's two experiments -----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--problem", help="a problem file (.npz: A, b, theta0, optional noise_A, noise_b)")
    p.add_argument("--agents", type=int, default=10, help="Garnet: the number of agents N (default 10)")
    p.add_argument(
        "--heterogeneous",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Garnet: heterogeneous agents (default) or homogeneous ones",
    )
    p.add_argument(
        "--garnet-seed", type=int, default=0, help="Garnet: the seed that draws the MDPs (default 0)"
    )
    p.add_argument("--local-steps", type=int, default=1000, help="H of the bias experiment (default 1000)")
    p.add_argument("--rounds", type=int, default=25, help="rounds of the bias experiment (default 25)")
    p.add_argument("--lr", type=float, default=0.1, help="the step eta (default 0.1, the paper's)")
    p.add_argument(
        "--speedup-agents",
        default="2,4,8,16",
        help="Garnet: the N of the speed-up experiment (comma separated; empty: skip it)",
    )
    p.add_argument("--speedup-local-steps", type=int, default=100, help="H of the speed-up experiment")
    p.add_argument("--speedup-rounds", type=int, default=40, help="rounds of the speed-up experiment")
    p.add_argument(
        "--speedup-lr",
        type=float,
        default=1.0,
        help="the step of the speed-up experiment (default 1.0, one of the paper's: at 0.1 the slowest "
        "direction of the Garnet systems mixes in about 125 rounds of H=100, past a 2-core budget)",
    )
    common.add_common_arguments(p, "runs/reproduce-scafflsa")


QUICK = {
    "agents": 4,
    "local_steps": 100,
    "rounds": 6,
    "speedup_agents": "2,4,8",
    "speedup_local_steps": 20,
    "speedup_rounds": 8,
}


def bias_experiment(problem: Problem, args, seeds: list[int]) -> dict[str, Any]:
    """Figure 1: the squared error per round of FedLSA (to its bias) and SCAFFLSA (to 0), over seeds."""
    star, bias = problem.theta_star(), problem.predicted_bias(args.lr, args.local_steps)
    out: dict[str, Any] = {"theta_star": star.tolist(), "predicted_bias": bias.tolist()}
    for method in METHODS:
        curves, finals, xis = [], [], []
        for s in seeds:
            mse, theta, xi = run(
                problem, method, args.local_steps, args.rounds, args.lr, s, f"{method} seed {s}"
            )
            curves.append(mse)
            finals.append(theta.tolist())
            if xi is not None:
                xis.append(float(np.linalg.norm(np.sum(xi, axis=0))))
        out[method] = {
            "mse": np.mean(curves, axis=0).tolist(),
            "mse_std": np.std(curves, axis=0).tolist(),
            "theta_final": finals,
            **({"xi_sum_norm": xis} if xis else {}),
        }
    return out


def speedup_experiment(args, seeds: list[int], agents: list[int]) -> dict[str, Any]:
    """Figure 2: the tail squared error (mean over the second half of the rounds) against N, each
    method started at its own limit (FedLSA at theta* + theta~, SCAFFLSA at theta* with its limit control
    variates), so that what is measured is the noise around it, which falls as 1/N when nothing else
    stays."""
    rows: dict[str, Any] = {m: {} for m in METHODS}
    for n in agents:
        problem = garnet(n, args.heterogeneous, args.garnet_seed)
        bias = problem.predicted_bias(args.speedup_lr, args.speedup_local_steps)
        for method in METHODS:
            problem.theta0 = problem.theta_star() + (bias if method == "fedlsa" else 0.0)
            tails = []
            for s in seeds:
                mse, _, _ = run(
                    problem,
                    method,
                    args.speedup_local_steps,
                    args.speedup_rounds,
                    args.speedup_lr,
                    s,
                    f"{method} N={n} seed {s}",
                    at_fixed_point=True,
                )
                tails.append(float(np.mean(mse[len(mse) // 2 :])))
            rows[method][str(n)] = {**common.mean_std(tails), "bias_sq": float(np.sum(bias**2))}
    slopes = {m: common.loglog_slope(agents, [rows[m][str(n)]["mean"] for n in agents]) for m in METHODS}
    return {
        "agents": agents,
        "local_steps": args.speedup_local_steps,
        "rounds": args.speedup_rounds,
        "lr": args.speedup_lr,
        "tail_mse": rows,
        "loglog_slope": slopes,
    }


def plot(results: dict[str, Any], out: Path) -> list[str]:
    plt, fig, axes = common.figure(2 if results.get("speedup") else 1)
    ax = axes[0]
    bias_sq = float(np.sum(np.square(results["bias"]["predicted_bias"])))
    for method, style in zip(METHODS, ("--", "-"), strict=True):
        mse = np.array(results["bias"][method]["mse"])
        ax.semilogy(
            np.arange(1, len(mse) + 1), mse, style, label={"fedlsa": "FedLSA", "scafflsa": "SCAFFLSA"}[method]
        )
    ax.axhline(bias_sq, color="gray", lw=1, ls=":", label=r"FedLSA's predicted bias $\|\tilde\theta\|^2$")
    ax.set_xlabel("communication round")
    ax.set_ylabel(r"$\|\theta_t - \theta^\star\|^2$ (mean over seeds)")
    ax.set_title(f"{results['problem']}, H={results['local_steps']}, eta={results['lr']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if results.get("speedup"):
        sp, ax = results["speedup"], axes[1]
        for method, marker in zip(METHODS, ("s", "o"), strict=True):
            ys = [sp["tail_mse"][method][str(n)]["mean"] for n in sp["agents"]]
            label = {"fedlsa": "FedLSA", "scafflsa": "SCAFFLSA"}[method]
            ax.loglog(
                sp["agents"], ys, marker=marker, label=f"{label} (slope {sp['loglog_slope'][method]:.2f})"
            )
        ax.set_xlabel("number of agents N")
        ax.set_ylabel("tail squared error (mean over seeds)")
        ax.set_title(f"speed-up, H={sp['local_steps']}, eta={sp['lr']}, {sp['rounds']} rounds", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    return common.save_figure(plt, fig, out, "scafflsa")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    seeds = common.seeds_of(args)
    problem = (
        load_problem(args.problem)
        if args.problem
        else garnet(args.agents, args.heterogeneous, args.garnet_seed)
    )
    results: dict[str, Any] = {
        "problem": problem.source,
        "agents": problem.agents,
        "local_steps": args.local_steps,
        "rounds": args.rounds,
        "lr": args.lr,
        "seeds": seeds,
        "bias": bias_experiment(problem, args, seeds),
    }
    agents = [int(x) for x in str(args.speedup_agents).split(",") if x.strip()]
    if agents and not args.problem:
        results["speedup"] = speedup_experiment(args, seeds, agents)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot(results, out)
    common.write_results(out, NAME, results)
    b = results["bias"]
    bias_sq = float(np.sum(np.square(b["predicted_bias"])))
    lines = [
        f"SCAFFLSA reproduction on {problem.source}: N={problem.agents}, H={args.local_steps}, "
        f"eta={args.lr}, "
        f"{args.rounds} rounds, seeds {seeds}",
        f"  FedLSA   final squared error {b['fedlsa']['mse'][-1]:.3e} (predicted bias {bias_sq:.3e})",
        f"  SCAFFLSA final squared error {b['scafflsa']['mse'][-1]:.3e}",
    ]
    if "speedup" in results:
        sp = results["speedup"]
        lines.append(f"  speed-up (H={sp['local_steps']}): tail squared error by N {sp['agents']}")
        for m in METHODS:
            vals = ", ".join(f"{sp['tail_mse'][m][str(n)]['mean']:.2e}" for n in sp["agents"])
            lines.append(f"    {m:<9} {vals}   log-log slope {sp['loglog_slope'][m]:+.2f}")
    lines.append(f"results {out / 'results.json'}; plots {', '.join(results['plots'])}")
    summary = {
        "reproduction": NAME,
        "fedlsa_final_mse": b["fedlsa"]["mse"][-1],
        "scafflsa_final_mse": b["scafflsa"]["mse"][-1],
        "predicted_bias_sq": bias_sq,
        **({"loglog_slope": results["speedup"]["loglog_slope"]} if "speedup" in results else {}),
        "output": str(out),
    }
    return common.finish(summary, "\n".join(lines))
