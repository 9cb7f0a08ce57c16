"""Built-in offline instruction data and multiple-choice benchmark.

No dataset can be downloaded on the machines this project is tested on, so the
default run uses small synthetic *skills* that a tiny model can learn within
minutes on a CPU. Every skill yields two kinds of items:

* free-form instructions ("Is 37 below or above 50 ?" -> "below"), and
* MMLU-format multiple-choice items (header, question, "A. .. D.", "Answer:"),
  with the gold letter balanced over A-D so that chance is really 25%.

The skills come in two groups. The base model is pretrained on the free-form
items of every skill and on the multiple-choice items of the *format skills*
only, so it knows every answer but has learned the multiple-choice format on
other questions. The benchmark asks the *benchmark skills* in MMLU's format:
what the federated stage teaches is to apply that format to knowledge the base
already holds, the way instruction tuning lifts a base model's MMLU score. A
skill is a lookup (a number's or a word's property) so that a 200k-parameter
model can hold it.

The benchmark is drawn from a separate random stream and its questions are
removed from every training pool, so it is genuinely held out. Everything is
written by this module from word lists below; nothing is copied from a dataset.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data_prep.schema import Example

LETTERS = ("A", "B", "C", "D")
MAX_NUMBER = 99

ANIMALS = (
    "horse",
    "tiger",
    "zebra",
    "snake",
    "bird",
    "fish",
    "wolf",
    "frog",
    "duck",
    "cat",
    "dog",
    "cow",
    "lion",
    "bear",
    "mouse",
    "sheep",
    "goat",
    "eagle",
    "shark",
    "whale",
    "rabbit",
    "fox",
    "deer",
    "owl",
)
THINGS = (
    "apple",
    "house",
    "table",
    "chair",
    "train",
    "piano",
    "paper",
    "truck",
    "wheel",
    "lamp",
    "book",
    "door",
    "stone",
    "bread",
    "robot",
    "ship",
    "cake",
    "hat",
    "cup",
    "bed",
    "car",
    "key",
    "box",
    "pen",
)
VOWELS = "aeiou"

# Every skill answers from a small fixed set (two answers that can be right and
# two that never are), so the multiple-choice format is learnable by a tiny
# model: knowing the skill means telling the two plausible options apart.
SKILL_CATEGORY = {
    "parity": "stem",
    "comparison": "stem",
    "half": "stem",
    "sum_parity": "stem",
    "multiple_of_three": "stem",
    "vowel": "humanities",
    "animal": "humanities",
    "first_letter_vowel": "humanities",
    "last_letter_vowel": "humanities",
}
SKILLS = tuple(SKILL_CATEGORY)
# The base model is pretrained on the multiple-choice format of these skills (and
# of "match", which asks for a word named in the question: the format alone) ...
FORMAT_SKILLS = ("parity", "comparison", "vowel", "animal")
PRETRAIN_MC_SKILLS = (*FORMAT_SKILLS, "match")
# ... and the benchmark asks these in that format (the federated data covers all skills).
BENCHMARK_SKILLS = tuple(s for s in SKILLS if s not in FORMAT_SKILLS)
BENCHMARK_PER_SKILL = 160  # a multiple of 4: every gold letter equally often

MMLU_HEADER = "The following are multiple choice questions (with answers) about {subject}.\n\n"

Item = tuple[str, str, list[str]]  # question, answer, the three other options


def _binary(question: str, truth: bool, yes: str, no: str, never: tuple[str, str]) -> Item:
    answer, other = (yes, no) if truth else (no, yes)
    return question, answer, [other, *never]


def _parity(rng: random.Random) -> Item:
    a = rng.randrange(MAX_NUMBER + 1)
    return _binary(f"Is {a} even or odd ?", a % 2 == 0, "even", "odd", ("both", "neither"))


def _comparison(rng: random.Random) -> Item:
    a, b = rng.sample(range(MAX_NUMBER + 1), 2)
    return _binary(f"Is {a} larger than {b} ?", a > b, "yes", "no", ("maybe", "unknown"))


def _half(rng: random.Random) -> Item:
    a = rng.randrange(MAX_NUMBER + 1)
    return _binary(f"Is {a} below or above 50 ?", a < 50, "below", "above", ("equal", "none"))


def _sum_parity(rng: random.Random) -> Item:
    a, b = rng.randrange(10), rng.randrange(10)
    return _binary(f"Is {a} plus {b} even or odd ?", (a + b) % 2 == 0, "even", "odd", ("both", "neither"))


def _multiple_of_three(rng: random.Random) -> Item:
    a = rng.randrange(MAX_NUMBER + 1)
    return _binary(f"Is {a} a multiple of three ?", a % 3 == 0, "yes", "no", ("maybe", "unknown"))


def _vowel(rng: random.Random) -> Item:
    c = rng.choice("abcdefghijklmnopqrstuvwxyz")
    return _binary(
        f"Is the letter {c} a vowel or a consonant ?", c in VOWELS, "vowel", "consonant", ("number", "symbol")
    )


def _animal(rng: random.Random) -> Item:
    w = rng.choice(ANIMALS + THINGS)
    return _binary(f"Is a {w} an animal or a thing ?", w in ANIMALS, "animal", "thing", ("color", "number"))


def _first_letter_vowel(rng: random.Random) -> Item:
    w = rng.choice(ANIMALS + THINGS)
    return _binary(
        f"Does the word {w} start with a vowel ?", w[0] in VOWELS, "yes", "no", ("maybe", "unknown")
    )


def _last_letter_vowel(rng: random.Random) -> Item:
    w = rng.choice(ANIMALS + THINGS)
    return _binary(
        f"Does the word {w} end with a vowel ?", w[-1] in VOWELS, "yes", "no", ("maybe", "unknown")
    )


def _match(rng: random.Random) -> Item:
    """The multiple-choice format alone: the answer is named in the question."""
    words = rng.sample(ANIMALS + THINGS, 4)
    return f"Which word is {words[0]} ?", words[0], words[1:]


GENERATORS: dict[str, Callable[[random.Random], Item]] = {
    "parity": _parity,
    "comparison": _comparison,
    "half": _half,
    "sum_parity": _sum_parity,
    "multiple_of_three": _multiple_of_three,
    "vowel": _vowel,
    "animal": _animal,
    "first_letter_vowel": _first_letter_vowel,
    "last_letter_vowel": _last_letter_vowel,
    "match": _match,
}


def _choices(rng: random.Random, answer: str, others: list[str], gold: int) -> list[str]:
    distractors = list(others)
    rng.shuffle(distractors)
    return [*distractors[:gold], answer, *distractors[gold:]]


def format_mc_question(question: str, choices: list[str]) -> str:
    """MMLU's question block: question, lettered options, then ``Answer:``."""
    lines = [question.strip()] + [f"{letter}. {c}" for letter, c in zip(LETTERS, choices, strict=True)]
    return "\n".join(lines) + "\nAnswer:"


