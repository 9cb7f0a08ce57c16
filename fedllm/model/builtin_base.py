"""The built-in offline base model: a word-level tokenizer and a tiny Llama.

A LoRA on a randomly initialized base learns nothing (its frozen random
lm_head caps the logits), so the built-in base is pretrained here, fully and
deterministically, on the free-form items of every built-in skill and the
multiple-choice items of the format skills only. The federated LoRA stage then
has something real to teach: answering the benchmark skills in that format.

Pretraining is plain causal language modelling on every token (prompt
included), as a base model is trained, not response-only SFT: the extra signal
(predicting option lists, copying words) is what makes the multiple-choice
circuit form early and for every seed, where response-only training left it to
chance whether it formed within the step budget. Layer widths are multiples of
64, as in real LLMs, so every quantization kernel can take them (bitsandbytes'
AVX512-BF16 4-bit path needs out_features % 32 == 0).

The result is saved with ``save_pretrained`` into a cache folder (atomically:
built in a temporary folder, then renamed) and every run loads it back through
the same ``from_pretrained`` path as a Hub checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from data_prep import builtin_skills
from data_prep.prompts import TokenizedExample, collate, tokenize_examples

log = logging.getLogger(__name__)

BUILTIN_VERSION = 2
SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ARCH = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 8}


# the built-in bases: the default one ("builtin") and the testbed's ("builtin-testbed", data_prep/testbed.py)
SUITES = ("builtin", "builtin-testbed")


def _vocabulary(suite: str) -> list[str]:
    if suite == "builtin-testbed":
        from data_prep import testbed

        return testbed.vocabulary()
    return builtin_skills.vocabulary()


def build_tokenizer(suite: str = "builtin"):
    """A word-level tokenizer over the built-in vocabulary (``suite``'s: the testbed's is a superset).

    Each number, option and answer letter is one token, which is what lets a
    200k-parameter model learn the multiple-choice format (a character-level
    tokenizer was measured to be far too slow to learn it). Newlines become the
    token "¶" so prompts keep their structure.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIALS.values()) + _vocabulary(suite))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS["unk_token"]))
    tok.normalizer = normalizers.Replace(Regex("\n"), " ¶ ")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    bos = SPECIALS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=128, **SPECIALS)


def build_model(tokenizer, seed: int):
    """A tiny randomly initialized Llama sized for 2 CPU cores."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=ARCH["num_attention_heads"],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **ARCH,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# TinyLlama-1.1B's architecture: real-size shapes offline (memory and speed of a real run, no download)
TINYLLAMA_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def tinyllama_shaped(layers: int = 22, seed: int = 0):
    """A Llama of TinyLlama-1.1B's shape with ``layers`` decoder layers and random weights (float32).

    For sizing a real run on any machine without a download: memory, step
    times and server cost depend on the shapes, not on the weights' values.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINYLLAMA_SHAPE, "num_hidden_layers": layers})).eval()


def default_cache_dir() -> Path:
    """``$FEDLLM_CACHE`` or ``~/.cache/fedllm``."""
    return Path(os.environ.get("FEDLLM_CACHE", Path.home() / ".cache" / "fedllm"))


@functools.cache
def _data_digest(seed: int, suite: str = "builtin") -> str:
    data = [*pretraining_examples(seed, suite=suite), _vocabulary(suite)]
    return hashlib.sha256(repr(data).encode()).hexdigest()


def builtin_base_path(
    pretrain_steps: int, seed: int = 0, cache_dir: Path | None = None, suite: str = "builtin"
) -> Path:
    """Where the pretrained built-in base with these settings is cached.

    The key covers the pretraining data itself (and the vocabulary), so a
    change to the built-in skills or benchmark can never reuse a stale base.
    """
    key = json.dumps(
        {
            "v": BUILTIN_VERSION,
            "steps": pretrain_steps,
            "seed": seed,
            "arch": ARCH,
            "data": _data_digest(seed, suite),
            **({"suite": suite} if suite != "builtin" else {}),  # the default base keeps its cache key
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    stem = "builtin-base" if suite == "builtin" else "builtin-testbed-base"
    return (cache_dir or default_cache_dir()) / f"{stem}-{digest}"


def ensure_builtin_base(
    pretrain_steps: int = 1000, seed: int = 0, cache_dir: Path | None = None, suite: str = "builtin"
) -> Path:
    """Return the cached built-in base (``suite``: 'builtin' or 'builtin-testbed'), pretraining and saving it
    first if needed."""
    if suite not in SUITES:
        raise ValueError(f"model.name = {suite!r}: the built-in bases are {', '.join(SUITES)}")
    path = builtin_base_path(pretrain_steps, seed, cache_dir, suite)
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the built-in base model (%d pretraining steps, cached at %s)", pretrain_steps, path)
    tokenizer = build_tokenizer(suite)
    model = pretrain(build_model(tokenizer, seed), tokenizer, pretrain_steps, seed, suite=suite)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "fedllm_builtin.json").write_text(
            json.dumps({"pretrain_steps": pretrain_steps, "seed": seed, "suite": suite})
        )
        os.replace(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():  # a concurrent builder may have won the rename
            raise
    return path


def pretraining_examples(seed: int, n_per_skill: int = 1500, suite: str = "builtin") -> list:
    """Free-form items of every skill, multiple-choice items of the format skills (and "match") only; for the
    testbed, its primitives only (see data_prep/testbed.py)."""
    if suite == "builtin-testbed":
        from data_prep import testbed

        return testbed.pretraining_examples(seed)
    return builtin_skills.instruction_examples(
        n_per_skill=n_per_skill,
        seed=10_000 + seed,
        skills=(*builtin_skills.SKILLS, "match"),
        mc_skills=builtin_skills.PRETRAIN_MC_SKILLS,
        mc_only=("match",),
        exclude_prompts=builtin_skills.benchmark_prompts(builtin_skills.benchmark()),
    )


def pretrain(
    model, tokenizer, steps: int, seed: int, batch_size: int = 32, lr: float = 3e-3, suite: str = "builtin"
):
    """Full-parameter causal-LM pretraining (every token) on the built-in skills (see module docstring)."""
    examples = pretraining_examples(seed, suite=suite)
    data = [
        TokenizedExample(t.input_ids, list(t.input_ids))
        for t in tokenize_examples(examples, tokenizer, "plain", max_seq_len=96)
    ]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    order: list[int] = []
    for step in range(steps):
        if len(order) < batch_size:
            order = list(range(len(data)))
            rng.shuffle(order)
        batch = collate([data[order.pop()] for _ in range(batch_size)], tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 200 == 0 or step == steps - 1:
            log.info("pretrain step %d/%d loss %.4f", step + 1, steps, loss.item())
    model.eval()
    return model
