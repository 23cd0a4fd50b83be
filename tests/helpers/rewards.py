"""Rewards for the tests, importable by generator processes (``tests/`` on their ``PYTHONPATH``)."""

from __future__ import annotations


def addmod10_batch(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """A reward in TRL's batch shape: 1.0 where the completion starts with the answer column's digit."""
    assert len(prompts) == len(completions) == len(answer)
    assert all(len(v) == len(completions) for v in columns.values())
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]
