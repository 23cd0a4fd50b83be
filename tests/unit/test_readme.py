"""The README's contract: the two commands first, and generated sections (file tree, topic table) up to date."""

from __future__ import annotations

from pathlib import Path

from streamforge.readme import render
from topics.names import CATALOG, Names

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_two_commands_come_first() -> None:
    first_block = README.split("```", 2)[1]
    assert first_block.split()[:2] == ["make", "demo"]
    assert "make test" in first_block


def test_generated_sections_are_up_to_date() -> None:
    assert render(README, ROOT) == README, "README is stale: run `python -m streamforge.readme`"


def test_every_topic_and_subject_is_in_the_table() -> None:
    for channel in CATALOG:
        name = "{prefix}_policy" if channel.kind == "kv" else "{prefix}." + channel.suffix
        assert f"`{name}`" in README
    assert Names("sf").resolve(CATALOG[0]) == "sf.prompts"


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
