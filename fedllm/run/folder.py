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
import fcntl
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from fedllm.run.reader import (
    CONFIG,
    GENERAL_REFERENCE,
    GENERATIONS,
    INFO,
    PARTITION,
    ROWS,
    SUMMARY,
    RunFolder,
)

log = logging.getLogger(__name__)
MANY_CLIENTS = 20  # above this, per-client log lines are summarized (and the full list is in the run folder)

LOCK = ".lock"
# what a run writes at the top of its folder (export refuses to write over these)
RUN_ENTRIES = (
    CONFIG,
    INFO,
    PARTITION,
    ROWS,
    SUMMARY,
    GENERATIONS,
    GENERAL_REFERENCE,
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
    "flower.",
)


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message says why and what to do."""


def is_run_dir(path: Path) -> bool:
    return RunFolder(path).is_run()


def _owned(entry: Path) -> bool:
    """Entries fedllm may find in a folder it was about to use: its lock (and a racer's lock being made) and
    its temporaries."""
    return entry.name.startswith(LOCK) or (entry.name.startswith(".") and entry.name.endswith(".tmp"))


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


def config_changes(stored, given) -> dict[str, tuple[Any, Any]]:
    from fedllm.config import flat_config

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
    return RunFolder(run_dir).rounds_done()


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
    stored = RunFolder(run_dir).config()
    changes = config_changes(stored, cfg)
    done = rounds_done(run_dir)
    if changes:
        diff = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in list(changes.items())[:6])
        raise RunDirError(
            f"--output-dir {run_dir} already holds another run ({done} of {stored.federation.rounds} "
            f"rounds; config differs: {diff}). Choose a new folder, or pass --overwrite to replace it"
        )
    return "done" if is_finished(run_dir, cfg.federation.rounds) else "continue"


def is_finished(run_dir: Path, rounds: int) -> bool:
    """The run has finished ``rounds`` rounds: its ``summary.json`` says so (written after the global
    adapter of its last round), not merely that some summary exists (a resume that adds rounds and is
    killed after its last checkpoint has the old one)."""
    try:
        summary = RunFolder(run_dir).summary()
    except (OSError, ValueError):
        return False
    return summary.get("rounds_done", -1) >= rounds and rounds_done(run_dir) >= rounds


def open_run(run_dir: Path, cfg, *, stored=None, overwrite: bool = False) -> tuple[str, RunLock | None]:
    """The one policy for a run folder, for every driver: what to do with ``run_dir`` and its lock.

    ``stored`` is the folder's own config on ``--resume`` (the given ``cfg``
    may change only what :data:`RESUMABLE_CHANGES` allows). Returns 'new',
    'continue', 'overwrite' or 'done', and, unless done, the lock this process
    now holds; the folder is cleared for 'overwrite', temporaries of a killed
    writer are removed, and ``config.yaml`` is rewritten when a resume changed
    an allowed key (e.g. more rounds).
    """
    from fedllm.config import save_config
    from fedllm.run.checkpoint import clean_temporaries

    if stored is not None:
        rewrite = check_resume(run_dir, stored, cfg)
        action = "done" if is_finished(run_dir, cfg.federation.rounds) else "continue"
    else:
        action, rewrite = check_new_run(run_dir, cfg, overwrite), False
    if action == "done":
        return action, None
    lock = RunLock(run_dir).acquire()
    try:
        if action == "overwrite":
            clear_run(run_dir)
        clean_temporaries(run_dir)
        if rewrite:
            save_config(cfg, run_dir / CONFIG)
    except BaseException:
        lock.release()
        raise
    return action, lock


def clear_run(run_dir: Path) -> None:
    """Remove a previous run's files (for --overwrite), keeping this process's lock."""
    for entry in run_dir.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


class RunLock:
    """Exclusive use of a run directory for this process's lifetime (see module docstring).

    The lock file holds its owner's PID and host, for the message a second
    process gets. It is created in one atomic step: the PID is written to a
    private temporary file, which is ``flock``-ed and then linked to
    ``.lock`` (``link`` fails if the name exists), so no process ever sees the
    lock without its owner's PID or unlocked. The ``flock`` lives as long as
    the owner: a lock whose ``flock`` can be taken belongs to a process that
    died (SIGKILL, power loss), and is taken over in place.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.held = False
        self.made_folder = False  # removed again on release if nothing else was written into it
        self._fd: int | None = None

    def _mine(self) -> bytes:
        return json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        ).encode()

    def acquire(self) -> RunLock:
        self.made_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{LOCK}-", suffix=".new", dir=self.path.parent)
        try:
            os.write(fd, self._mine())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(tmp, self.path)
        except FileExistsError:
            os.close(fd)
            self._take_over()
        except BaseException:
            os.close(fd)
            raise
        else:
            self._fd = fd
        finally:
            os.unlink(tmp)
        self.held = True
        return self

    def _take_over(self) -> None:
        """The lock exists: refuse while its owner lives; otherwise (its flock is free) make it ours."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:  # released between our link and open: try again from the start
            self.acquire()
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._refuse()
        if os.fstat(fd).st_ino != self._inode():  # released and recreated meanwhile: try again
            os.close(fd)
            self.acquire()
            return
        holder = self._holder()
        log.warning("taking over %s from process %s, which no longer runs", self.path, holder.get("pid"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._mine(), 0)
        self._fd = fd

    def _inode(self) -> int | None:
        try:
            return os.stat(self.path).st_ino
        except FileNotFoundError:
            return None

    def _holder(self) -> dict:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _refuse(self) -> None:
        holder = self._holder()
        raise RunDirError(
            f"{self.path.parent} is in use by another fedllm process (pid {holder.get('pid')} on "
            f"{holder.get('host')}, since {holder.get('since')}): wait for it to finish or stop it"
        )

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(OSError):
                if self._fd is not None and self._inode() == os.fstat(self._fd).st_ino:
                    self.path.unlink()
            if self._fd is not None:
                os.close(self._fd)  # drops the flock
                self._fd = None
            self.held = False
            if self.made_folder:  # e.g. bad input refused before the run wrote anything
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float as None (JSON has no Infinity or NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def standard_json(obj: Any, indent: int | None = None) -> str:
    """Standard JSON, as every reader of a run folder expects: a non-finite number is written as null."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


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
        self.metrics_path = self.run_dir / ROWS

    def mark_mixed(self, differ: list[str]) -> None:
        """Record in ``run_info.json`` that the run was resumed with other code or data than made its first
        rounds (what differs): its identity then matches no version's."""
        from fedllm.files import atomic_write_text

        if not self.enabled:
            return
        path = self.run_dir / INFO
        info = json.loads(path.read_text()) if path.exists() else {}
        identity = info.setdefault("identity", {})
        identity["mixed"] = [*identity.get("mixed", []), *differ]
        atomic_write_text(path, json.dumps(info, indent=1))

    def start(self, cfg, partition_stats: list[dict]) -> None:
        from fedllm.config import save_config
        from fedllm.files import atomic_write_text

        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / CONFIG)
        from fedllm import __version__
        from fedllm.run.identity import run_identity

        # which code, data and arithmetic made the run (fedllm compare reuses a run only if they are these)
        info = {"fedllm_version": __version__, "identity": run_identity(cfg)}
        atomic_write_text(self.run_dir / INFO, json.dumps(info, indent=1))
        atomic_write_text(self.run_dir / PARTITION, standard_json(partition_stats, indent=1))
        if len(partition_stats) > MANY_CLIENTS:  # one summary line; every client is in partition.json
            import statistics
            from collections import Counter

            sizes = sorted(s["train"] for s in partition_stats)
            q = statistics.quantiles(sizes, n=4) if len(sizes) > 1 else [sizes[0]] * 3
            ranks = dict(sorted(Counter(s["rank"] for s in partition_stats).items()))
            log.info(
                "%d clients: ranks %s; train examples min %d, quartiles %.0f / %.0f / %.0f, max %d (each "
                "client in %s)",
                len(sizes),
                ", ".join(f"{r}: {n}" for r, n in ranks.items()),
                sizes[0],
                *q,
                sizes[-1],
                self.run_dir / PARTITION,
            )
            return
        for s in partition_stats:
            log.info("%s", client_line(s))

    def rows(self) -> list[dict]:
        from fedllm.files import read_jsonl

        return read_jsonl(self.metrics_path)

    def keep_rows_before(self, round_idx: int) -> list[dict]:
        """Drop the rows of rounds a resume will run again; returns the rows kept."""
        from fedllm.files import atomic_write_text

        rows = [r for r in self.rows() if r["round"] < round_idx]
        if self.enabled:
            atomic_write_text(self.metrics_path, "".join(standard_json(r) + "\n" for r in rows))
            answers = self.run_dir / GENERATIONS  # the answers of the rounds kept, none twice
            if answers.exists():
                lines = [x for x in answers.read_text().splitlines() if x.strip()]
                kept = [x for x in lines if json.loads(x)["round"] < round_idx]
                atomic_write_text(answers, "".join(x + "\n" for x in kept))
        return rows

    def log(self, row: dict) -> None:
        from fedllm.files import append_line

        if not self.enabled:
            return
        append_line(self.metrics_path, standard_json(row))
        if self.tracker is not None:
            self.tracker(
                {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)},
                row["round"],
            )

    def log_answers(self, round_idx: int, answers: list[dict]) -> None:
        """The Rouge-L evaluation's answers of a round, one line in ``generations.jsonl``: a score says
        how often the model is right, its answers how it is wrong."""
        from fedllm.files import append_line

        if self.enabled and answers:
            append_line(self.run_dir / GENERATIONS, standard_json({"round": round_idx, "answers": answers}))

    def keep_general_reference(self, answers: list[str]) -> None:
        """The base's answers to the general prompts (``eval.general_prompts``), which later evaluations are
        scored against, also after a resume."""
        from fedllm.files import atomic_write_text

        if self.enabled:
            atomic_write_text(self.run_dir / GENERAL_REFERENCE, json.dumps(answers, indent=1))

    def general_reference(self) -> list[str] | None:
        """The base's answers kept by :meth:`keep_general_reference` (None: none kept)."""
        path = self.run_dir / GENERAL_REFERENCE
        return json.loads(path.read_text()) if path.is_file() else None

    def checkpoint(self, round_idx: int, tensors: dict, meta: dict) -> None:
        from fedllm.run.checkpoint import prune_checkpoints, save_checkpoint

        if self.enabled and self.save_every_round:
            save_checkpoint(self.run_dir, round_idx, tensors, {"round": round_idx, **meta})
            prune_checkpoints(self.run_dir, keep=self.keep)

    def finish(self, summary: dict, write_adapter) -> dict:
        """Complete ``summary`` from the metrics, write the global adapter (``write_adapter(path)``)
        and it.
        """
        from fedllm.files import atomic_write_text

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
            if any("rouge_l" in r for r in evals):  # held-out tasks answered (eval.generate_size)
                summary.update(
                    {"rouge_l_before": evals[0].get("rouge_l"), "rouge_l_after": evals[-1].get("rouge_l")}
                )
            if any("general_agreement" in r for r in evals):  # the base's chat kept (eval.general_prompts)
                summary["general_agreement_after"] = evals[-1].get("general_agreement")
        personal = [r for r in rows if r.get("personal")]
        if personal:  # the clients' own held-out accuracy: the figure that matters for personalization
            last = personal[-1]
            summary["clients"] = {
                "round": last["round"],
                "evaluated": sorted(int(k) for k in last["personal"]),
                "global_acc_mean": last.get("global_client_acc"),
                "personal_acc_mean": last.get("personal_acc"),
                "global_loss_mean": last.get("global_client_loss"),
                "personal_loss_mean": last.get("personal_loss"),
                "per_client": {
                    k: {m: v.get(m) for m in ("global_acc", "personal_acc", "global_loss", "personal_loss")}
                    for k, v in last["personal"].items()
                },
            }
        summary["rounds_done"] = max((r["round"] for r in rows), default=0)
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
            atomic_write_text(self.run_dir / SUMMARY, standard_json(summary, indent=1))
        return summary


def client_line(stat: dict) -> str:
    """One client of the partition as the run's log shows it.

    The categories are counted over the examples the partition gave the client; tokenizing can drop some
    (a prompt longer than ``data.max_seq_len``), so where it did the line says how many, or the train and
    test sizes would not add up to the categories' counts. A Flower site shares its test size and
    categories only if asked to, and its sizes only after tokenizing: there the server cannot tell a drop,
    and the site's own log line says how many it dropped.
    """
    name = f" ({stat['name']})" if stat.get("name") else ""  # what it holds (data.partition=by_source, ...)
    test = stat.get("test")
    sizes = f"{stat['train']} train / {'(not shared)' if test is None else test} test examples"
    lost = stat.get("size", 0) - stat["train"] - (test or 0)
    if "size" in stat and lost > 0:
        sizes += f" ({stat['size']} partitioned, {lost} dropped when tokenized)"
    categories = stat.get("categories", "(not shared)")
    return f"client {stat['client']}{name}: rank {stat['rank']}, {sizes}, categories {categories}"
