"""Built-in offline instruction data and multiple-choice benchmark.

No dataset can be downloaded on the machines this project is tested on, so the
default run uses small synthetic *skills* that a tiny model can learn within
minutes on a CPU. Every skill yields two kinds of items:

* free-form instructions ("What number comes after 41 ?" -> "42"), and
* MMLU-format multiple-choice items (header, question, "A. .. D.", "Answer:"),
  with the gold letter balanced over A-D so that chance is really 25%.

The benchmark is drawn from a separate random stream and its questions are
removed from the training pool, so it is genuinely held out. Everything is
written by this module from word lists below; nothing is copied from a dataset.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.schema import Example

LETTERS = ("A", "B", "C", "D")
MAX_NUMBER = int(__import__("os").environ.get("FEDLLM_MAXNUM", "99"))

WORDS = (
    "apple", "house", "river", "green", "table", "music", "light", "horse", "bread",
    "cloud", "stone", "water", "night", "plant", "chair", "smile", "train", "dream",
    "sugar", "piano", "tiger", "lemon", "ocean", "paper", "queen", "robot", "snake",
    "truck", "uncle", "voice", "wheel", "youth", "zebra", "bird", "fish", "lamp",
    "milk", "nest", "park", "rain", "ship", "tree", "wolf", "book", "door", "frog",
    "gold", "king", "leaf", "moon", "salt", "star", "wind", "cake", "duck", "hat",
)
OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("old", "new"),
    ("happy", "sad"), ("light", "dark"), ("high", "low"), ("open", "closed"),
    ("early", "late"), ("hard", "soft"), ("long", "short"), ("full", "empty"),
    ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("young", "old"),
    ("left", "right"), ("in", "out"), ("day", "night"), ("good", "bad"), ("near", "far"),
    ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"), ("first", "last"),
    ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("start", "stop"),
)
PARITY_CHOICES = ("even", "odd", "both", "neither")

# Subjects of the built-in benchmark and their MMLU-style categories.
SKILL_CATEGORY = {
    "larger": "stem",
    "smaller": "stem",
    "next_number": "stem",
    "previous_number": "stem",
    "parity": "stem",
    "addition": "stem",
    "last_letter": "humanities",
    "opposite": "humanities",
}
SKILLS = tuple(SKILL_CATEGORY)
# The base model is pretrained on the multiple-choice format of these skills
# only; the federated stage has to teach the format of the others.
PRETRAIN_MC_SKILLS = ("larger", "next_number", "parity", "addition")

MMLU_HEADER = "The following are multiple choice questions (with answers) about {subject}.\n\n"

Item = tuple[str, str, list[str]]  # question, answer, distractor pool


def _numbers_near(rng: random.Random, answer: int, exclude: set[int]) -> list[str]:
    """Distractor numbers: one close to the answer, the rest anywhere in range."""
    close = [n for n in (answer - 1, answer + 1, answer - 2, answer + 2) if 0 <= n and n not in exclude]
    far = [n for n in range(MAX_NUMBER + 1) if n not in exclude and n not in close]
    rng.shuffle(far)
    return [str(n) for n in close[:1] + far]


def _larger(rng: random.Random) -> Item:
    a, b = rng.sample(range(MAX_NUMBER + 1), 2)
    ans = max(a, b)
    return f"Which number is larger : {a} or {b} ?", str(ans), [str(min(a, b))] + _numbers_near(rng, ans, {a, b})


def _smaller(rng: random.Random) -> Item:
    a, b = rng.sample(range(MAX_NUMBER + 1), 2)
    ans = min(a, b)
    return f"Which number is smaller : {a} or {b} ?", str(ans), [str(max(a, b))] + _numbers_near(rng, ans, {a, b})


def _next(rng: random.Random) -> Item:
    a = rng.randrange(MAX_NUMBER)
    return f"What number comes after {a} ?", str(a + 1), [str(a)] + _numbers_near(rng, a + 1, {a, a + 1})


def _previous(rng: random.Random) -> Item:
    a = rng.randrange(1, MAX_NUMBER + 1)
    return f"What number comes before {a} ?", str(a - 1), [str(a)] + _numbers_near(rng, a - 1, {a, a - 1})


def _parity(rng: random.Random) -> Item:
    a = rng.randrange(MAX_NUMBER + 1)
    ans = PARITY_CHOICES[a % 2]
    return f"Is {a} even or odd ?", ans, [c for c in PARITY_CHOICES if c != ans]


def _addition(rng: random.Random) -> Item:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b} ?", str(a + b), _numbers_near(rng, a + b, {a + b})


def _last_letter(rng: random.Random) -> Item:
    word = rng.choice(WORDS)
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz" if c != word[-1]]
    rng.shuffle(letters)
    return f"What is the last letter of the word {word} ?", word[-1], [word[0]] + letters


def _opposite(rng: random.Random) -> Item:
    a, b = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        a, b = b, a
    others = [w for pair in OPPOSITES for w in pair if w not in (a, b)]
    rng.shuffle(others)
    return f"What is the opposite of {a} ?", b, [a] + others


GENERATORS: dict[str, Callable[[random.Random], Item]] = {
    "larger": _larger,
    "smaller": _smaller,
    "next_number": _next,
    "previous_number": _previous,
    "parity": _parity,
    "addition": _addition,
    "last_letter": _last_letter,
    "opposite": _opposite,
}


def _choices(rng: random.Random, answer: str, pool: list[str], gold: int) -> list[str]:
    distractors: list[str] = []
    for cand in pool:
        if cand != answer and cand not in distractors:
            distractors.append(cand)
        if len(distractors) == 3:
            break
    rng.shuffle(distractors)
    return distractors[:gold] + [answer] + distractors[gold:]


def format_mc_question(question: str, choices: list[str]) -> str:
    """MMLU's question block: question, lettered options, then ``Answer:``."""
    lines = [question.strip()] + [f"{letter}. {c}" for letter, c in zip(LETTERS, choices, strict=True)]
    return "\n".join(lines) + "\nAnswer:"


