"""The shipped environments: blackjack (OpenSpiel's rules, hit/stand, +1/0/-1) and calculator (a safe parser as
the tool, reward 1 for the right answer), as the replicas serve them."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from envs.api import ActionRejected
from envs.builtin_blackjack import (
    BlackjackAction,
    BlackjackEnv,
    basic_policy,
    basic_strategy,
    hand_total,
    mean_reward,
    random_policy,
)
from envs.builtin_calculator import CalcError, CalculatorAction, CalculatorEnv, evaluate, format_value, make_problem
from envs.serving import env_types, resolve_env, text_field


@pytest.mark.parametrize("name", ["blackjack", "calculator"])
def test_builtin_names_resolve_to_servable_environments(name: str):
    cls = resolve_env(name)
    action, observation = env_types(cls)
    assert text_field(action, required=True) == "text"
    assert text_field(observation, skip=("done", "reward", "metadata"), required=False) == "text"
    assert cls.SUPPORTS_CONCURRENT_SESSIONS


def test_blackjack_hand_rules():
    assert hand_total([1, 10]) == (21, True) and hand_total([1, 5, 10]) == (16, False)
    assert basic_strategy(16, False, 10) == "hit" and basic_strategy(16, False, 6) == "stand"
    assert basic_strategy(18, True, 9) == "hit" and basic_strategy(12, False, 4) == "stand"


def test_blackjack_episode_text_actions_and_reward():
    env = BlackjackEnv()
    obs = env.reset(seed=3)
    assert obs.text.startswith("you ") and obs.text.endswith(": ") and not obs.done
    with pytest.raises(ActionRejected):
        env.step(BlackjackAction(text="double down"))
    while not obs.done:
        obs = env.step(BlackjackAction(text=" HIT\n"))
    assert obs.reward == -1.0 and obs.text.endswith("lose")  # hitting forever busts
    with pytest.raises(ActionRejected):
        env.step(BlackjackAction(text="stand"))


def test_blackjack_same_seed_same_deck():
    a, b = BlackjackEnv(), BlackjackEnv()
    assert a.reset(seed=11).text == b.reset(seed=11).text
    assert a.step(BlackjackAction(text="hit")).text == b.step(BlackjackAction(text="hit")).text


def test_basic_strategy_beats_the_random_policy():
    rand, basic = mean_reward(random_policy, 3000, seed=1), mean_reward(basic_policy, 3000, seed=1)
    assert -0.5 < rand < -0.3 and -0.12 < basic < 0.02  # README: -0.39 and -0.05 over 100,000 deals


@pytest.mark.parametrize("expr, value", [("47*38", 1786), ("1+2*3", 7), ("(1+2)*3", 9), ("-4--2", -2),
                                         ("7/2", Fraction(7, 2)), (" 12 - 3 ", 9), ("2.5*2", 5)])
def test_the_tool_evaluates_arithmetic(expr: str, value: Fraction):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["", "1/0", "2**3", "__import__('os')", "1+", "(" * 40 + "1" + ")" * 40,
                                  "9" * 300, "99999999*99999999", "1e5", "abs(1)", "--" * 20 + "1"])
def test_the_tool_refuses_what_it_cannot_evaluate(expr: str):
    with pytest.raises(CalcError):
        evaluate(expr)


def test_format_value():
    assert format_value(Fraction(1786)) == "1786" and format_value(Fraction(7, 2)) == "3.5"
    assert format_value(Fraction(1, 3)) == "0.333333"


def test_calculator_episode_with_a_tool_call():
    env = CalculatorEnv()
    obs = env.reset(seed=5)
    text, answer = make_problem(random.Random(5))
    assert obs.text == text and not obs.done
    numbers = [int(w) for w in text.replace(".", " ").split() if w.isdigit()]
    op = "*" if "boxes" in text else "+" if "more" in text else "-"
    obs = env.step(CalculatorAction(text=f"<calc>{numbers[0]}{op}{numbers[1]}</calc>"))
    assert obs.text == f"<result>{answer}</result>" and obs.tool_call and not obs.done and obs.reward == 0.0
    assert env.step(CalculatorAction(text="<calc>1/0</calc>")).text == "<result>error</result>"
    obs = env.step(CalculatorAction(text=f"{answer}"))
    assert obs.done and obs.reward == 1.0


def test_calculator_wrong_or_garbled_answer_scores_zero():
    env = CalculatorEnv()
    env.reset(seed=1)
    obs = env.step(CalculatorAction(text="no idea \u2603"))
    assert obs.done and obs.reward == 0.0


@pytest.mark.parametrize("task", ["blackjack_moves", "calculator_moves"])
def test_warm_start_tasks_speak_the_environments_words(task: str):
    """The warm-start contexts look like what the multi-turn loop builds from the environment's observations."""
    from models.tasks import get_task

    rng = random.Random(0)
    for _ in range(2000):
        text, answer = get_task(task).make_prompt(rng)
        if task == "blackjack_moves":
            assert answer in ("hit", "stand") and text.endswith(": ") and text.startswith("you ")
        else:
            assert text.split("<calc>")[0].endswith("? ") and answer
            if "<result>" in text:
                assert answer == text.rsplit("<result>", 1)[1].removesuffix("</result>")
