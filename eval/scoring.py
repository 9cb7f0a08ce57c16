"""Log-likelihood scoring of multiple-choice prompts: one forward per question, a shared prefix computed once.

Three paths, all giving the log-likelihood of each continuation " A".." D":

* **prefix reuse** (when every letter is one token): in k-shot MMLU every
  question of a subject starts with the same header and the same k shots,
  80-90% of the tokens. Their keys and values are computed once per subject
  (a transformers ``DynamicCache``), and each batch of questions runs only its
  own tokens on top, right-padded, at positions after the prefix. The shared
  prefix is the longest run of token ids that *every* question's full prompt
  starts with, found on the ids of the full prompts as the tokenizer makes
  them (BPE merges across the boundary, a BOS, SentencePiece's leading space),
  so prefix + suffix is the whole prompt's ids exactly; a question whose ids
  do not start with it is scored the full way.
* **single forward**: the whole prompt, one forward, the four letters read
  from the last position (sorted by length to waste little padding);
* **full continuation** (letters of several tokens): each continuation scored.

Prefix reuse is checked once against the single-forward path on the first
question it scores; a model whose cache cannot be reused exactly (a sliding
window, an unusual cache) falls back to the single forward, said once.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 16  # a shorter shared prefix is not worth a cache (0-shot headers are ~15 tokens)


@dataclass
class Item:
    """One prompt to score: its full ids, and the continuation ids of each choice."""

    ids: list[int]
    continuations: list[list[int]]
    group: object = None  # prompts that may share a prefix (e.g. one subject with k shots)

    @property
    def single_token(self) -> bool:
        return all(len(c) == 1 for c in self.continuations)


def _pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _letters(
    logits: torch.Tensor, rows: list[int], last: torch.Tensor, items: list[Item]
) -> list[list[float]]:
    logp = torch.log_softmax(logits[torch.arange(len(rows), device=logits.device), last].float(), dim=-1)
    return [[logp[r, c[0]].item() for c in items[i].continuations] for r, i in enumerate(rows)]


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs do; a custom one may
    not)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def _answer_logits(model, last: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at each row's ``last`` position only, and where each row's sits in them: the output head
    runs on the few positions read, not on every position of every row (with a 49k-token vocabulary the
    head is about a fifth of a short prompt's forward)."""
    if not _keeps_logits(model):
        return model(**inputs).logits, last
    keep, where = torch.unique(last, return_inverse=True)
    return model(**inputs, logits_to_keep=keep).logits, where


@torch.no_grad()
def score_single_forward(
    model, items: list[Item], pad_id: int, batch_size: int, tick: Callable[[int], None] = lambda n: None
) -> list[list[float]]:
    """Log-likelihoods of single-token continuations, one forward per prompt."""
    device = _device(model)
    order = sorted(range(len(items)), key=lambda i: -len(items[i].ids))
    out: list[list[float]] = [[] for _ in items]
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask = _pad([items[i].ids for i in rows], pad_id, device)
        logits, last = _answer_logits(model, mask.sum(1) - 1, input_ids=ids, attention_mask=mask)
        for i, scores in zip(rows, _letters(logits, list(range(len(rows))), last, items), strict=True):
            out[i] = scores
        tick(len(rows))
    return out


@torch.no_grad()
def score_full(
    model, items: list[Item], pad_id: int, batch_size: int, tick: Callable[[int], None] = lambda n: None
) -> list[list[float]]:
    """Sum of log-probabilities of each continuation after its prompt (any length)."""
    device = _device(model)
    seqs = [(i, c, it.ids + cont) for i, it in enumerate(items) for c, cont in enumerate(it.continuations)]
    order = sorted(range(len(seqs)), key=lambda j: -len(seqs[j][2]))
    out = [[0.0] * len(it.continuations) for it in items]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, mask = _pad([seqs[j][2] for j in chunk], pad_id, device)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        for row, j in enumerate(chunk):
            i, c, _ = seqs[j]
            n_ctx, cont = len(items[i].ids), items[i].continuations[c]
            pos = torch.arange(n_ctx - 1, n_ctx - 1 + len(cont), device=device)
            out[i][c] = logp[row, pos, torch.tensor(cont, device=device)].sum().item()
        tick(sum(1 for j in chunk if seqs[j][1] == 0))
    return out


def shared_prefix(seqs: list[list[int]]) -> tuple[int, list[int]]:
    """The prefix length most prompts share, and the prompts that have it.

    Each prompt's longest common prefix with the first one is computed; the
    most common such length L (ties: the longest) wins, since tokenization at
    the boundary behaves the same for nearly every question. A prompt whose
    common prefix is shorter than L does not share it.
    """
    first = seqs[0]

    def lcp(s: list[int]) -> int:
        n = min(len(s), len(first)) - 1  # at least one own token must remain to read the letters from
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        return k

    lengths = [lcp(s) for s in seqs]
    counts = Counter(lengths[1:] or lengths)
    best = max(counts, key=lambda n: (counts[n], n))
    return best, [i for i, n in enumerate(lengths) if n >= best]


def _cache_argument(model) -> str:
    """The forward's name for a key/value cache: ``cache`` (transformers 5.2x) or ``past_key_values``
    (before).
    """
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


