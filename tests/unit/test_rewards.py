"""Rewards: each builtin on hand-checked cases, weighted combination, and failures as typed errors."""

from __future__ import annotations

import math
import time

import pytest

from producers.rewards import (
    BUILTINS,
    RewardFailed,
    RewardSet,
    extract_math_answer,
    length_penalty,
    math_answer,
    reasoning_gym_reward,
    thinking_format,
)
from producers.sources import reasoning_gym_prompts
from topics.errors import ConfigError
from topics.schemas import Prompt


def P(answer: str = "", task: str = "addmod10", **metadata) -> Prompt:
    return Prompt(prompt_id="p", task=task, text="q", answer=answer, metadata=metadata)


# -- builtins ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("work\n#### 1,234\nbye", "1,234"),
        ("no answer here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("\\boxed{42}", "42", 1.0),
        ("\\boxed{42.0000000001}", "42", 1.0),
        ("#### $1,234", "1234", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{43}", "42", 0.0),
        ("42", "42", 0.0),  # no boxed/#### answer: not credited
        ("\\boxed{X + 1}", "x+1", 0.0),
        ("\\boxed{ Paris }", "paris", 1.0),
        ("#### 7", "some work\n#### 7", 1.0),  # a GSM8K-style reference answer
    ],
)
def test_math_answer(response, answer, expected):
    assert math_answer(P(answer), response) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>add them</think> 7", 1.0),
        ("  <think>a\nb</think>\n\\boxed{7}", 1.0),
        ("<think></think> 7", 0.0),
        ("<think>x</think>", 0.0),
        ("7", 0.0),
        ("<think>x</think> <think>y</think>", 0.0),
    ],
)
def test_thinking_format(response, expected):
    assert thinking_format(P(), response) == expected


def test_exact_and_toy_rewards():
    assert BUILTINS["exact"](P("cba"), " cba\n") == 1.0
    assert BUILTINS["exact"](P("cba"), "cb") == 0.0
    assert BUILTINS["toy"](P("7", task="addmod10"), "7\n") == 1.0
    assert BUILTINS["toy"](P("cba", task="reverse"), "abc") == 0.0


def test_length_penalty_is_bounded_and_uses_the_budget():
    assert length_penalty(P(), "") == 0.0
    assert length_penalty(P(), "x" * 32) == -0.5
    assert length_penalty(P(), "x" * 1000) == -1.0
    assert length_penalty(P(length_budget=10), "x" * 5) == -0.5


def test_reasoning_gym_reward_uses_the_dataset_verifier():
    prompt = next(iter(reasoning_gym_prompts("basic_arithmetic", seed=3, size=5)))
    assert reasoning_gym_reward(prompt, f"<answer>{prompt.answer}</answer>") == 1.0
    assert reasoning_gym_reward(prompt, prompt.answer) == 1.0
    assert reasoning_gym_reward(prompt, "<answer>not a number</answer>") == 0.0
    with pytest.raises(ValueError, match="reasoning-gym"):
        reasoning_gym_reward(P("1"), "1")


# -- combination and failures ------------------------------------------------------------------------------

def always_half(prompt: Prompt, response_text: str) -> float:
    return 0.5


def boom(prompt: Prompt, response_text: str) -> float:
    raise ZeroDivisionError("bad reward")


def slow(prompt: Prompt, response_text: str) -> float:
    time.sleep(0.5)
    return 1.0


def nan_reward(prompt: Prompt, response_text: str) -> float:
    return math.nan


async def test_weighted_combination_with_an_imported_reward():
    rs = RewardSet(["toy", "tests.unit.test_rewards:always_half", "length"], [1.0, 2.0, 0.5], timeout_s=5)
    try:
        scored = await rs.score(P("7"), "7" + "x" * 31)  # toy 0 (first answer is "7xxx..."), length -0.5
        assert scored.components == {"toy": 0.0, "always_half": 0.5, "length": -0.5}
        assert scored.reward == pytest.approx(0.0 + 2.0 * 0.5 + 0.5 * -0.5)
        scored = await rs.score(P("7"), "7")
        assert scored.components["toy"] == 1.0
        assert scored.reward == pytest.approx(1.0 + 1.0 - 0.5 / 64)
    finally:
        rs.close()


