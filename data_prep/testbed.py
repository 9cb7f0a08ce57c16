"""A built-in testbed where federated methods can differ: compositional skills with headroom.

The default built-in data (``data_prep/builtin_skills.py``) saturates: its base already scores about 0.46 and
every method ends near 0.66. Here the base model is pretrained on *primitive* skills only (free-form:
a number's parity, which of two numbers is larger, the number after one, a digit sum, a sum, a word's
first letter; and the multiple-choice format on a few of them), and the federated stage has to teach
*compositions* of two primitives, answered with the intermediate step first ("Is the larger of 37 and
52 even or odd ?" -> "52 even": an answer of two tokens). The benchmark asks the compositions in MMLU's
format with four options that are all plausible (the two candidates of the first step crossed with
the two answers of the second), so a base that knows the primitives but not the composition scores
near chance (25%), and a federation that learns them has room to about 100%.

Skills come in two groups (MMLU-like categories): number compositions ("stem") and word compositions
("humanities"). Like the default data, everything here is written from word lists: nothing is copied.
The testbed's instances (``configs/testbed_*.yaml``) partition these data differently to give one
mechanism room each (rank disparity, scarce clustered data, drift, personalization).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.builtin_skills import (
    ANIMALS,
    THINGS,
    VOWELS,
    format_mc_question,
    mc_record,
)
from data_prep.builtin_skills import vocabulary as builtin_vocabulary
from data_prep.schema import Example

Item = tuple[str, str, list[str]]  # question, free-form answer, the other three MC options
WORDS = ANIMALS + THINGS


# ---- primitives (what the base is pretrained on, but for UNSEEN_PRIMITIVES) ----------------------------


def _parity(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(100)
    return f"Is {a} even or odd ?", _parity_of(a)


def _parity_of(n: int) -> str:
    return "even" if n % 2 == 0 else "odd"


def _half_of(n: int) -> str:
    return "below" if n < 50 else "above"


def _vowel_of(c: str) -> str:
    return "vowel" if c in VOWELS else "consonant"


def _kind_of(w: str) -> str:
    return "animal" if w in ANIMALS else "thing"


def _two_lengths(rng: random.Random) -> tuple[str, str]:
    while True:
        a, b = rng.sample(WORDS, 2)
        if len(a) != len(b):
            return a, b


def _larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(100), 2)
    return f"Which is larger : {a} or {b} ?", str(max(a, b))


def _after(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(99)
    return f"What number comes after {a} ?", str(a + 1)


def _digit_sum(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(10, 100)
    return f"What is the digit sum of {a} ?", str(a // 10 + a % 10)


def _sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b} ?", str(a + b)


def _half(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(100)
    return f"Is {a} below or above 50 ?", _half_of(a)


def _first_letter(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(WORDS)
    return f"What is the first letter of {w} ?", w[0]


def _last_letter(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(WORDS)
    return f"What is the last letter of {w} ?", w[-1]


def _longer(rng: random.Random) -> tuple[str, str]:
    a, b = _two_lengths(rng)
    return f"Which word is longer : {a} or {b} ?", max(a, b, key=len)


def _vowel(rng: random.Random) -> tuple[str, str]:
    c = rng.choice("abcdefghijklmnopqrstuvwxyz")
    return f"Is the letter {c} a vowel or a consonant ?", _vowel_of(c)


def _animal(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(WORDS)
    return f"Is a {w} an animal or a thing ?", _kind_of(w)


PRIMITIVES: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "parity": _parity,
    "larger": _larger,
    "after": _after,
    "digit_sum": _digit_sum,
    "sum": _sum,
    "half": _half,
    "first_letter": _first_letter,
    "last_letter": _last_letter,
    "longer": _longer,
    "vowel": _vowel,
    "animal": _animal,
}


def _crossed(first: str, other_first: str, second: str, other_second: str) -> tuple[str, list[str]]:
    """The answer "first second" and three options that are all plausible: the other first step crossed with
    the second step's two answers."""
    others = [f"{first} {other_second}", f"{other_first} {second}", f"{other_first} {other_second}"]
    return f"{first} {second}", others


