"""Tokenized instruction data at the scale of real instruction sets: batched, cached on disk, memory-mapped.

Tokenizing 200k records one at a time took about a minute before the first
step, in every launched process, on every start. Here the examples go
through the fast tokenizer in batches with ``datasets.Dataset.map``, whose
result is written to an Arrow file in the cache folder and memory-mapped on
later starts (and by the other processes of a launch, once the main process
has written it). The file's name is a digest of everything the tokens depend
on: the examples' text, the tokenizer (its full serialization), the prompt
template, the maximum length and this module's version; any change gives a
new file, so a stale cache cannot be read.

Rows are read on demand (:class:`TokenRows`): a client's data is a list of
row numbers into the shared table, not a copy of its tokens.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.prompts import IGNORE_INDEX, TokenizedExample, collate, tokenize_batch
from data_prep.schema import Example

log = logging.getLogger(__name__)

# bump when what a row holds changes (4: conversations' labels end at each answer's EOS; 5: a left cut
# keeps the BOS; 6: ... the BOS the tokenizer added, not a chat template's first token; 7: a chat template's
# answer ends at the template's own end of turn, Gemma's <end_of_turn>)
VERSION = 7


def tokenizer_digest(tokenizer) -> str:
    """What a tokenizer's output depends on: its full serialization (fast tokenizers) or its files' names."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (
        backend.to_str()
        if backend is not None
        else repr(
            (type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer), tokenizer.all_special_tokens)
        )
    )
    text += "\x00" + str(getattr(tokenizer, "chat_template", None) or "")  # data.template=chat renders it
    return hashlib.sha256(text.encode()).hexdigest()


