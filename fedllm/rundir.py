"""The run directory's life: one run per folder, a lock while it lives, checked resumes.

A run directory belongs to one run. A new run refuses a folder that holds
anything but a run of the *same* config (which it continues, as ``--resume``
would); ``--overwrite`` clears a previous run, never a folder of other files.
While a run or resume lives it holds ``.lock`` (its PID and host): a second
process is refused, and a lock whose process is gone (SIGKILL, power loss) is
taken over. A resume may change only what does not alter the trajectory
(more rounds, evaluation, output, the process layout); any other change is
refused with the keys that differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK = ".lock"
# what a run writes at the top of its folder (export refuses to write over these)
RUN_ENTRIES = (
    "config.yaml",
    "partition.json",
    "metrics.jsonl",
    "summary.json",
    "checkpoints",
    "global_adapter",
    LOCK,
)
# keys a resume may change: they do not alter what the clients train (rounds: only more of them)
RESUMABLE_CHANGES = (
    "federation.rounds",
    "federation.client_timeout_s",
    "federation.parallel",
    "eval.",
    "output.",
)


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message says why and what to do."""


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "config.yaml").is_file()


def _owned(entry: Path) -> bool:
    """Entries fedllm may find in a folder it was about to use: its lock and its temporaries."""
    return entry.name == LOCK or (entry.name.startswith(".") and entry.name.endswith(".tmp"))


def check_writable_folder(path: Path, what: str) -> None:
    """``path`` is a folder (or can be made one) that this process can write; else one line why not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{what} {path} is a file; expected a folder (new or empty)")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RunDirError(f"{what} {path}: {ancestor} is a file, so the folder cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RunDirError(f"{what} {path}: {ancestor} is not writable (permission denied)")


def flat_config(cfg) -> dict[str, Any]:
    """``{"section.key": value}`` of a Config."""
    return {f"{s}.{k}": v for s, values in dataclasses.asdict(cfg).items() for k, v in values.items()}


def config_changes(stored, given) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two configs (``output.dir`` aside): ``{key: (stored, given)}``."""
    a, b = flat_config(stored), flat_config(given)
    return {k: (a[k], b[k]) for k in a if a[k] != b[k] and k != "output.dir"}


def refused_changes(changes: dict[str, tuple[Any, Any]], rounds_done: int) -> list[str]:
    """The changes a resume cannot take, each as 'key: old -> new'."""
    out = []
    for key, (old, new) in changes.items():
        allowed = key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES
        if key == "federation.rounds" and new < rounds_done:
            allowed = False
        if not allowed:
            out.append(f"{key}: {old!r} -> {new!r}")
    return out


def rounds_done(run_dir: Path) -> int:
    """The newest round with a checkpoint (0 when none)."""
    from fedllm.checkpoint import checkpoint_round, latest_checkpoint

    latest = latest_checkpoint(run_dir)
    return checkpoint_round(latest) if latest is not None else 0


def check_resume(run_dir: Path, stored, given) -> bool:
    """Refuse a resume whose config changes the trajectory; returns whether config.yaml must be rewritten."""
    done = rounds_done(run_dir)
    changes = config_changes(stored, given)
    refused = refused_changes(changes, done)
    if refused:
        raise RunDirError(
            f"cannot continue {run_dir} with a changed config ({'; '.join(refused)}): these change "
            "what the clients train (data, partition, clients, ranks, modules, strategy, algorithm, "
            "seed, ...). Start a new run instead; a resume may only add rounds or change eval.*, "
            "output.*, federation.parallel and federation.client_timeout_s"
        )
    return bool(changes)


def check_new_run(run_dir: Path, cfg, overwrite: bool) -> str:
    """What ``fedllm run --output-dir`` should do with ``run_dir``: 'new', 'continue', 'done' or
    'overwrite'.
    """
    from fedllm.config import load_config

    check_writable_folder(run_dir, "--output-dir")
    if not run_dir.exists() or all(_owned(p) for p in run_dir.iterdir()):
        return "new"
    if not is_run_dir(run_dir):
        raise RunDirError(
            f"--output-dir {run_dir} is not empty and holds no fedllm run: choose a new or empty folder "
            "(--overwrite only ever replaces a previous fedllm run)"
        )
    if overwrite:
        return "overwrite"
    stored = load_config(run_dir / "config.yaml")
    changes = config_changes(stored, cfg)
    done = rounds_done(run_dir)
    if changes:
        diff = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in list(changes.items())[:6])
        raise RunDirError(
            f"--output-dir {run_dir} already holds another run ({done} of {stored.federation.rounds} "
            f"rounds; config differs: {diff}). Choose a new folder, or pass --overwrite to replace it"
        )
    if done >= cfg.federation.rounds and (run_dir / "summary.json").exists():
        return "done"
    return "continue"


