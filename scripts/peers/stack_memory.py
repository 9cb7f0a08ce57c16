"""A framework's stack alone: the resident (and proportional) memory of a Python process after importing
torch, then transformers and peft, then loading a causal LM in float32, with the torch build it got.

Run with each framework's own interpreter, so that a peak in ``scripts/bench_peers.py``'s table can be read
against what the libraries hold before any training (docs/peers.md):

    .venv/bin/python scripts/peers/stack_memory.py MODEL_DIR           # fedllm's stack
    PEERS/ofl-venv/bin/python scripts/peers/stack_memory.py MODEL_DIR  # OpenFedLLM's (and ft-venv)

Imports nothing of fedllm. Last line: one JSON object (MB, each a [RSS, PSS] pair).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    import psutil

    proc = psutil.Process()

    def mb() -> list[int]:
        info = proc.memory_full_info()
        return [round(info.rss / 2**20), round(info.pss / 2**20)]

    out: dict[str, Any] = {"start": mb()}
    import torch

    out["torch"] = mb()
    import peft  # noqa: F401
    import transformers

    out["transformers_peft"] = mb()
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
    out["model_loaded"] = mb()
    out.update(
        torch_version=torch.__version__,
        cuda_build=torch.version.cuda,
        params=sum(p.numel() for p in model.parameters()),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
