"""The next-token loss on response tokens, with the vocabulary head applied only where a label is.

An instruction example's labels are -100 on its prompt, which is most of its
tokens (Natural Instructions at 384 tokens: a definition, often a passage,
then an answer of a few words). A causal LM called with ``labels`` still
projects every position onto the vocabulary and the loss then discards the
prompt's rows. On SmolLM2-135M that head is 49,152 x 576, a fifth of the
model's multiplies, plus a float32 softmax over 49,152 entries per position,
forward and backward. Asking the model for logits only at the positions whose
next token is a label (``logits_to_keep``, a transformers argument of every
causal LM since 4.50) gives the same loss (the same mean over the same label
tokens, in float32 as transformers computes it) for less.

Rows are padded to one width and their responses end at different places, so
the kept positions are the union over the batch's rows; a row's kept position
without a label of its own is ignored (-100) as it would be in the full loss.
A model whose forward has no ``logits_to_keep`` (old remote code) gets the full
forward and its own loss.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

_KEEPS: dict[type[nn.Module], bool] = {}  # by model class: reading a signature every step costs


def _keeps_logits(cls: type[nn.Module]) -> bool:
    if cls not in _KEEPS:
        try:
            _KEEPS[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            _KEEPS[cls] = False
    return _KEEPS[cls]


def keeps_logits(model: Any) -> bool:
    """Whether ``model`` (a peft wrapper, a DistributedDataParallel around one, or the model itself) takes
    ``logits_to_keep`` and its loss is the token loss alone: a mixture-of-experts model that adds its
    router's auxiliary loss to ``.loss`` (``output_router_logits``) keeps the full forward."""
    inner = getattr(model, "module", model)  # DDP's wrapper passes keyword arguments through
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    if getattr(getattr(base, "config", None), "output_router_logits", False):
        return False
    return _keeps_logits(type(base))


def response_logits(model: Any, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Logits at the positions whose next token is some row's label, and those next tokens (-100 where the
    row has none there): shapes (rows, kept, vocab) and (rows, kept)."""
    targets = batch["labels"][:, 1:]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if not keeps_logits(model):
        return model(**batch).logits[:, :-1], targets  # (its own loss, computed on the way, is not used)
    keep = (targets != -100).any(0).nonzero().squeeze(1)
    return model(**inputs, logits_to_keep=keep).logits, targets[:, keep]


def response_loss(model: Any, batch: dict[str, Tensor]) -> Tensor:
    """The mean next-token cross-entropy over the batch's label tokens (what ``model(**batch).loss`` is for a
    causal LM), computing the vocabulary head only at the label positions."""
    if not keeps_logits(model):
        loss: Tensor = model(**batch).loss
        return loss
    logits, targets = response_logits(model, batch)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
