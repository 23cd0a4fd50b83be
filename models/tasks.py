"""Toy tasks the tiny model can learn in a few hundred GRPO steps (tests, the demo, the learning check).

Each task makes a prompt from a ``random.Random`` and scores a response against the answer:

* ``addmod10``: ``"a+b="`` with digits a, b -> ``str((a + b) % 10)``.
* ``reverse``: ``"reverse abc:"`` -> ``"cba"`` (three lower-case letters).

``score(response_text, answer)`` is 1.0 when the response, stripped of surrounding whitespace and cut at the
first end-of-answer character (newline, space or ``.``), equals the answer, else 0.0 (a plain 0/1 reward: the
learning check in FACTS.md reaches mean reward 0.8 with it).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

_STOP_CHARS = ("\n", " ", ".")


def first_answer(response_text: str) -> str:
    """The response up to the first stop character, without surrounding whitespace."""
    text = response_text.strip()
    for ch in _STOP_CHARS:
        idx = text.find(ch)
        if idx >= 0:
            text = text[:idx]
    return text


def exact_score(response_text: str, answer: str) -> float:
    return 1.0 if first_answer(response_text) == answer.strip() else 0.0


@dataclass(frozen=True, slots=True)
class ToyTask:
    """A named toy task: ``make_prompt(rng) -> (text, answer)`` and ``score(response_text, answer) -> [0, 1]``."""

    name: str
    make_prompt: Callable[[random.Random], tuple[str, str]]
    score: Callable[[str, str], float]
    max_answer_tokens: int  # enough response tokens to answer


def _addmod10_prompt(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str((a + b) % 10)


def _reverse_prompt(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
    return f"reverse {word}:", word[::-1]


TASKS: dict[str, ToyTask] = {
    "addmod10": ToyTask("addmod10", _addmod10_prompt, exact_score, max_answer_tokens=2),
    "reverse": ToyTask("reverse", _reverse_prompt, exact_score, max_answer_tokens=4),
}


def get_task(name: str) -> ToyTask:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown toy task {name!r}; known: {sorted(TASKS)}") from None
