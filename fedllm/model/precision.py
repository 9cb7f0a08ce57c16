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


def native_bf16(device_type: str) -> bool:
    """Whether ``device_type`` ('cpu' or 'cuda') computes bfloat16 natively: a CUDA device that says so, a CPU
    with AVX-512 BF16 or AMX."""
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return cpu_has_native_bf16()


def launch_device() -> str:
    """The device type a run's accelerator will take: CUDA where there is one and the launch does not ask
    for the CPU (``ACCELERATE_USE_CPU``), else the CPU."""
    forced_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return "cuda" if torch.cuda.is_available() and not forced_cpu else "cpu"


def resolve(cfg: Config, device_type: str | None = None) -> str:
    """Settle ``model.mixed_precision: auto`` for this machine, in place, and return what the run uses:
    'bf16' where the device computes bfloat16 natively, 'none' (float32) where it does not. Said once in
    the log; the run's config.yaml then records the value used, so a comparison tells float32 runs from
    bf16 ones whatever machine made them. Other values are returned as they are."""
    if cfg.model.mixed_precision != "auto":
        return str(cfg.model.mixed_precision)
    device = device_type or launch_device()
    chosen = "bf16" if native_bf16(device) else "none"
    cfg.model.mixed_precision = chosen
    native = chosen == "bf16"
    why = "computes bfloat16 natively" if native else "has no native bfloat16 (it would be emulated)"
    log.info(
        "model.mixed_precision = auto: %s on this %s, which %s",
        "bf16 autocast" if chosen == "bf16" else "float32 (no autocast)",
        "GPU" if device == "cuda" else "CPU",
        why,
    )
    return chosen


def accelerator_kwargs(cfg: Config) -> dict[str, str]:
    """What ``Accelerator(...)`` takes for the config's mixed precision: nothing for 'launch' (the launch
    decides), else ``mixed_precision`` ('none' is accelerate's 'no', which YAML would read as false); a
    launch that asks for another one is an error, not a silent pick. 'auto' is settled first
    (:func:`resolve`)."""
    resolve(cfg)
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