@pytest.mark.parametrize(
    ("spec", "reason", "detail"),
    [
        ("tests.unit.test_rewards:boom", "reward_error", "ZeroDivisionError: bad reward"),
        ("tests.unit.test_rewards:nan_reward", "reward_error", "non-finite"),
        ("tests.unit.test_rewards:slow", "reward_timeout", "within 0.1 s"),
    ],
)
async def test_failures_raise_typed_errors(spec, reason, detail):
    rs = RewardSet(["toy", spec], timeout_s=0.1)
    try:
        with pytest.raises(RewardFailed) as info:
            await rs.score(P("7"), "7")
        assert info.value.reason == reason and detail in info.value.detail
        assert info.value.name == spec.rpartition(":")[2] and not info.value.retriable
    finally:
        rs.close()


@pytest.mark.parametrize("spec", ["nope", "no_such_module_xyz:f", "math:no_such_attr", "tests.unit.test_rewards:P_"])
def test_bad_specs_are_config_errors(spec):
    with pytest.raises(ConfigError, match="generator.rewards"):
        RewardSet([spec])


def test_weights_must_match():
    with pytest.raises(ConfigError, match="reward_weights"):
        RewardSet(["toy", "exact"], [1.0])


@pytest.mark.parametrize(
    ("text", "fmt", "correct"),
    [
        ("<answer>85</answer>", 1.0, 1.0),
        ("The sum is <answer> 85 </answer>.", 1.0, 1.0),
        ("<answer>84</answer>", 1.0, 0.0),
        ("<answer>85.0</answer>", 1.0, 1.0),  # numbers compare as numbers
        ("<answer>1</answer> no, <answer>85</answer>", 0.0, 1.0),  # two tags: not the format; the last one counts
        ("<answer></answer>", 0.0, 0.0),
        ("85", 0.0, 0.0),
        ("<answer>85", 0.0, 0.0),
    ],
)
def test_answer_tag_rewards(text, fmt, correct):
    assert BUILTINS["answer_format"](P("85"), text) == fmt
    assert BUILTINS["answer"](P("85"), text) == correct


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 5 = 8", 1.0),
        ("The answer is 8.", 1.0),
        ("8 or maybe 9", 0.0),  # the last number counts
        ("<answer>8</answer> and 9 more", 1.0),  # a tag wins over later numbers
        ("<answer>eight</answer> 8", 0.0),
        ("1,008", 0.0),
        ("no number", 0.0),
    ],
)
def test_last_number_reward(text, expected):
    assert BUILTINS["last_number"](P("8"), text) == expected


async def test_text_builtins_score_in_the_event_loop_and_fail_per_sample():
    """``INLINE`` builtins need no thread: they score with the pool shut down; a builtin that raises fails its own
    sample with ``reward_error`` as it would in a thread, and the other samples keep their scores."""
    from producers.rewards import BUILTINS, INLINE

    assert BUILTINS["reasoning_gym"] not in INLINE and BUILTINS["toy"] in INLINE
    rs = RewardSet(["toy", "exact", "length"], timeout_s=5)
    rs.close()  # no thread left to run a reward
    results = await rs.score_group(P("7"), ["7", "3"])
    assert [r.components["toy"] for r in results] == [1.0, 0.0]
    assert [r.components["exact"] for r in results] == [1.0, 0.0]
    bad = Prompt(prompt_id="p", task="no_such_task", text="x", answer="1")
    results = await rs.score_group(bad, ["1", "2"])
    assert all(isinstance(r, RewardFailed) and r.reason == "reward_error" and r.name == "toy" for r in results)
