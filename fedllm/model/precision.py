"""Mixed precision from the config (``model.mixed_precision``) as accelerate applies it, and a plain word
where a CPU has no bfloat16 instructions.

accelerate already runs a step under ``torch.autocast`` when launched with ``--mixed_precision bf16``; the
config key makes the choice part of the run (recorded in its config.yaml, so a comparison's folders of
float32 and bf16 runs are told apart) and lets ``fedllm run`` choose it without a launcher. On a CPU,
bfloat16 matmuls are fast only with AVX-512 BF16 or AMX (oneDNN's kernels); elsewhere they are converted
and run slower than float32, so the run says so instead of leaving the user to find out.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from fedllm.config import Config, ConfigError

log = logging.getLogger(__name__)


def accelerator_kwargs(cfg: Config) -> dict[str, str]:
    """What ``Accelerator(...)`` takes for the config's mixed precision: nothing for 'launch' (the launch
    decides), else ``mixed_precision`` ('none' is accelerate's 'no', which YAML would read as false); a
    launch that asks for another one is an error, not a silent pick."""
    if cfg.model.mixed_precision == "launch":
        return {}
    want = "no" if cfg.model.mixed_precision == "none" else cfg.model.mixed_precision
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched not in ("no", want):
        raise ConfigError(
            f"model.mixed_precision = {want} but the launch asks for {launched} "
            "(accelerate launch --mixed_precision / ACCELERATE_MIXED_PRECISION): choose one"
        )
    return {"mixed_precision": want}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX-512 BF16 or AMX tiles), as torch reads it."""
    cpu = torch.cpu
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(check()) for check in checks if check is not None)


def warn_where_emulated(accelerator: Any) -> None:
    """Log once per run where bf16 autocast is asked for on a CPU that lacks the instructions."""
    cpu = accelerator.device.type == "cpu"
    if str(accelerator.mixed_precision) == "bf16" and cpu and not cpu_has_native_bf16():
        log.warning(
            "mixed precision bf16 on a CPU without AVX-512 BF16 or AMX: torch emulates bfloat16 here, "
            "which is slower than float32 (set model.mixed_precision=none)"
        )