class PrefixScorer:
    """Scores groups of prompts that share a prefix, computing the prefix once per group."""

    def __init__(self, model, pad_id: int, batch_size: int):
        self.model, self.pad_id, self.batch_size = model, pad_id, batch_size
        self.enabled: bool | None = None  # None: not yet checked on this model

    @torch.no_grad()
    def _prefix_states(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Keys and values of the prefix, per layer; None when the cache is not a plain per-token one."""
        keep = {"logits_to_keep": 1} if _keeps_logits(self.model) else {}  # only its keys and values are read
        out = self.model(input_ids=torch.tensor([prefix], device=_device(self.model)), use_cache=True, **keep)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if cache is None or any(getattr(cache, "is_sliding", None) or []):
            return None
        layers = getattr(cache, "layers", None)
        if layers is not None:
            if not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
                return None
            return [(layer.keys, layer.values) for layer in layers]
        return (
            [tuple(kv[:2]) for kv in cache.to_legacy_cache()] if hasattr(cache, "to_legacy_cache") else None
        )

    @torch.no_grad()
    def _score_suffixes(
        self, states, n_prefix: int, suffixes: list[list[int]], items: list[Item]
    ) -> list[list[float]]:
        from transformers import DynamicCache

        device = _device(self.model)
        ids, mask = _pad(suffixes, self.pad_id, device)
        b, width = ids.shape
        # the prefix expanded over the batch (views, no copy); the forward appends the suffixes' own states
        cache = DynamicCache([(k.expand(b, *k.shape[1:]), v.expand(b, *v.shape[1:])) for k, v in states])
        attention = torch.cat([torch.ones(b, n_prefix, dtype=mask.dtype, device=device), mask], dim=1)
        positions = torch.arange(n_prefix, n_prefix + width, device=device).expand(b, width)
        logits, last = _answer_logits(
            self.model,
            mask.sum(1) - 1,
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{_cache_argument(self.model): cache},
        )
        return _letters(logits, list(range(b)), last, items)

    def score_group(self, items: list[Item], tick: Callable[[int], None]) -> list[list[float]] | None:
        """Scores of a group's prompts (all single-token continuations), or None where reuse does not
        apply.
        """
        if self.enabled is False or len(items) < 2:
            return None
        n_prefix, sharing = shared_prefix([it.ids for it in items])
        if n_prefix < MIN_SHARED_TOKENS:
            return None
        states = self._prefix_states(items[sharing[0]].ids[:n_prefix])
        if states is None:
            self._disable("its key/value cache is not a plain per-token cache (e.g. a sliding window)")
            return None
        out: list[list[float] | None] = [None] * len(items)
        order = sorted(sharing, key=lambda i: -len(items[i].ids))
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            scores = self._score_suffixes(
                states, n_prefix, [items[i].ids[n_prefix:] for i in rows], [items[i] for i in rows]
            )
            if self.enabled is None and not self._verify(items[rows[0]], scores[0]):
                return None
            for i, s in zip(rows, scores, strict=True):
                out[i] = s
            tick(len(rows))
        rest = [i for i in range(len(items)) if out[i] is None]  # tokenized differently at the boundary
        if rest:
            for i, s in zip(
                rest,
                score_single_forward(
                    self.model, [items[i] for i in rest], self.pad_id, self.batch_size, tick
                ),
                strict=True,
            ):
                out[i] = s
        return out

    def _verify(self, item: Item, scores: list[float]) -> bool:
        """The first reused scores must match a plain forward (tolerance of the model's dtype)."""
        ref = score_single_forward(self.model, [item], self.pad_id, 1)[0]
        dtype = next(self.model.parameters()).dtype
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        if max(abs(a - b) for a, b in zip(scores, ref, strict=True)) > tol:
            self._disable(f"its reused scores differ from a plain forward (by more than {tol})")
            return False
        self.enabled = True
        return True

    def _disable(self, why: str) -> None:
        if self.enabled is not False:
            log.warning("MMLU prefix reuse is off for this model: %s; scoring each question in full", why)
        self.enabled = False


def score_items(
    model,
    items: list[Item],
    pad_id: int,
    batch_size: int,
    reuse: bool = True,
    tick: Callable[[int], None] = lambda n: None,
) -> list[list[float]]:
    """Log-likelihood of every continuation of every item, by the fastest exact path (see module
    docstring).
    """
    out: list[list[float] | None] = [None] * len(items)
    single = [i for i, it in enumerate(items) if it.single_token]
    if reuse:
        scorer = PrefixScorer(model, pad_id, batch_size)
        groups: dict[object, list[int]] = defaultdict(list)
        for i in single:
            groups[items[i].group].append(i)
        for members in groups.values():
            scores = scorer.score_group([items[i] for i in members], tick)
            for i, s in zip(members, scores or [], strict=False):
                out[i] = s
    plain = [i for i in single if out[i] is None]
    if plain:
        for i, s in zip(
            plain,
            score_single_forward(model, [items[i] for i in plain], pad_id, batch_size, tick),
            strict=True,
        ):
            out[i] = s
    multi = [i for i, it in enumerate(items) if not it.single_token]
    if multi:
        for i, s in zip(
            multi, score_full(model, [items[i] for i in multi], pad_id, batch_size, tick), strict=True
        ):
            out[i] = s
    return out  # type: ignore[return-value]
