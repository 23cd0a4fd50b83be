"""Toy tasks: prompts are well-formed and deterministic; the reward is 1 exactly for the right answer."""

from __future__ import annotations

import random

import pytest

from models.tasks import TASKS, first_answer, get_task, tagged_score
from models.tiny_model import ALPHABET

TINY = ("addmod10", "reverse")  # the tiny model's tasks; add1 and add2 are for instruct models


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


@pytest.mark.parametrize("name", TINY)
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
    for task in (TASKS[n] for n in TINY):
        score = task.score(response, answer)
        assert score == expected and 0.0 <= score <= 1.0


@pytest.mark.parametrize("name", ["add1", "add2"])
def test_instruct_sum_tasks_ask_for_a_tagged_answer(name):
    rng = random.Random(3)
    lo, hi = (1, 9) if name == "add1" else (10, 99)
    for _ in range(100):
        text, answer = TASKS[name].make_prompt(rng)
        a, b = (int(x) for x in text.removeprefix("What is ").split("?")[0].split(" + "))
        assert lo <= a <= hi and lo <= b <= hi and answer == str(a + b) and "<answer></answer>" in text
    assert TASKS[name].make_prompt(random.Random(5)) == TASKS[name].make_prompt(random.Random(5))
    assert tagged_score("so <answer> 12 </answer>", "12") == 1.0
    assert tagged_score("<answer>1</answer> or <answer>12</answer>", "12") == 1.0  # the last tag counts
    assert tagged_score("12", "12") == 0.0 and tagged_score("<answer>13</answer>", "12") == 0.0


def test_first_answer_cuts_at_the_first_stop_character():
    assert first_answer("  ab cd\nef") == "ab"
    assert first_answer("x.y") == "x"


# -- local prompt sources (producers/sources.py) -----------------------------------------------------------

def test_toy_source_is_deterministic_with_stable_ids():
    from producers.sources import open_source

    a = list(open_source("toy:addmod10", seed=4, num_prompts=5))
    b = list(open_source("toy:addmod10", seed=4, num_prompts=5))
    assert [p.prompt_id for p in a] == [f"addmod10-4-{i}" for i in range(5)]
    assert [(p.text, p.answer) for p in a] == [(p.text, p.answer) for p in b]
    assert all(TASKS["addmod10"].score(p.answer, p.answer) == 1.0 for p in a)


def test_jsonl_source_cycles_with_new_ids(tmp_path):
    from producers.sources import open_source

    path = tmp_path / "math.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2", "id": "x"}\n\n{"question": "2+2=", "answer": 4, '
                    '"task": "add", "metadata": {"level": 1}}\n')
    prompts = list(open_source(f"jsonl:{path}", num_prompts=5))
    assert [p.prompt_id for p in prompts] == ["x", "math-1", "x@e1", "math-1@e1", "x@e2"]
    assert prompts[1].text == "2+2=" and prompts[1].answer == "4" and prompts[1].task == "add"
    assert prompts[3].metadata == {"level": 1}


def test_bad_sources_are_config_errors(tmp_path):
    from producers.sources import open_source
    from topics.errors import ConfigError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": "no prompt"}\n')
    with pytest.raises(ConfigError, match="prompt"):
        list(open_source(f"jsonl:{bad}"))
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(f"jsonl:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(ConfigError, match="reasoning-gym"):
        open_source("reasoning_gym:no_such_dataset_xyz", num_prompts=2)


def test_reasoning_gym_source_round_trips_the_codec():
    from producers.rewards import reasoning_gym_reward
    from producers.sources import open_source
    from topics import codec
    from topics.schemas import Prompt

    prompts = list(open_source("reasoning_gym:spell_backward", seed=1, num_prompts=3))
    assert len({p.prompt_id for p in prompts}) == 3
    for p in prompts:
        back = codec.decode(codec.encode(p), expect=Prompt)  # the entry survives the wire
        assert back.metadata["dataset"] == "spell_backward" and back.text
        assert reasoning_gym_reward(back, f"<answer>{back.answer}</answer>") == 1.0
