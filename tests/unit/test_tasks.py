"""Toy tasks: prompts are well-formed and deterministic; the reward is 1 exactly for the right answer."""

from __future__ import annotations

import random

import pytest

from producers.tasks import TASKS, first_answer, get_task
from producers.tiny_model import ALPHABET


def test_registry_has_the_agreed_tasks():
    assert {"addmod10", "reverse"} <= set(TASKS)
    with pytest.raises(KeyError, match="unknown toy task"):
        get_task("nope")


def test_addmod10_prompts_and_answers():
    rng = random.Random(0)
    for _ in range(200):
        text, answer = TASKS["addmod10"].make_prompt(rng)
        a, b = int(text[0]), int(text[2])
        assert text == f"{a}+{b}=" and answer == str((a + b) % 10)


def test_reverse_prompts_and_answers():
    rng = random.Random(0)
    for _ in range(200):
        text, answer = TASKS["reverse"].make_prompt(rng)
        word = text.removeprefix("reverse ").removesuffix(":")
        assert len(word) == 3 and word.isalpha() and answer == word[::-1]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_prompts_are_deterministic_and_in_the_tiny_alphabet(name):
    task = TASKS[name]
    a = [task.make_prompt(random.Random(7)) for _ in range(5)]
    b = [task.make_prompt(random.Random(7)) for _ in range(5)]
    assert a == b
    rng = random.Random(1)
    for _ in range(50):
        text, answer = task.make_prompt(rng)
        assert set(text + answer) <= set(ALPHABET)


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("7", "7", 1.0),
        (" 7\n", "7", 1.0),
        ("7 because", "7", 1.0),
        ("7.", "7", 1.0),
        ("8", "7", 0.0),
        ("77", "7", 0.0),
        ("", "7", 0.0),
        ("cba", "cba", 1.0),
        ("cb", "cba", 0.0),
        ("cbaa", "cba", 0.0),
    ],
)
def test_score(response, answer, expected):
    for task in TASKS.values():
        score = task.score(response, answer)
        assert score == expected and 0.0 <= score <= 1.0


def test_first_answer_cuts_at_the_first_stop_character():
    assert first_answer("  ab cd\nef") == "ab"
    assert first_answer("x.y") == "x"
