"""The federation's data: the held-out test set, the validation set and each client's partition, tokenized.

Loading and partitioning happen before any model is loaded (a bad file fails
at once); tokenizing needs the base's tokenizer. Every split is seeded from
``federation.seed`` alone, so the simulation, every process of a launch and a
Flower site that rebuilds the partition all get the same clients.

Three splits, none of which shares an example (or, where examples have sources, a source: a chat's
parts and copies) with another: the clients' data (each client's own test share inside it), the
held-out test set (``data.eval_size``: what a comparison's final table reports) and the validation set
(``data.validation_size``: what a choice, e.g. a learning rate, is made on; ``fedllm.run.compare``'s
tuning). The validation set is drawn from what ``data.max_examples``' seeded sample leaves out, so adding
it moves no example of the clients or of the test set (a table run before it existed is the same run);
with no sample to draw beside, it is taken after the test set, before the partition. ``eval.split``
says which of the two held-out sets a run's evaluation reads; a run that reads one never reads the other.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep import natural_instructions as ni
from data_prep.loaders import FLOWERTUNE_FORMATS, load_examples_and_rest
from data_prep.natural_instructions import Reference
from data_prep.partition import client_stats, partition, source_units, split_units
from data_prep.schema import DataError, Example
from data_prep.tokenized import TokenRows, tokenize_cached
from eval.progress import bars_as_lines
from fedllm.protocol import derive_seed

log = logging.getLogger(__name__)


@dataclass
class Partitions:
    eval_examples: list[Example]  # what the run's evaluation reads: the test or the validation set
    clients: list[list[Example]]  # each client's examples, its test share first
    test_sizes: list[int]
    stats: list[dict]
    generation: list[Reference] = field(default_factory=list)  # answered and scored by Rouge-L
    split: str = "test"  # which held-out set eval_examples is (eval.split)


def generation_set(cfg, eval_examples: list[Example], folder, tasks: list[str]) -> list[Reference]:
    """What the Rouge-L evaluation answers: ``eval.generate_size`` examples of the held-out ``tasks`` of
    ``folder`` (an even seeded share of each task, every reference kept), else the first of the held-out
    split."""
    n = cfg.eval.generate_size
    if not n:
        return []
    if not tasks:
        return [Reference(e, (e.response,)) for e in eval_examples[:n]]
    share = -(-n // len(tasks))
    picked = [ni.load_task(folder, t, share, derive_seed(cfg.federation.seed, 7)) for t in tasks]
    # round-robin over the tasks, so a smaller generate_size still covers every task
    flat = [refs[i] for i in range(share) for refs in picked if i < len(refs)]
    return flat[:n]


def load_partitions(cfg) -> Partitions:
    """Load ``data.dataset``, hold out the evaluation set, split the rest over ``federation.num_clients``."""
    d, seed = cfg.data, cfg.federation.seed
    heldout, folder = [], None
    if d.heldout_tasks:
        folder = ni.resolve(d.dataset)
        if folder is None:
            raise DataError(
                f"data.heldout_tasks needs Natural Instructions data; data.dataset = {d.dataset!r}"
            )
        heldout = ni.select_tasks(folder, d.heldout_tasks)
    examples, left = load_examples_and_rest(
        d.dataset, d.format, d.max_examples, d.builtin_examples_per_skill, seed, d.examples_per_task, heldout
    )
    units = source_units(examples)
    if units is not None:  # parts of one source (a ShareGPT chat): every split keeps them together
        return _partitions_by_source(cfg, examples, units, left, folder, heldout)
    order = list(range(len(examples)))
    random.Random(derive_seed(seed, 3)).shuffle(order)
    n_eval = min(d.eval_size, len(examples) // 5)
    eval_examples = [examples[i] for i in order[:n_eval]]
    if left:  # drawn beside the sample: the sample's splits stay as they are without it
        order_left = list(range(len(left)))
        random.Random(derive_seed(seed, 13)).shuffle(order_left)
        validation = [left[i] for i in order_left[: d.validation_size]]
        n_val = 0
    else:
        n_val = min(d.validation_size, (len(examples) - n_eval) // 5)
        validation = [examples[i] for i in order[n_eval : n_eval + n_val]]
    held = set(order[: n_eval + n_val])
    if d.partition == "contiguous":  # the rest in file order: the shards are the dataset's own
        pool = [e for i, e in enumerate(examples) if i not in held]
    else:
        pool = [examples[i] for i in order[n_eval + n_val :]]
    parts = _partition(cfg, pool)
    clients, tests = [], []
    for k, idx in enumerate(parts):
        idx = list(idx)
        random.Random(derive_seed(seed, 5, k)).shuffle(idx)
        mine = [pool[i] for i in idx]
        if d.label_shift_groups:
            if d.dataset == "testbed":
                from data_prep.testbed import shift_labels
            else:
                from data_prep.builtin_skills import shift_labels

            mine = [shift_labels(e, k % d.label_shift_groups) for e in mine]
        clients.append(mine)
        tests.append(test_size(len(idx), d))
    stats = client_stats(pool, parts, d.partition)
    return _evaluated(cfg, eval_examples, validation, clients, tests, stats, folder, heldout)


def _evaluated(
    cfg, test: list[Example], validation: list[Example], clients, tests, stats, folder, heldout
) -> Partitions:
    """The partitions with the held-out set ``eval.split`` names as the one the run evaluates on (and
    generates answers for); the other is not kept, so nothing of a validation run reads the test set."""
    if cfg.eval.split == "validation":
        if not validation:
            raise DataError(
                "eval.split = validation: the validation set is empty (set data.validation_size > 0, and "
                "check that the dataset has examples to spare)"
            )
        test = validation
        if heldout:  # the held-out tasks' Rouge-L is a test of its own: a choice never reads it
            log.info("eval.split = validation: the held-out tasks %s are not answered", heldout)
            folder, heldout = None, []
    parts = Partitions(test, clients, tests, stats, generation_set(cfg, test, folder, heldout))
    parts.split = cfg.eval.split
    return parts


def test_size(n: int, d) -> int:
    """How many of a client's ``n`` examples its own test split takes: ``data.client_test_fraction`` of them,
    at most ``data.client_test_max`` (0: no cap)."""
    size = int(n * d.client_test_fraction)
    return min(size, d.client_test_max) if d.client_test_max else size


def _partition(cfg, examples: list[Example]) -> list[list[int]]:
    """``data.partition`` of ``examples`` over the run's clients, with the config's settings."""
    d = cfg.data
    return partition(
        examples,
        d.partition,
        cfg.federation.num_clients,
        cfg.federation.seed,
        d.dirichlet_alpha,
        d.shards_per_client,
        d.min_examples_per_client,
    )


def own_split(examples: list[Example], d) -> tuple[list[Example], int]:
    """A site's own examples ordered with its test share first, and that share's size (:func:`test_size` of
    the run's ``data`` section): whole sources (:attr:`Example.group`) where the examples have them, as
    :func:`load_partitions` splits a simulated client's; else the first ones, in their order."""
    units = source_units(examples)
    if units is None:
        return examples, test_size(len(examples), d)
    test, train = split_units(units, test_size(len(examples), d), keep=1)
    return [examples[i] for u in test + train for i in u], sum(map(len, test))


def _partitions_by_source(
    cfg, examples: list[Example], units: list[list[int]], left: list[Example], folder, heldout
) -> Partitions:
    """:func:`load_partitions` where examples share sources (:attr:`Example.group`): the held-out set, the
    validation set, the clients and each client's own test split take whole sources, so no held-out
    example has a part of its source (another part of its chat, a copy of it) in any client's training.
    The partition draws over sources, each with its first example's category (a chat's parts share its
    kind). The validation set comes from ``left`` (what the sample left out), of the sources the sample
    does not touch at all."""
    d, seed = cfg.data, cfg.federation.seed
    order = list(range(len(units)))
    random.Random(derive_seed(seed, 3)).shuffle(order)
    held, rest = split_units([units[u] for u in order], min(d.eval_size, len(examples) // 5))
    eval_examples = [examples[i] for u in held for i in u]
    if left:  # beside the sample: the sample's splits stay exactly as they are without a validation set
        validation = validation_beside(examples, left, d.validation_size, seed)
    else:
        val, rest = split_units(rest, min(d.validation_size, sum(map(len, rest)) // 5))
        validation = [examples[i] for u in val for i in u]
    if d.partition == "contiguous":  # the rest in file order: the shards are the dataset's own
        rest.sort(key=lambda u: u[0])
    parts = _partition(cfg, [examples[u[0]] for u in rest])  # a source by its first example
    pool: list[Example] = []
    pool_parts: list[list[int]] = []
    clients, tests = [], []
    for k, picked in enumerate(parts):
        mine_units = [rest[j] for j in picked]
        random.Random(derive_seed(seed, 5, k)).shuffle(mine_units)
        test, train = split_units(mine_units, test_size(sum(map(len, mine_units)), d), keep=1)
        mine = [examples[i] for u in test + train for i in u]
        pool_parts.append(list(range(len(pool), len(pool) + len(mine))))
        pool += mine
        clients.append(mine)
        tests.append(sum(map(len, test)))
    stats = client_stats(pool, pool_parts, d.partition)
    return _evaluated(cfg, eval_examples, validation, clients, tests, stats, folder, heldout)


def validation_beside(examples: list[Example], left: list[Example], size: int, seed: int) -> list[Example]:
    """Up to ``size`` examples of whole sources drawn (seeded) from ``left``, of the sources no example of
    ``examples`` has: a validation set that shares no chat, part or copy with the sample's clients or its
    test set, and that moves none of their examples."""
    taken = {e.group for e in examples if e.group}
    units = source_units([e for e in left if e.group not in taken]) if left else None
    if not units:
        return []
    spare = [e for e in left if e.group not in taken]
    order = list(range(len(units)))
    random.Random(derive_seed(seed, 13)).shuffle(order)
    val, _ = split_units([units[u] for u in order], size)
    return [spare[i] for u in val for i in u]


def holds_conversations(dataset: str) -> bool:
    """Whether ``dataset`` is a local JSON / jsonl file in ShareGPT's layout (data_prep/sharegpt.py)."""
    from pathlib import Path

    from data_prep.loaders import holds_conversations as in_sharegpt_layout

    path = Path(dataset).expanduser()
    return path.suffix.lower() in (".json", ".jsonl") and path.is_file() and in_sharegpt_layout(path)


def prompt_template(cfg) -> str:
    return (
        cfg.data.template
        if cfg.data.template != "auto"
        else "chat"  # conversations go through the base's chat template (data_prep/sharegpt.py)
        if cfg.data.dataset == "sharegpt" or holds_conversations(cfg.data.dataset)
        else "plain"
        if cfg.data.dataset in ("builtin", "testbed")
        else "flowertune"
        if cfg.data.format.startswith("flowertune-") or cfg.data.dataset in FLOWERTUNE_FORMATS
        else "alpaca"
    )


def max_seq_len(cfg, context: int | None) -> int:
    """``data.max_seq_len`` (default: the model's context, at most 512), refused when longer than the
    context.
    """
    max_len = cfg.data.max_seq_len or min(512, context or 512)
    if context is not None and max_len > context:
        raise ValueError(
            f"data.max_seq_len = {max_len} exceeds the model's context length {context}: lower "
            "data.max_seq_len"
        )
    return max_len


def token_cache_dir() -> Path:
    """Where tokenized data is cached: ``$FEDLLM_CACHE/tokens`` (default ``~/.cache/fedllm/tokens``)."""
    from fedllm.model.builtin_base import default_cache_dir

    return default_cache_dir() / "tokens"


def split_client(
    rows: TokenRows,
    row_of: np.ndarray,
    first: int,
    n_examples: int,
    n_test: int,
    client_id: int,
    max_len: int,
) -> tuple[TokenRows, TokenRows]:
    """A client's (train, test) rows: its examples are ``first .. first + n_examples`` of the tokenized list,
    its test share first; refuses a client left with no training example."""
    test, train = row_of[first : first + n_test], row_of[first + n_test : first + n_examples]
    test, train = test[test >= 0], train[train >= 0]  # -1: truncation left no response token
    if not len(train):
        raise ValueError(f"client {client_id}: no training example survives data.max_seq_len = {max_len}")
    return rows.select_table_rows(train), rows.select_table_rows(test)


def tokenize_clients(
    clients: list[list[Example]],
    test_sizes: list[int],
    tokenizer,
    template: str,
    max_len: int,
    ids: list[int] | None = None,
    extra: list[Example] | None = None,
    truncation: str = "right",
) -> tuple[list[tuple[TokenRows, TokenRows]], TokenRows]:
    """Every client's (train, test) rows and the rows of ``extra`` (the held-out set), from one cached,
    batched tokenization of all of them (``data_prep.tokenized``); ``ids``: the clients' ids for messages."""
    extra = extra or []
    everything = [e for examples in clients for e in examples] + extra
    with bars_as_lines(log):  # datasets' "tokenizing" bar: whole lines in a log file
        rows, row_of = tokenize_cached(
            everything, tokenizer, template, max_len, token_cache_dir(), truncation
        )
    out, first = [], 0
    for k, (examples, n_test) in enumerate(zip(clients, test_sizes, strict=True)):
        cid = ids[k] if ids else k
        out.append(split_client(rows, row_of, first, len(examples), n_test, cid, max_len))
        first += len(examples)
    rest = row_of[first:]
    held_out = rows.select_table_rows(rest[rest >= 0])
    return out, held_out
