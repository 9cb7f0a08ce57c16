"""Prepare ``scripts/gpu_check.sh`` for a GPU machine that reaches no package index.

The lent GPU machine (the device tool) has its own ``python3`` (3.12) with torch, transformers, peft,
accelerate, pyarrow, pandas, safetensors, tokenizers, matplotlib and pytest, but not datasets,
dp-accounting, bitsandbytes or DeepSpeed, and it cannot install them. This script, run here where pip
reaches the index, downloads the wheels the check needs for that machine's Python and platform into the
ignored folder ``.whl/`` (DeepSpeed ships only a source archive: its wheel is built here with
``DS_BUILD_OPS=0``, pure Python, its CUDA ops compiled just in time on the GPU), keeps one version of
each, and checks that the working tree plus the wheels stay within what one device call carries
(64 MiB), naming what cannot travel if they do not. ``--rehearse`` then installs them offline from the
folder into a scratch target for Python 3.12 on x86-64 Linux, as the check does there.

    python scripts/gpu_prepare.py [--rehearse]

The versions are this environment's (``.venv``), so the GPU machine runs what the tests ran here. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / ".whl"
LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried paths together
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
TARGET = ["--python-version", "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS)]
# what the check imports that the GPU machine lacks, with what those need that it lacks too
NEEDED = [
    "datasets", "dill", "multiprocess",  # the data and benchmark loaders
    "dp-accounting", "dm-tree",  # the privacy accountant
    "bitsandbytes",  # 4/8-bit bases
    "deepspeed", "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",  # ZeRO
]  # fmt: skip
BUILT_HERE = {"deepspeed"}  # a source archive on the index: built into a wheel here


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"{name} is not installed here: run bash scripts/install.sh first") from None


def pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{' '.join(cmd[3:6])}...: {' / '.join(tail)}")


def canonical(filename: str) -> str:
    return filename.split("-")[0].lower().replace("_", "-")


def download() -> dict[str, str]:
    """Each needed package's wheel in ``.whl/`` (one version each); their file names by package."""
    FOLDER.mkdir(exist_ok=True)
    wanted = {name: version(name) for name in NEEDED}
    for name, ver in wanted.items():
        have = [p for p in FOLDER.glob("*.whl") if canonical(p.name) == name]
        if any(f"-{ver}-" in p.name for p in have):
            continue
        for p in have:  # another version: two of one package stop the install there
            p.unlink()
        if name in BUILT_HERE:
            env = {**os.environ, "DS_BUILD_OPS": "0"}
            pip(
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(FOLDER),
                f"{name}=={ver}",
                env=env,
            )
        else:
            pip(
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                *TARGET,
                "-d",
                str(FOLDER),
                f"{name}=={ver}",
            )
    names = {canonical(p.name): p.name for p in FOLDER.glob("*.whl")}
    for extra in sorted(set(names) - set(wanted)):  # a package no longer needed
        (FOLDER / names.pop(extra)).unlink()
    return names


def tree_bytes() -> int:
    """The working tree as a device call sends it: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in out if f and (ROOT / f.decode()).is_file())


def rehearse() -> int:
    """Install every wheel offline from ``.whl/`` into a scratch target for the GPU machine's Python."""
    target = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    try:
        pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--only-binary=:all:", *TARGET,
            "--target", str(target), *map(str, sorted(FOLDER.glob("*.whl"))))  # fmt: skip
        return len(list(target.glob("*.dist-info")))
    finally:
        shutil.rmtree(target, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rehearse", action="store_true", help="install the wheels offline into a scratch target"
    )
    args = ap.parse_args()
    wheels = download()
    sizes = {name: (FOLDER / f).stat().st_size for name, f in sorted(wheels.items())}
    tree = tree_bytes()
    total = tree + sum(sizes.values())
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"{name:20s} {n / 2**20:8.2f} MiB  {wheels[name]}")
    print(f"{'working tree':20s} {tree / 2**20:8.2f} MiB\n{'together':20s} {total / 2**20:8.2f} MiB of 64")
    result = {
        "wheels": len(wheels),
        "wheels_mib": round(sum(sizes.values()) / 2**20, 2),
        "tree_mib": round(tree / 2**20, 2),
        "total_mib": round(total / 2**20, 2),
        "fits": total <= LIMIT,
    }
    if total > LIMIT:  # name what cannot travel: the largest wheels until the rest fits
        over, left_out = total - LIMIT, []
        for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
            if over <= 0:
                break
            left_out.append(name)
            over -= n
        result["cannot_travel"] = left_out
        print(f"over the 64 MiB a call carries by {(total - LIMIT) / 2**20:.2f} MiB: leave out {left_out}")
    if args.rehearse:
        result["rehearsal_installed"] = rehearse()
        n = result["rehearsal_installed"]
        print(f"rehearsal: {n} packages installed offline from .whl/ for Python 3.12")
    print(json.dumps(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
