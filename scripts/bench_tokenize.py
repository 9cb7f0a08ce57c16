"""Tokenizing an instruction set of real size: one at a time, batched, and read back from the cache.

Writes ``--records`` Dolly-format records (short instruction/context/response
texts drawn from the built-in vocabulary, seeded) to a JSONL file, loads them
with fedllm's own loader, and times with the built-in base's fast tokenizer:

- the one-example-at-a-time path that earlier versions ran on every start
  (on ``--sample`` records, scaled to the whole set);
- the first start: batched tokenization written to the on-disk cache
  (``data_prep/tokenized.py``, ``datasets.Dataset.map``);
- a second start: the same call, now reading the cached table.

    python scripts/bench_tokenize.py [--records 200000] [--sample 20000]

Numbers are from this machine and run; the ratios are what carries. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def write_records(path: Path, n: int, seed: int = 0) -> None:
    from data_prep.builtin_skills import vocabulary

    words = vocabulary()
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            rec = {
                "instruction": text(4, 20),
                "context": text(0, 30) if i % 3 == 0 else "",
                "response": text(3, 60),
                "category": f"cat{i % 8}",
            }
            f.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--sample", type=int, default=20_000)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from data_prep.loaders import load_examples
    from data_prep.prompts import tokenize_example
    from data_prep.tokenized import tokenize_cached
    from fedllm.logs import setup_logging
    from fedllm.model.builtin_base import ensure_builtin_base

    setup_logging("WARNING")
    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin_base())
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "dolly.jsonl"
        write_records(data, args.records)
        t = time.perf_counter()
        examples = load_examples(str(data), "dolly", 0, 0, 0)
        load_s = time.perf_counter() - t
        sample = examples[: args.sample]
        t = time.perf_counter()
        for e in sample:
            tokenize_example(e, tokenizer, "alpaca", 512)
        one_s = (time.perf_counter() - t) * len(examples) / len(sample)
        cache = Path(tmp) / "cache"
        t = time.perf_counter()
        rows, _ = tokenize_cached(examples, tokenizer, "alpaca", 512, cache)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        again, _ = tokenize_cached(examples, tokenizer, "alpaca", 512, cache)
        second_s = time.perf_counter() - t
        assert len(again) == len(rows)
    result = {
        "records": len(examples),
        "load_s": load_s,
        "one_at_a_time_s_scaled": one_s,
        "first_start_s": first_s,
        "second_start_s": second_s,
        "speedup_first_vs_one_at_a_time": one_s / first_s,
        "speedup_second_vs_one_at_a_time": one_s / second_s,
    }
    print(
        f"{len(examples)} records: one at a time {one_s:.1f} s (scaled from {len(sample)}), batched and "
        f"cached {first_s:.1f} s, second start {second_s:.2f} s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