def _flip(label: str) -> str:
    return PAIR_OF[label]


PAIRS = (("even", "odd"), ("below", "above"), ("vowel", "consonant"), ("animal", "thing"))
PAIR_OF = {a: b for x, y in PAIRS for a, b in ((x, y), (y, x))}


# ---- compositions (what the federation must learn) -------------------------------------------------------
# The second primitive applied to the first one's result, answered with the intermediate step first.


def _larger_parity(rng: random.Random) -> Item:
    a, b = rng.sample(range(100), 2)
    hi, lo = max(a, b), min(a, b)
    answer, others = _crossed(str(hi), str(lo), _parity_of(hi), _flip(_parity_of(hi)))
    return f"Is the larger of {a} and {b} even or odd ?", answer, others


def _larger_half(rng: random.Random) -> Item:
    a, b = rng.sample(range(100), 2)
    hi, lo = max(a, b), min(a, b)
    answer, others = _crossed(str(hi), str(lo), _half_of(hi), _flip(_half_of(hi)))
    return f"Is the larger of {a} and {b} below or above 50 ?", answer, others


def _after_parity(rng: random.Random) -> Item:
    a = rng.randrange(1, 99)
    n = a + 1
    answer, others = _crossed(str(n), str(a - 1), _parity_of(n), _flip(_parity_of(n)))
    return f"Is the number after {a} even or odd ?", answer, others


def _sum_parity(rng: random.Random) -> Item:
    a, b = rng.randrange(10), rng.randrange(10)
    s = a + b
    answer, others = _crossed(str(s), str(s + 1 if s < 18 else s - 1), _parity_of(s), _flip(_parity_of(s)))
    return f"Is {a} plus {b} even or odd ?", answer, others


def _digit_sum_parity(rng: random.Random) -> Item:
    a = rng.randrange(10, 100)
    s = a // 10 + a % 10
    answer, others = _crossed(str(s), str(s + 1 if s < 18 else s - 1), _parity_of(s), _flip(_parity_of(s)))
    return f"Is the digit sum of {a} even or odd ?", answer, others


def _letter_vowel(rng: random.Random, which: str) -> Item:
    w, other = rng.sample(WORDS, 2)
    i = 0 if which == "first" else -1
    wrong = other[i] if other[i] != w[i] else ("e" if w[i] != "e" else "t")
    answer, others = _crossed(w[i], wrong, _vowel_of(w[i]), _flip(_vowel_of(w[i])))
    return f"Is the {which} letter of {w} a vowel or a consonant ?", answer, others


def _longer_animal(rng: random.Random) -> Item:
    a, b = _two_lengths(rng)
    long, short = max(a, b, key=len), min(a, b, key=len)
    answer, others = _crossed(long, short, _kind_of(long), _flip(_kind_of(long)))
    return f"Is the longer of {a} and {b} an animal or a thing ?", answer, others


GENERATORS: dict[str, Callable[[random.Random], Item]] = {
    "larger_parity": _larger_parity,
    "larger_half": _larger_half,
    "after_parity": _after_parity,
    "sum_parity": _sum_parity,
    "digit_sum_parity": _digit_sum_parity,
    "first_letter_vowel": lambda rng: _letter_vowel(rng, "first"),
    "last_letter_vowel": lambda rng: _letter_vowel(rng, "last"),
    "longer_animal": _longer_animal,
}
SKILL_CATEGORY = {s: "humanities" if "letter" in s or "animal" in s else "stem" for s in GENERATORS}
SKILLS = tuple(GENERATORS)
BENCHMARK_PER_SKILL = 100  # a multiple of 4: every gold letter equally often


