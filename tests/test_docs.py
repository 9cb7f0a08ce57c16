"""The README stays a README, and every link and path the docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"(?<![\w/.-])((?:configs|scripts)/[\w./-]+\.(?:yaml|py|sh))")


def test_readme_is_short_and_the_moved_material_is_in_docs():
    assert len((ROOT / "README.md").read_bytes()) <= 16_000
    for page in (
        "strategies",
        "clients",
        "floral",
        "privacy",
        "trust",
        "deployment",
        "scale",
        "reproductions",
        "benchmarks",
        "testbed",
    ):
        assert (ROOT / "docs" / f"{page}.md").exists(), page


def test_every_relative_link_resolves():
    missing = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_every_config_and_script_named_exists():
    missing = []
    for page in PAGES:
        for path in PATH.findall(page.read_text()):
            if not (ROOT / path).exists() and "NAME" not in path:
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


def test_the_docs_error_examples_are_what_the_tool_prints(capsys):
    """Each `fedllm run KEY=VALUE` example error in the README and docs/usage.md, as the tool prints it."""
    import pytest

    from fedllm.cli import main

    shown = {
        line.strip()
        for page in (ROOT / "README.md", ROOT / "docs" / "usage.md")
        for line in page.read_text().splitlines()
        if line.strip().startswith("fedllm: error:")
    }
    for override in ("aggregation.name=fedsgd", "federaton.rounds=3"):
        with pytest.raises(SystemExit) as stop:
            main(["run", override])
        assert stop.value.code == 2
        printed = capsys.readouterr().err.strip().splitlines()[-1]
        assert printed in shown, printed


def test_what_leaves_a_site_is_what_the_server_parses():
    """The deployment page's list of reply fields is the server's own (fedllm/flower/replies.py)."""
    from fedllm.flower.replies import EVALUATION_KEYS, INFO_KEYS, UPDATE_KEYS

    text = (ROOT / "docs" / "deployment.md").read_text().split("## What leaves a site", 1)[1]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2] for line in text.splitlines() if line.startswith("| ")
    }

    def fields(row: str) -> set[str]:
        return set(re.findall(r"`([\w-]+)`", row.split("(besides")[0]))

    assert fields(rows["handshake"]) == set(INFO_KEYS)
    assert fields(rows["update"]) == set(UPDATE_KEYS)
    assert fields(rows["evaluation"]) == set(EVALUATION_KEYS)