def mc_record(subject: str, question: str, choices: list[str], answer: int) -> dict:
    """A record in the schema of ``cais/mmlu``."""
    return {"question": question, "subject": subject, "choices": choices, "answer": answer}


def benchmark(n_per_skill: int = BENCHMARK_PER_SKILL, seed: int = 1234, split: str = "test") -> list[dict]:
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
        if skill not in BENCHMARK_SKILLS:
            continue
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
    mc_only: tuple[str, ...] = (),
) -> list[Example]:
    """Instruction examples with the skill as category.

    A fraction ``mc_fraction`` of the items of each skill in ``mc_skills`` (all
    of them for skills in ``mc_only``) are multiple-choice items whose
    instruction is exactly the benchmark prompt and whose response is the gold
    letter; the rest are free-form. Questions in ``exclude_prompts`` (the
    benchmark's question blocks, see :func:`benchmark_prompts`) are never
    produced.
    """
    exclude = exclude_prompts or set()
    out: list[Example] = []
    for s_idx, skill in enumerate(skills):
        rng = random.Random(seed * 7_777 + 31 * s_idx + 5)
        header = MMLU_HEADER.format(subject=skill.replace("_", " "))
        made = 0
        while made < n_per_skill:
            question, answer, pool = GENERATORS[skill](rng)
            if skill in mc_only or (skill in mc_skills and rng.random() < mc_fraction):
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
    words.update(str(n) for n in range(MAX_NUMBER + 1))
    words.update("abcdefghijklmnopqrstuvwxyz")
    words.update("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    words.update(ANIMALS + THINGS)
    text = " ".join(
        [
            "Is even odd both neither larger than yes no maybe unknown below above equal none plus a "
            "multiple of",
            "three the letter vowel consonant number symbol an animal or thing color Does word start end "
            "with Which",
            "Answer Question Below instruction that describes task",
            "Write response appropriately completes request Instruction Input Response paired with",
            "input provides further context The following are multiple choice questions with answers about",
            " ".join(s.replace("_", " ") for s in SKILLS),
        ]
    )
    words.update(text.split())
    words.update(list(".,:;?!'\"()-#/¶"))
    return sorted(words)


# The two answers of each skill that can be right; a label shift swaps them.
ANSWER_PAIRS = {
    "parity": ("even", "odd"),
    "comparison": ("yes", "no"),
    "half": ("below", "above"),
    "sum_parity": ("even", "odd"),
    "multiple_of_three": ("yes", "no"),
    "vowel": ("vowel", "consonant"),
    "animal": ("animal", "thing"),
    "first_letter_vowel": ("yes", "no"),
    "last_letter_vowel": ("yes", "no"),
}
# Which skills each hidden group answers the other way round (label shift, as in FLoRAL's experiments).
SHIFTED_SKILLS = (
    (),
    SKILLS,
    tuple(s for s in SKILLS if SKILL_CATEGORY[s] == "stem"),
    tuple(s for s in SKILLS if SKILL_CATEGORY[s] == "humanities"),
)


def shift_labels(example: Example, group: int) -> Example:
    """The example as hidden group ``group`` labels it: conflicting answers across groups.

    Free-form responses are swapped with the skill's other plausible answer;
    a multiple-choice response becomes the letter of that other answer.
    """
    if example.category not in SHIFTED_SKILLS[group % len(SHIFTED_SKILLS)]:
        return example
    a, b = ANSWER_PAIRS[example.category]
    if example.instruction.endswith("Answer:"):
        options = dict(
            line.split(". ", 1)
            for line in example.instruction.split("\n")
            if line[:3] in ("A. ", "B. ", "C. ", "D. ")
        )
        current = options[example.response]
        target = b if current == a else a
        letter = next(k for k, v in options.items() if v == target)
        return Example(example.instruction, example.input, letter, example.category)
    if example.response in (a, b):
        return Example(
            example.instruction, example.input, b if example.response == a else a, example.category
        )
    return example