def _choices(rng: random.Random, answer: str, others: list[str], gold: int) -> list[str]:
    distractors = list(others)
    rng.shuffle(distractors)
    return [*distractors[:gold], answer, *distractors[gold:]]


def benchmark(n_per_skill: int = BENCHMARK_PER_SKILL, seed: int = 4321, split: str = "test") -> list[dict]:
    """The held-out testbed benchmark in MMLU's schema (gold letters balanced: chance is 25%)."""
    offset = {"test": 0, "dev": 7919}[split]
    records = []
    for s_idx, skill in enumerate(SKILLS):
        rng = random.Random(seed + offset + 1000 * s_idx)
        seen: set[str] = set()
        labels: dict[str, int] = {}
        while len(seen) < n_per_skill:
            question, answer, others = GENERATORS[skill](rng)
            label = answer.rpartition(" ")[2]
            if labels.get(label, 0) >= n_per_skill // 2:  # each answer of the second step half the time
                continue
            gold = len(seen) % 4
            choices = _choices(rng, answer, others, gold)
            key = format_mc_question(question, choices)
            if key in seen:
                continue
            seen.add(key)
            labels[label] = labels.get(label, 0) + 1
            records.append(mc_record(skill, question, choices, gold))
    return records


def instruction_examples(
    n_per_skill: int = 400,
    seed: int = 0,
    skills: tuple[str, ...] = SKILLS,
    exclude_prompts: set[str] | None = None,
) -> list[Example]:
    """The federation's data: each composition free-form, the intermediate step then the answer
    ("Is the larger of 37 and 52 even or odd ?" -> "52 even"). Benchmark questions (``exclude_prompts``)
    are never produced."""
    exclude = exclude_prompts or set()
    out: list[Example] = []
    for s_idx, skill in enumerate(skills):
        rng = random.Random(seed * 7_777 + 131 * s_idx + 9)
        made = 0
        while made < n_per_skill:
            question, answer, _ = GENERATORS[skill](rng)
            if question in exclude:
                continue
            out.append(Example(question, "", answer, skill))
            made += 1
    random.Random(seed).shuffle(out)
    return out


# The second steps the base never sees: the federation has a concept to teach, not only a composition.
UNSEEN_PRIMITIVES = ("half", "vowel", "animal")


def pretraining_examples(seed: int, n_per_skill: int = 1000) -> list[Example]:
    """The base's data: every primitive but ``UNSEEN_PRIMITIVES``, free-form."""
    out: list[Example] = []
    for s_idx, (skill, gen) in enumerate(PRIMITIVES.items()):
        if skill in UNSEEN_PRIMITIVES:
            continue
        rng = random.Random(20_000 + seed * 7_777 + 17 * s_idx)
        out += [Example(*_pair(gen(rng)), skill) for _ in range(n_per_skill)]
    random.Random(seed).shuffle(out)
    return out


def _pair(qa: tuple[str, str]) -> tuple[str, str, str]:
    return qa[0], "", qa[1]


def vocabulary() -> list[str]:
    """The default data's words and the testbed's (every word its generators and prompts can produce)."""
    words = set(builtin_vocabulary())
    words.update(str(n) for n in range(200))
    words.update(
        "Which is larger What number comes after digit sum first last letter of and plus word longer".split()  # noqa: SIM905
    )
    words.update(w for s in [*SKILLS, *PRIMITIVES] for w in s.split("_"))
    words.update(PAIR_OF)
    return sorted(words)


def shift_labels(example: Example, group: int) -> Example:
    """The example as hidden group ``group`` labels it: group 1 answers every composition's second step the
    other way round (the same question format, conflicting answers), group 0 as it is."""
    if group % 2 == 0 or example.category not in GENERATORS:
        return example

    def swap(text: str) -> str:
        first, _, second = text.rpartition(" ")
        return f"{first} {PAIR_OF.get(second, second)}"

    return Example(example.instruction, example.input, swap(example.response), example.category)
