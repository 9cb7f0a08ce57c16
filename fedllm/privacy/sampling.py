"""Who takes part in a round, under DP: a secret sample, or the participation a public one reveals.

Amplification by sampling holds only against an adversary who does not know whether a client was sampled.
:class:`SecretSampling` draws each round's clients from the operating system's randomness (or, for
experiments, from ``privacy.noise_seed``, which voids the guarantee like the noise seed does) and tells the
server not to write them anywhere (``public = False``). :func:`max_participation` replays the public,
seeded sample instead, for the unamplified account.
"""

from __future__ import annotations

import random
import secrets
from collections import Counter
from dataclasses import dataclass

from fedllm.protocol import derive_seed
from fedllm.server.server import Sampling


@dataclass
class SecretSampling(Sampling):
    """Each round's sample from secret randomness; ``public`` False: the server names no client of it."""

    noise_seed: int = -1
    public: bool = False

    def rng(self, round_idx: int, stream: int) -> random.Random:
        if self.noise_seed >= 0:  # experiments only: reproducible, and known to whoever knows the seed
            return random.Random(derive_seed(self.noise_seed, round_idx, stream, 29))
        return secrets.SystemRandom()


def max_participation(seed: int, num_clients: int, per_round: int, rounds: int) -> int:
    """How many of the first ``rounds`` rounds the most-sampled client takes part in under the run's public
    seeded sampling (the server's own draw, replayed)."""
    sampling = Sampling(seed=seed, clients_per_round=per_round)
    counts: Counter[int] = Counter()
    for r in range(1, rounds + 1):
        counts.update(sampling.draw(r, list(range(num_clients)))[0])
    return max(counts.values(), default=0)