def examples_digest(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        for part in (e.instruction, e.input, e.response):
            h.update(part.encode())
            h.update(b"\x00")
        for role, text in e.turns:  # a conversation: every turn
            h.update(f"{role}\x02{text}\x00".encode())
        h.update(b"\x01")
    return h.hexdigest()


def column(table, name: str) -> np.ndarray:
    """A whole column as one array, straight from Arrow (``table[name]`` iterates row by row: seconds for
    200k rows)."""
    return table.data.column(name).to_numpy()


def unknown_share(tables, unk_id: int) -> tuple[int, int]:
    """(unknown tokens, tokens) among the tokens trained on (``labels`` not -100: the responses, not the
    template) over every row of ``tables``."""
    import pyarrow.compute as pc

    unknown = total = 0
    for table in tables:
        labels = pc.list_flatten(table.data.column("labels"))
        total += int(pc.sum(pc.not_equal(labels, -100)).as_py() or 0)
        unknown += int(pc.sum(pc.equal(labels, unk_id)).as_py() or 0)
    return unknown, total


class TokenRows(Sequence):
    """Rows of a tokenized table, read on demand; indexing gives :class:`TokenizedExample` s."""

    def __init__(self, table, rows: Sequence[int] | None = None) -> None:
        self.table = table  # a datasets.Dataset in numpy format with input_ids, labels, length
        self.rows = np.arange(len(table)) if rows is None else np.asarray(rows, dtype=np.int64)
        self._lengths: np.ndarray | None = None
        self._flat: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.select(range(*i.indices(len(self))))
        return self.take([i])[0]

    def take(self, positions: Sequence[int]) -> list[TokenizedExample]:
        """The examples at ``positions``, read in one call on the table (a training batch: one read per
        batch costs a third of one per row)."""
        rows = self.table[self.rows[np.asarray(positions, dtype=np.int64)].tolist()]
        return [
            TokenizedExample(ids.tolist(), labels.tolist())
            for ids, labels in zip(rows["input_ids"], rows["labels"], strict=True)
        ]

    def batch(self, positions: Sequence[int], pad_token_id: int) -> dict:
        """The examples at ``positions`` as one right-padded training batch (what ``collate(take(positions))``
        gives), read straight from the table's memory-mapped token buffers.

        A batch read through ``take`` turns every row into Python lists and back into tensors (0.43 ms for a
        batch of 8 on the built-in data); here each column is one flat array of tokens and one of row
        offsets, taken zero-copy once, and a batch is two numpy gathers (0.013 ms;
        ``scripts/bench_client_batch.py --step-costs``).
        """
        import torch

        flat = self._columns()
        if flat is None:
            return collate(self.take(positions), pad_token_id)
        rows = self.rows[np.asarray(positions, dtype=np.int64)]
        offsets, _ = flat["input_ids"]
        starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
        columns = np.arange(int(lengths.max()))[None, :]
        real = columns < lengths[:, None]
        source = (starts[:, None] + columns)[real]
        out = {}
        for name, fill in (("input_ids", pad_token_id), ("labels", IGNORE_INDEX)):
            values = np.full(real.shape, fill, dtype=np.int64)
            values[real] = flat[name][1][source]
            out[name] = torch.from_numpy(values)
        out["attention_mask"] = torch.from_numpy(real.astype(np.int64))
        return out

    def _columns(self) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """Each token column as (row offsets, flat values), zero-copy from Arrow; None where the table is a
        view through an indices mapping (then rows are read through ``take``)."""
        if self._flat is None:
            if getattr(self.table, "_indices", None) is not None:
                return None
            flat = {}
            for name in ("input_ids", "labels"):
                column = self.table.data.column(name)
                array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
                # a sliced array's offsets still index its (unsliced) values: no re-basing needed
                flat[name] = (array.offsets.to_numpy().astype(np.int64), array.values.to_numpy())
            if not np.array_equal(flat["input_ids"][0], flat["labels"][0]):
                return None
            self._flat = flat
        return self._flat

    def select(self, rows: Sequence[int]) -> TokenRows:
        """The rows at positions ``rows`` of this selection (sharing the table)."""
        out = TokenRows(self.table, self.rows[np.asarray(list(rows), dtype=np.int64)])
        out._lengths, out._flat = self._lengths, self._flat
        return out

    def select_table_rows(self, table_rows: Sequence[int]) -> TokenRows:
        """The given rows of the underlying table (e.g. from ``tokenize_cached``'s row numbers)."""
        out = TokenRows(self.table, table_rows)
        out._lengths, out._flat = self._lengths, self._flat
        return out

    def __repr__(self) -> str:
        return f"TokenRows({len(self)} rows)"

    def lengths(self) -> np.ndarray:
        """Each row's token count (for length-grouped batches)."""
        if self._lengths is None:
            self._lengths = column(self.table, "length")
        return self._lengths[self.rows]


def tokenize_cached(
    examples: Sequence[Example],
    tokenizer,
    template: str,
    max_seq_len: int,
    cache_dir: Path,
    truncation: str = "right",
) -> tuple[TokenRows, np.ndarray]:
    """All ``examples`` tokenized (cached, see module docstring); returns the rows and, for each example,
    its row (-1 where truncation left no response token)."""
    import datasets

    key = hashlib.sha256(
        repr(
            (
                VERSION,
                examples_digest(examples),
                tokenizer_digest(tokenizer),
                template,
                max_seq_len,
                truncation,
            )
        ).encode()
    ).hexdigest()[:24]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"tokens-{key}.arrow"

    def encode(batch: dict, indices: list[int]) -> dict:
        toks = tokenize_batch([examples[i] for i in indices], tokenizer, template, max_seq_len, truncation)
        kept = [(i, t) for i, t in zip(indices, toks, strict=True) if t is not None]
        return {
            "example": [i for i, _ in kept],
            "input_ids": [t.input_ids for _, t in kept],
            "labels": [t.labels for _, t in kept],
            "length": [len(t.input_ids) for _, t in kept],
            "cut": [t.cut for _, t in kept],
        }

    index = datasets.Dataset.from_dict({"example": list(range(len(examples)))})
    reused = path.exists()
    table = index.map(
        encode,
        with_indices=True,
        batched=True,
        batch_size=2000,
        remove_columns=["example"],
        cache_file_name=str(path),
        load_from_cache_file=True,
        new_fingerprint=key,
        desc="tokenizing",
    ).with_format("numpy")
    log.info("%s %d examples (%s)", "read the tokens of" if reused else "tokenized", len(examples), path)
    row_of = np.full(len(examples), -1, dtype=np.int64)
    row_of[column(table, "example")] = np.arange(len(table))
    cut = column(table, "cut") if len(table) else np.zeros(0, dtype=np.int64)
    dropped = int((row_of < 0).sum())
    talks = np.array([bool(examples[i].turns) for i in column(table, "example")], dtype=bool)
    single, turned = int(((cut > 0) & ~talks).sum()), int(((cut > 0) & talks).sum())
    if dropped or single or turned:
        how = " (the prompt's start)" if truncation == "left" else " (the response's end)"
        parts = [f"{single} are cut from the {truncation}{how}"] if single or not turned else []
        if turned:  # conversations are cut after an answer, whatever data.truncation says
            parts.append(f"{turned} conversations end at an earlier answer (cut at a turn boundary)")
        log.warning(
            "max_seq_len = %d: %d of %d examples are longer; %s; %d are dropped (no response token left)",
            max_seq_len, dropped + single + turned, len(examples), ", ".join(parts), dropped,
        )  # fmt: skip
    return TokenRows(table), row_of
