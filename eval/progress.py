"""How far a long evaluation phase is: a bar on a terminal, and a log line every few seconds where there is
none (a job's log, ``nohup``, CI), with the rate and the time left.

tqdm shows nothing when its output is not a terminal, so a run writing to a log printed nothing during its
evaluations (a real run's base evaluation: over 25 minutes of silence on 2 shared cores). Training already
logs a line per client every few seconds; every evaluation phase (held-out loss, benchmark questions,
generation) now says the same: what it does, how far it is, and about how long is left.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

EVERY_S = 10.0  # a log line at most this often per phase (no terminal)


class Progress:
    """``update(n)`` as work is done; ``close()`` logs the phase's total time (returned).

    ``enabled`` False: nothing shown or logged (a worker process of a multi-process run). A terminal gets
    tqdm's bar; anything else a log line every :data:`EVERY_S` seconds on ``logger``."""

    def __init__(
        self, total: int, desc: str, unit: str, enabled: bool = True, logger: logging.Logger | None = None
    ) -> None:
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.log = logger or logging.getLogger("eval")
        self.done = 0
        self.t0 = self._said = time.monotonic()
        self.bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and now - self._said >= EVERY_S and self.done < self.total:
            self._said = now
            rate = self.done / max(now - self.t0, 1e-9)
            self.log.info(
                "%s: %d/%d %s, %.2f %s/s, about %.0f s left",
                self.desc,
                self.done,
                self.total,
                self.unit,
                rate,
                self.unit,
                (self.total - self.done) / max(rate, 1e-9),
            )

    def close(self) -> float:
        elapsed = time.monotonic() - self.t0
        if self.bar is not None:
            self.bar.close()
        if self.enabled and self.total:
            self.log.info("%s: %d %s in %.1f s", self.desc, self.done, self.unit, elapsed)
        return elapsed

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
