"""Rewards for the tests, importable by generator processes (``tests/`` on their ``PYTHONPATH``)."""

from __future__ import annotations


def addmod10_batch(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """A reward in TRL's batch shape: 1.0 where the completion starts with the answer column's digit."""
    assert len(prompts) == len(completions) == len(answer)
    assert all(len(v) == len(completions) for v in columns.values())
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]


def flaky_judge(prompt, response_text: str) -> float:
    """A served reward that misbehaves on purpose: ``raise`` raises, ``nan`` is not a number, ``slow`` takes 3 s;
    any other response scores its length."""
    import time

    if response_text == "raise":
        raise ValueError("the judge cannot read this")
    if response_text == "nan":
        return float("nan")
    if response_text == "slow":
        time.sleep(3)
    return float(len(response_text))
