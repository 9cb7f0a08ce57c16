"""A comparison's runs: which folders may be reused, and running the rest.

A finished run is reused, and an interrupted one continued, only if its resolved config (every key but
``output.*`` and ``flower.*``: evaluation included) and the fedllm version equal the requested ones;
otherwise the comparison stops before any run starts and names the keys that differ (``rerun`` runs such
folders again). A run of the same config made by other code, data, model file, precision or libraries (its
identity, ``fedllm.run.identity``) is never reused: the comparison says in one line what differs, moves the
old run to ``OUT/.superseded/`` and runs it again. Each run's output goes to ``<run_dir>.log``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from fedllm import __version__
from fedllm.run.compare.metrics import run_metrics
from fedllm.run.compare.variants import Planned, numbers_config
from fedllm.run.identity import differences, identity_inputs, run_identity
from fedllm.run.reader import RunFolder


class StaleRun(ValueError):
    """A run folder holds a run of other settings than the comparison asks for."""


def stale_reason(run_dir: Path, wanted: Any) -> str | None:
    """Why the run in ``run_dir`` is not the one ``wanted`` describes (None: it is, or there is none)."""
    from fedllm.config import ConfigError

    run = RunFolder(run_dir)
    if not run.is_run():
        return None
    try:
        have = numbers_config(run.config())
    except ConfigError as e:
        return f"its config.yaml no longer loads ({e})"
    want = numbers_config(wanted)
    differ = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
    if differ:
        shown = ", ".join(f"{k}: {have.get(k)!r} there, {want.get(k)!r} asked" for k in differ[:4])
        return f"other settings ({shown}{', ...' if len(differ) > 4 else ''})"
    version = run.version()
    if version != __version__:
        return f"another fedllm version ({version or 'unknown'} there, {__version__} here)"
    return None


def supersede(out_root: Path, run_dir: Path) -> Path:
    """Move a run made by other code or data (and its log) out of the comparison, kept under
    ``OUT/.superseded/`` with the time it was moved; the new run takes its place."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rel = run_dir.relative_to(out_root) if run_dir.is_relative_to(out_root) else Path(run_dir.name)
    dest = out_root / ".superseded" / f"{'-'.join(rel.parts)}-{stamp}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(dest))
    log = run_dir.with_name(run_dir.name + ".log")
    if log.exists():
        shutil.move(str(log), str(dest) + ".log")
    return dest


def common_identity(run_dirs: list[Path]) -> dict[str, Any] | None:
    """The identity every run in ``run_dirs`` shares (the first run's; the same means no part differs, as
    :func:`~fedllm.run.identity.differences` reads it: a commit that changed no source file is the same
    code), or None where they differ (or one has none)."""
    found = [RunFolder(d).identity() for d in run_dirs]
    if not found or found[0] is None:
        return None
    return found[0] if all(not differences(i, found[0]) for i in found) else None


def check_folders(runs: list[Planned], out_root: Path, rerun: bool = False) -> None:
    """Every folder checked before the first run starts: a run of other settings stops the comparison
    (:class:`StaleRun`, or removed with ``rerun``); one made by other code or data is superseded."""
    stale: list[str] = []
    identities: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        why = stale_reason(run.run_dir, run.cfg)
        if why is not None:
            if not rerun:
                stale.append(f"{run.run_dir}: {why}")
            else:
                shutil.rmtree(run.run_dir)
                run.run_dir.with_name(run.run_dir.name + ".log").unlink(missing_ok=True)
        elif RunFolder(run.run_dir).is_run():
            key = identity_inputs(run.cfg)  # one identity per base, data, benchmark and precision
            if key not in identities:
                identities[key] = run_identity(run.cfg)
            differ = differences(RunFolder(run.run_dir).identity(), identities[key])
            if differ:
                moved = supersede(out_root, run.run_dir)
                print(f"{run.label}: made by other code or data ({'; '.join(differ)}): running it again (the "
                      f"old run moved to {moved})", file=sys.stderr)  # fmt: skip
    if stale:
        raise StaleRun(
            "these folders hold runs of other settings than asked (pass --rerun to run them again, or "
            "choose another --output-dir):\n  " + "\n  ".join(stale)
        )


def run_one(config: str | None, run: Planned, threads: int) -> float:
    """One run (continued if interrupted, skipped if finished: checked equal beforehand); its output goes
    to ``<run_dir>.log``. Returns the seconds it took here (0: reused)."""
    t0 = time.perf_counter()
    folder = RunFolder(run.run_dir)
    if folder.is_finished():  # finished earlier with these settings: reuse
        return 0.0
    base = [sys.executable, "-m", "fedllm.cli", "--log-level", "INFO", "run"]
    if folder.is_run():  # interrupted earlier with these settings: continue it
        cmd = [*base, "--resume", str(run.run_dir)]
    else:
        cmd = [
            *base,
            "--output-dir",
            str(run.run_dir),
            *(["--config", config] if config else []),
            *run.overrides,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # float results depend on the thread count
    # the runs import the fedllm this comparison checked identities against, whatever the working folder holds
    code = str(Path(importlib.import_module("fedllm").__file__ or "").parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [os.environ.get("PYTHONPATH")])])
    log_path = run.run_dir.with_name(run.run_dir.name + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        out = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"{run.label} failed (exit {out.returncode}): {tail[0]} (log: {log_path})")
    return time.perf_counter() - t0


def build_bases(runs: list[Planned]) -> None:
    """Build the built-in base once here, rather than once in each of the first parallel runs."""
    from fedllm.model.modeling import resolve_model_path

    for cfg in {(r.cfg.model.name, r.cfg.model.builtin_pretrain_steps): r.cfg for r in runs}.values():
        resolve_model_path(cfg.model.name, cfg.model.builtin_pretrain_steps)


def execute(
    config: str | None,
    runs: list[Planned],
    jobs: int,
    desc: str = "runs",
    progress: bool = True,
    said: Callable[[Planned, dict[str, Any]], str] | None = None,
) -> dict[tuple[str, int], dict[str, Any]]:
    """Every run of ``runs`` (``jobs`` at a time, the cores shared between them), each one's metrics by
    (name, seed) once it finishes; ``said``: the line a finished run gets (default: its held-out loss)."""
    from tqdm.auto import tqdm

    threads = threads_per_run(jobs)
    build_bases(runs)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    bar = tqdm(total=len(runs), desc=desc, unit="run", disable=not progress)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_one, config, r, threads): r for r in runs}
        for fut in as_completed(futures):
            run, took = futures[fut], fut.result()
            out[(run.name, run.seed)] = m = run_metrics(run.run_dir)
            own = "" if m.get("wall_s") is None else f"run {m['wall_s']:.0f} s"
            line = said(run, m) if said else default_line(run, m)
            bar.write(
                f"{line}, "
                + (f"{own}, {took:.0f} s with start-up" if took else f"{own}, reused (same settings)"),
                file=sys.stderr,
            )
            bar.update()
    bar.close()
    return out


def threads_per_run(jobs: int) -> int:
    """Torch threads of each run when ``jobs`` run at once on this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def default_line(run: Planned, m: dict[str, Any]) -> str:
    acc = "n/a" if m.get("accuracy") is None else f"{m['accuracy']:.4f}"
    loss = "n/a" if m.get("heldout_loss") is None else f"{m['heldout_loss']:.4f}"
    return f"{run.label}: accuracy {acc}, held-out loss {loss}"
