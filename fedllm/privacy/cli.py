"""``fedllm privacy``: the noise multiplier a target epsilon needs, or the epsilon a noise multiplier
spends."""

from __future__ import annotations

import argparse
import json

from fedllm.privacy.accountant import (
    MEANINGFUL_DELTA,
    default_delta,
    epsilon,
    noise_for_epsilon,
    round_up,
)


def add_privacy_command(sub) -> None:
    pv = sub.add_parser(
        "privacy", help="noise multiplier for a target epsilon (or epsilon for a noise multiplier)"
    )
    pv.add_argument("--clients", type=int, required=True, help="federation.num_clients (N)")
    pv.add_argument("--per-round", type=int, required=True, help="clients sampled per round (m)")
    pv.add_argument("--rounds", type=int, required=True, help="federation.rounds")
    pv.add_argument(
        "--mode",
        choices=["central", "local"],
        default="central",
        help="central (with a secret sample: amplified by sampling) or local (no amplification; also the "
        "bound of a central run with privacy.sampling=public: pass the most-sampled client's rounds)",
    )
    pv.add_argument("--delta", type=float, default=0.0, help="0: 1 / N^1.1")
    pvx = pv.add_mutually_exclusive_group(required=True)
    pvx.add_argument("--target-epsilon", type=float)
    pvx.add_argument("--noise-multiplier", type=float)
    pv.set_defaults(func=cmd_privacy)


def cmd_privacy(args: argparse.Namespace) -> int:
    """Prints the answer, then one JSON line. A noise multiplier for a target is printed rounded *up* (at 4
    decimals) and the epsilon it spends with 6 significant digits, so the printed value meets the target."""
    if args.per_round > args.clients or min(args.clients, args.per_round, args.rounds) < 1:
        raise ValueError("--clients, --per-round and --rounds must be >= 1, with --per-round <= --clients")
    delta = args.delta or default_delta(args.clients)
    if args.target_epsilon is not None:
        exact = noise_for_epsilon(
            args.target_epsilon, args.mode, args.clients, args.per_round, args.rounds, delta
        )
        sigma = round_up(exact, 4)
        eps = epsilon(args.mode, args.clients, args.per_round, sigma, args.rounds, delta)
        print(f"privacy.noise_multiplier={sigma:.4f} gives epsilon {eps:.6g} at delta {delta:.3g}")
    else:
        sigma = args.noise_multiplier
        eps = epsilon(args.mode, args.clients, args.per_round, sigma, args.rounds, delta)
        print(f"noise multiplier {sigma:g} spends epsilon {eps:.6g} at delta {delta:.3g}")
    if delta > MEANINGFUL_DELTA:
        print(
            f"delta {delta:.2g} is above {MEANINGFUL_DELTA:g}: no guarantee at that delta; pass --delta "
            "(e.g. 1e-5)"
        )
    print(json.dumps({"mode": args.mode, "noise_multiplier": sigma, "epsilon": eps, "delta": delta}))
    return 0
