"""Does a fine-tune keep the base's own chat? 20 general prompts, answered before and after.

Fine-tuning an instruct model on a narrow task mix can break what it did well: after three rounds on
Natural Instructions a merged SmolLM2 answered "What is the capital of France?" with "La femme, la
femme. Paris, ..." where the base says "The capital of France is Paris.". Task scores do not see this.
So each evaluation answers the same general prompts greedily and scores each answer by Rouge-L against
the base's own answer to it (``general_agreement``: 100 where every answer is the base's, lower as the
chat drifts). The base's answers are the reference because no other is at hand offline and because the
question is whether the fine-tune *changed* them; an answer better than the base's also scores below 100,
so read the answers (``generations.jsonl``, task ``general``) before calling a drop a loss.

The prompts: everyday questions, short instructions, formats (a list, a haiku, a translation, a
sentence), arithmetic and facts, none from Natural Instructions' tasks. ``eval.general_prompts`` names
this set ('builtin') or a file in ``fedllm generate --prompts-file``'s format. Imports nothing from fedllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from data_prep.schema import Example

GENERAL_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "What is 17 plus 25?",
    "Name three primary colors.",
    "Write a short thank-you note to a friend who helped me move.",
    "Who wrote the play Romeo and Juliet?",
    "List the days of the week.",
    "What is the boiling point of water at sea level in Celsius?",
    "Suggest a name for a small coffee shop.",
    "Summarize the story of Cinderella in two sentences.",
    "How many legs does a spider have?",
    "What should I pack for a weekend camping trip?",
    "Describe the color blue to someone who cannot see.",
    "Convert 5 kilometers to miles.",
    "Write a sentence using the word 'serendipity'.",
    "Why is the sky blue?",
    "What is the largest planet in our solar system?",
)


@dataclass
class GeneralCheck:
    """The general prompts, how they are answered, and the base's answers once known (None before the
    evaluation before round 1 gives them)."""

    examples: list[Example]
    template: str
    max_new_tokens: int
    max_prompt_tokens: int
    reference: list[str] | None = field(default=None)