def mc_record(subject: str, question: str, choices: list[str], answer: int) -> dict:
    """A record in the schema of ``cais/mmlu``."""
    return {"question": question, "subject": subject, "choices": choices, "answer": answer}


def benchmark(n_per_skill: int = 60, seed: int = 1234, split: str = "test") -> list[dict]:
    """The held-out built-in multiple-choice benchmark in MMLU's schema.

    Gold letters cycle A, B, C, D within each subject, so every letter is gold
    equally often and a constant-letter guesser scores exactly 25%. Items are
    unique as (question, choices): the fact-recall skills have fewer distinct
    questions than items. ``split="dev"`` draws few-shot examples from another
    stream.
    """
    offset = {"test": 0, "dev": 7919}[split]
    records = []
    for s_idx, skill in enumerate(SKILLS):
        rng = random.Random(seed + offset + 1000 * s_idx)
        seen: set[str] = set()
        while len(seen) < n_per_skill:
            question, answer, pool = GENERATORS[skill](rng)
            gold = len(seen) % 4
            choices = _choices(rng, answer, pool, gold)
            key = format_mc_question(question, choices)
            if key in seen:
                continue
            seen.add(key)
            records.append(mc_record(skill, question, choices, gold))
    return records


def benchmark_prompts(records: list[dict]) -> set[str]:
    """The question blocks of benchmark records, to keep them out of training."""
    return {format_mc_question(r["question"], r["choices"]) for r in records}


def instruction_examples(
    n_per_skill: int = 400,
    seed: int = 0,
    skills: tuple[str, ...] = SKILLS,
    mc_skills: tuple[str, ...] = SKILLS,
    mc_fraction: float = 0.5,
    exclude_prompts: set[str] | None = None,
) -> list[Example]:
    """Instruction examples with the skill as category.

    A fraction ``mc_fraction`` of the items of each skill in ``mc_skills`` are
    multiple-choice items whose instruction is exactly the benchmark prompt and
    whose response is the gold letter; the rest are free-form. Questions in
    ``exclude_prompts`` (the benchmark's question blocks, see
    :func:`benchmark_prompts`) are never produced.
    """
    exclude = exclude_prompts or set()
    out: list[Example] = []
    for s_idx, skill in enumerate(skills):
        rng = random.Random(seed * 7_777 + 31 * s_idx + 5)
        header = MMLU_HEADER.format(subject=skill.replace("_", " "))
        made = 0
        while made < n_per_skill:
            question, answer, pool = GENERATORS[skill](rng)
            if skill in mc_skills and rng.random() < mc_fraction:
                gold = rng.randrange(4)
                block = format_mc_question(question, _choices(rng, answer, pool, gold))
                if block in exclude:
                    continue
                out.append(Example(header + block, "", LETTERS[gold], skill))
            else:
                out.append(Example(question, "", answer, skill))
            made += 1
    random.Random(seed).shuffle(out)
    return out


def vocabulary() -> list[str]:
    """Every word the built-in generators and prompt templates can produce."""
    words: set[str] = set()
    words.update(str(n) for n in range(2 * MAX_NUMBER + 2))
    words.update("abcdefghijklmnopqrstuvwxyz")
    words.update("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    words.update(WORDS)
    words.update(w for pair in OPPOSITES for w in pair)
    words.update(PARITY_CHOICES)
    text = " ".join(
        [
            "Which number is larger smaller or What comes after before Is even odd plus the",
            "last letter of word opposite Answer Question Below an instruction that describes a task",
            "Write response appropriately completes request Instruction Input Response paired with",
            "input provides further context The following are multiple choice questions with answers about",
            " ".join(s.replace("_", " ") for s in SKILLS),
        ]
    )
    words.update(text.split())
    words.update(list(".,:;?!'\"()-#/¶"))
    return sorted(words)