def clear_run(run_dir: Path) -> None:
    """Remove a previous run's files (for --overwrite), keeping this process's lock."""
    for entry in run_dir.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RunLock:
    """Exclusive use of a run directory for this process's lifetime (see module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.held = False
        self.made_folder = False  # removed again on release if nothing else was written into it

    def _mine(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> RunLock:
        self.made_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                self._check_holder()
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(self._mine(), fh)
            self.held = True
            return self
        raise RunDirError(
            f"{self.path.parent} is being taken by another fedllm process at the same time; try again"
        )

    def _check_holder(self) -> None:
        """Refuse if a live process holds the lock; remove a stale lock."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            holder = {}
        pid, host = holder.get("pid"), holder.get("host")
        if isinstance(pid, int) and (host != socket.gethostname() or _alive(pid)):
            raise RunDirError(
                f"{self.path.parent} is in use by another fedllm process (pid {pid} on {host}, since "
                f"{holder.get('since')}): wait for it to finish or stop it (a lock left by a process "
                f"that no longer runs on another host is {self.path}: delete it by hand)"
            )
        log.warning("taking over %s from process %s, which no longer runs", self.path, pid)
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(OSError, ValueError):  # gone or unreadable: nothing of ours to remove
                if json.loads(self.path.read_text()).get("pid") == os.getpid():
                    self.path.unlink()
            self.held = False
            if self.made_folder:  # e.g. bad input refused before the run wrote anything
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class RunWriter:
    """Everything a run writes into its folder, for every driver (simulation, accelerate, Flower).

    ``config.yaml`` and ``partition.json`` at the start, one ``metrics.jsonl``
    line per round (and to the accelerate trackers), a checkpoint after each
    round, then ``summary.json`` and ``global_adapter/``. Only the process
    with ``enabled`` writes; every file is written atomically.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool = True,
        keep_checkpoints: int = 2,
        save_every_round: bool = True,
        tracker=None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled, self.keep, self.save_every_round, self.tracker = (
            enabled,
            keep_checkpoints,
            save_every_round,
            tracker,
        )
        self.metrics_path = self.run_dir / "metrics.jsonl"

    def start(self, cfg, partition_stats: list[dict]) -> None:
        from fedllm.checkpoint import atomic_write_text
        from fedllm.config import save_config

        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        atomic_write_text(self.run_dir / "partition.json", json.dumps(partition_stats, indent=1))
        for s in partition_stats:
            log.info(
                "client %d: rank %d, %d train / %d test examples, categories %s",
                s["client"],
                s["rank"],
                s["train"],
                s["test"],
                s["categories"],
            )

    def rows(self) -> list[dict]:
        from fedllm.checkpoint import read_jsonl

        return read_jsonl(self.metrics_path)

    def keep_rows_before(self, round_idx: int) -> list[dict]:
        """Drop the rows of rounds a resume will run again; returns the rows kept."""
        from fedllm.checkpoint import atomic_write_text

        rows = [r for r in self.rows() if r["round"] < round_idx]
        if self.enabled:
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def log(self, row: dict) -> None:
        from fedllm.checkpoint import append_line

        if not self.enabled:
            return
        append_line(self.metrics_path, json.dumps(row))
        if self.tracker is not None:
            self.tracker(
                {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)},
                row["round"],
            )

    def checkpoint(self, round_idx: int, tensors: dict, meta: dict) -> None:
        from fedllm.checkpoint import prune_checkpoints, save_checkpoint

        if self.enabled and self.save_every_round:
            save_checkpoint(self.run_dir, round_idx, tensors, {"round": round_idx, **meta})
            prune_checkpoints(self.run_dir, keep=self.keep)

    def finish(self, summary: dict, write_adapter) -> dict:
        """Complete ``summary`` from the metrics, write the global adapter (``write_adapter(path)``)
        and it.
        """
        from fedllm.checkpoint import atomic_write_text

        rows = self.rows() if self.enabled else []
        evals = [r for r in rows if "accuracy" in r or "eval_loss" in r]
        if evals:
            summary.update(
                {
                    "loss_before": evals[0].get("eval_loss"),
                    "loss_after": evals[-1].get("eval_loss"),
                    "accuracy_before": evals[0].get("accuracy"),
                    "accuracy_after": evals[-1].get("accuracy"),
                    "accuracy_best": max(
                        (r["accuracy"] for r in evals if r.get("accuracy") is not None), default=None
                    ),
                }
            )
        summary["failed_client_calls"] = sum(len(r.get("failed", {})) for r in rows)
        summary["skipped_rounds"] = [r["round"] for r in rows if r.get("skipped")]
        if summary.get("global_adapter") is None:
            log.error(
                "no round produced a global update (all %d were skipped): no adapter is written",
                summary.get("rounds", 0),
            )
        if self.enabled:
            if summary.get("global_adapter"):
                write_adapter(self.run_dir / "global_adapter")
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary
