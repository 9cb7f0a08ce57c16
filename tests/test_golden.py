"""What a run computes does not change under a refactoring: every strategy, algorithm and DP mode gives the
global adapter of the golden fixture (``tests/golden.py``) within float tolerance."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.golden import CASES, FIXTURE, random_base, run_case

# float rounding differs between CPUs, thread counts and summation orders; 2 rounds of 3 steps on a small
# random base keep that far below this
RTOL = 2e-4


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIXTURE))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return random_base(tmp_path_factory.mktemp("golden-base"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_global_adapter_is_the_golden_one(case, golden, base, tmp_path):
    got = run_case(case, base, tmp_path / case)
    want = {k: v for k, v in golden.items() if k.startswith(f"{case}/")}
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        distance = float((got[key] - w).norm())
        assert distance <= RTOL * max(float(w.norm()), 1e-12), (key, distance, float(w.norm()))


def test_the_golden_cases_cover_every_strategy_and_algorithm():
    from fedllm.aggregation import STRATEGIES
    from fedllm.client import ALGORITHMS

    names = " ".join(" ".join(v) for v in CASES.values())
    assert all(f"aggregation.name={s}" in names for s in STRATEGIES)
    assert all(f"client.algorithm={a}" in names for a in ALGORITHMS if a != "sft")
    assert "privacy.mode=central" in names and "privacy.mode=local" in names
