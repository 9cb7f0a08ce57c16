"""The console log every fedllm process shares: the CLI, the launcher's ranks and Flower's apps."""

from __future__ import annotations

import logging
import os
import sys

# third-party loggers whose warnings say nothing a fedllm user can act on (shown with --log-level DEBUG)
QUIET_LOGGERS = (
    "bitsandbytes",
    "httpx",
    "urllib3",
    "filelock",
    "accelerate",
    "torch.distributed",
    "DeepSpeed",
    "transformers",
    "kernels",  # transformers' Hub kernels: "skipping publisher trust check ... offline" at every load
    "peft",
    "datasets",
    "huggingface_hub",
)


def setup_logging(level: str = "INFO") -> None:
    """One clean console log per launch.

    Processes other than rank 0 report warnings and errors only. Unless the
    level is DEBUG, third-party deprecation notices and advisories (e.g.
    bitsandbytes' "pip install kernels", transformers' FutureWarnings) are
    dropped, and progress bars are drawn only on a terminal: a log redirected
    to a file gets no carriage returns or cursor codes.
    """
    import warnings

    rank = os.environ.get("RANK", "0")
    if rank != "0" and getattr(logging, level) < logging.WARNING:
        level = "WARNING"
    fmt = (
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
        if rank == "0"
        else f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"
    )
    logging.basicConfig(level=getattr(logging, level), format=fmt, datefmt="%H:%M:%S")
    if level == "DEBUG":
        return
    logging.getLogger("flwr").setLevel(logging.INFO)  # Flower's own logger starts at DEBUG (SecAgg+'s stages)
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*lora_bias=True.*")  # peft, for FLoRAL's bias adaptors
    if not _has_cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would find it too, after a warning
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Whether a log line may name a client of a round. Under a secret sample (privacy.sampling=secret) the
# round loop turns it off for the run: a line that names who trained, failed or was asked again would
# reveal the sample the accountant's amplification assumes hidden.
_names_clients = True


def names_clients() -> bool:
    return _names_clients


def set_names_clients(value: bool) -> bool:
    """Turn the naming of a round's clients on or off; returns what it was (to restore it after a run)."""
    global _names_clients
    before, _names_clients = _names_clients, value
    return before


def redact(text: str) -> str:
    """A failure's reason as a log line or a row may carry it: whole while clients may be named, else with
    every number replaced by '#' ('it claims to be client 3', a state file's name, a client's own example
    count would each name it)."""
    import re

    return text if _names_clients else re.sub(r"\d+", "#", text)


def client_label(client_id: int) -> str:
    """A round's client as a log line names it: ``client 3``, or ``a client`` while the sample is secret."""
    return f"client {client_id}" if _names_clients else "a client"
