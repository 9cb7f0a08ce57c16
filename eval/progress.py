"""How far a long phase is: a bar on a terminal, and log lines where there is none (a job's log, ``nohup``,
CI), with the rate and the time left.

tqdm shows nothing when its output is not a terminal, so a run writing to a log printed nothing during its
evaluations (a real run's base evaluation: over 25 minutes of silence on 2 shared cores), nor during a
training step that took minutes (bfloat16 emulated on a CPU without it: about 500 s a step). Every phase
(local training, held-out loss, benchmark questions, generation) now says what it does, how far it is and
about how long is left, at most every :data:`EVERY_S` seconds; and where one unit of work (a step, a batch)
takes longer than :data:`HEARTBEAT_S`, a background thread says that it is still running, so that no phase
of a run is silent for more than a minute.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

EVERY_S = 10.0  # a log line at most this often per phase (no terminal)
HEARTBEAT_S = 50.0  # a line at least this often while a phase runs, even inside one long step (no terminal)


class Progress:
    """``update(n)`` as work is done; ``close()`` logs the phase's total time (returned).

    ``enabled`` False: nothing shown or logged (a worker process of a multi-process run). A terminal gets
    tqdm's bar; anything else a log line every ``every_s`` seconds on ``logger``, and one at least every
    :data:`HEARTBEAT_S` seconds while the phase is open. ``detail`` (optional) adds a word on the state,
    e.g. the running loss of a training phase; ``say_total`` False: no closing line (where the caller logs
    its own summary)."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        enabled: bool = True,
        logger: logging.Logger | None = None,
        every_s: float | None = None,
        detail: Callable[[], str] | None = None,
        say_total: bool = True,
    ) -> None:
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.every_s = EVERY_S if every_s is None else every_s
        self.detail, self.say_total = detail, say_total
        self.log = logger or logging.getLogger("eval")
        self.done = 0
        self.t0 = self._said = self._moved = time.monotonic()
        self.bar: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False)
        elif enabled and total:
            self._beat = threading.Thread(target=self._heartbeat, name=f"progress: {desc}", daemon=True)
            self._beat.start()

    def _extra(self) -> str:
        return f", {self.detail()}" if self.detail is not None and self.done else ""

    def _heartbeat(self) -> None:
        """Say that the phase is still running when nothing was said for :data:`HEARTBEAT_S` seconds."""
        while not self._stop.wait(min(5.0, HEARTBEAT_S / 4)):
            now = time.monotonic()
            with self._lock:
                if now - self._said < HEARTBEAT_S:
                    continue
                self._said = now
                done, since = self.done, now - self._moved
            self.log.info(
                "%s: %d/%d %s%s, still working: the current one has run %.0f s (%.0f s in this phase)",
                self.desc,
                done,
                self.total,
                self.unit,
                self._extra(),
                since,
                now - self.t0,
            )

    def update(self, n: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self.done += n
            self._moved = now
            if self.bar is not None:
                self.bar.update(n)
                if self.detail is not None:
                    self.bar.set_postfix_str(self.detail(), refresh=False)
                return
            if not (self.enabled and now - self._said >= self.every_s and self.done < self.total):
                return
            self._said = now
        rate = self.done / max(now - self.t0, 1e-9)
        self.log.info(
            "%s: %d/%d %s%s, %.2f %s/s, about %.0f s left",
            self.desc,
            self.done,
            self.total,
            self.unit,
            self._extra(),
            rate,
            self.unit,
            (self.total - self.done) / max(rate, 1e-9),
        )

    def close(self) -> float:
        elapsed = time.monotonic() - self.t0
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled and self.total and self.say_total and not self._closed:
            self.log.info("%s: %d %s in %.1f s%s", self.desc, self.done, self.unit, elapsed, self._extra())
        self._closed = True
        return elapsed

    _closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BarLines:
    """A stand-in for ``sys.stderr`` under :func:`bars_as_lines`: a progress bar's carriage-return updates
    become a log line at most every ``every_s`` seconds (and its last state), other text passes through."""

    def __init__(self, real: Any, log: logging.Logger, every_s: float) -> None:
        self.real, self.log, self.every_s = real, log, every_s
        self.pending = ""  # text after the last newline
        self.status = ""  # the latest state of a bar, not said yet
        self.said_at = -float("inf")

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if "\r" in line:  # a bar's last state, left on its line
                self._bar(line.rsplit("\r", 1)[-1], final=True)
            else:
                self._flush_status()
                self.real.write(line + "\n")
        if "\r" in self.pending:
            head, _, self.pending = self.pending.rpartition("\r")
            self._bar(head.rsplit("\r", 1)[-1], final=False)
            self.pending = "\r" + self.pending
        return len(text)

    def _bar(self, state: str, final: bool) -> None:
        state = state.strip()
        if not state:
            return
        now = time.monotonic()
        if final or now - self.said_at >= self.every_s:
            self.log.info("%s", state)
            self.said_at, self.status = now, ""
        else:
            self.status = state

    def _flush_status(self) -> None:
        if self.status:
            self.log.info("%s", self.status)
            self.status = ""

    def close(self) -> None:
        """The bar's last state, if it was not said yet."""
        rest = self.pending.rsplit("\r", 1)[-1].strip()
        if rest:
            self.status = rest
        self.pending = ""
        self._flush_status()

    def flush(self) -> None:
        self.real.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return str(getattr(self.real, "encoding", "utf-8"))

    def fileno(self) -> int:
        return int(self.real.fileno())


class bars_as_lines:
    """``with bars_as_lines(logger):`` around a library call whose progress bar (tqdm's, e.g. transformers'
    GGUF conversion or datasets' map) would fill a log file with hundreds of carriage-return updates on one
    line: where stderr is not a terminal, each update becomes a whole log line, at most one every
    ``every_s`` seconds, and the bar's last state is always said. On a terminal nothing changes."""

    def __init__(self, logger: logging.Logger, every_s: float | None = None) -> None:
        self.log, self.every_s = logger, EVERY_S if every_s is None else every_s
        self.stream: _BarLines | None = None

    def __enter__(self) -> bars_as_lines:
        if not sys.stderr.isatty():
            self.real = sys.stderr
            self.stream = _BarLines(self.real, self.log, self.every_s)
            sys.stderr = self.stream  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            sys.stderr = self.real
            self.stream.close()
            self.stream = None
