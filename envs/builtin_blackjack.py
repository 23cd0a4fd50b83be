"""The built-in ``blackjack`` environment: OpenSpiel's blackjack as an OpenEnv ``Environment`` (``env.impl:
blackjack``).

One player against the dealer (OpenSpiel's ``blackjack``: one 52-card deck, the dealer draws to 17, no
doubling or splitting). ``reset(seed)`` deals from a ``random.Random(seed)`` (every chance outcome drawn from it
in order, so episodes reset with one seed meet the same deck whatever they play: a GRPO group compares
decisions, not luck). Each observation is the hand as text, e.g. ``"you 15, dealer 9: "`` (``s`` before the
total marks a soft hand: an ace counted 11); the action is ``hit`` or ``stand`` (case and surrounding
whitespace ignored; anything else is rejected: ``ActionRejected``). The episode ends when the player stands or
busts; the last observation says ``win``, ``push`` or ``lose`` with reward +1, 0 or -1 (0 on every other turn).

``hand_total``/``basic_strategy``/``play`` are the rules as plain functions: ``mean_reward(policy, episodes)``
measures a policy on the environment itself (the README's figures for the random policy and basic strategy
come from it).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from envs.api import ActionRejected

ACTIONS = ("hit", "stand")  # OpenSpiel's action ids 0 and 1
_RANKS = {"A": 1, "T": 10, "J": 10, "Q": 10, "K": 10, **{str(n): n for n in range(2, 10)}}


class BlackjackAction(Action):
    text: str  # "hit" or "stand"


class BlackjackObservation(Observation):
    text: str = ""  # the hand as the model reads it
    player_total: int = 0
    soft: bool = False
    dealer_card: int = 0  # the dealer's visible card (1 = ace)


def hand_total(ranks: list[int]) -> tuple[int, bool]:
    """``(total, soft)`` of a hand of ranks (ace = 1, faces = 10): an ace counts 11 when that does not bust."""
    total = sum(ranks)
    if 1 in ranks and total + 10 <= 21:
        return total + 10, True
    return total, False


def basic_strategy(total: int, soft: bool, dealer: int) -> str:
    """Hit or stand by the usual basic strategy (no doubling or splitting); ``dealer`` 1 is an ace."""
    if soft:
        return "stand" if total >= 19 or (total == 18 and dealer in (2, 3, 4, 5, 6, 7, 8)) else "hit"
    if total >= 17:
        return "stand"
    if total >= 13:
        return "stand" if 2 <= dealer <= 6 else "hit"
    if total == 12:
        return "stand" if 4 <= dealer <= 6 else "hit"
    return "hit"


def _ranks(cards: str) -> list[int]:
    return [_RANKS[c[1]] for c in cards.split() if len(c) == 2 and c[1] in _RANKS]


class BlackjackEnv(Environment[BlackjackAction, BlackjackObservation, State]):
    """See the module docstring."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        import pyspiel

        self._game = pyspiel.load_game("blackjack")
        self._state: Any = None
        self._rng = random.Random(0)
        self._episode_id: str | None = None
        self._steps = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> BlackjackObservation:
        self._rng = random.Random(seed)
        self._episode_id, self._steps = episode_id, 0
        self._state = self._game.new_initial_state()
        self._deal()
        return self._observe()

    def step(self, action: BlackjackAction, timeout_s: float | None = None, **kwargs: Any) -> BlackjackObservation:
        if self._state is None or self._state.is_terminal():
            raise ActionRejected("the hand is over: reset first")
        move = action.text.strip().lower()
        if move not in ACTIONS:
            raise ActionRejected(f"say hit or stand, not {action.text[:20]!r}")
        self._steps += 1
        self._state.apply_action(ACTIONS.index(move))
        self._deal()
        return self._observe()

    @property
    def state(self) -> State:
        return State(episode_id=self._episode_id, step_count=self._steps)

    def _deal(self) -> None:
        """Play the chance nodes (cards, the dealer's turn) from the episode's own random stream."""
        s = self._state
        while s.is_chance_node():
            outcomes = s.chance_outcomes()
            s.apply_action(self._rng.choices([a for a, _ in outcomes], [p for _, p in outcomes])[0])

    def _observe(self) -> BlackjackObservation:
        lines = dict(line.split(": ", 1) for line in self._state.observation_string(0).splitlines() if ": " in line)
        player = _ranks(lines.get("Player 0", "").removeprefix("Cards: "))
        dealer_seen = _ranks(lines.get("Dealer", "").removeprefix("Cards: "))
        total, soft = hand_total(player)
        up = dealer_seen[-1] if dealer_seen else 0
        hand = f"you {'s' if soft else ''}{total}, dealer {'a' if up == 1 else up}"
        if not self._state.is_terminal():
            return BlackjackObservation(text=f"{hand}: ", player_total=total, soft=soft, dealer_card=up,
                                        reward=0.0, done=False)
        reward = float(self._state.returns()[0])
        outcome = {1.0: "win", 0.0: "push", -1.0: "lose"}.get(reward, str(reward))
        return BlackjackObservation(text=f"{hand}: {outcome}", player_total=total, soft=soft, dealer_card=up,
                                    reward=reward, done=True)


def play(env: BlackjackEnv, policy: Callable[[BlackjackObservation, random.Random], str], *, seed: int,
         rng: random.Random) -> float:
    """One episode of ``policy(observation, rng) -> "hit" | "stand"``; its reward."""
    obs = env.reset(seed=seed)
    while not obs.done:
        obs = env.step(BlackjackAction(text=policy(obs, rng)))
    return float(obs.reward or 0.0)


def random_policy(obs: BlackjackObservation, rng: random.Random) -> str:
    return rng.choice(ACTIONS)


def basic_policy(obs: BlackjackObservation, rng: random.Random) -> str:
    return basic_strategy(obs.player_total, obs.soft, obs.dealer_card)


def mean_reward(policy: Callable[[BlackjackObservation, random.Random], str], episodes: int = 20000, *,
                seed: int = 0) -> float:
    """The policy's mean reward over ``episodes`` deals (seeds ``seed..seed+episodes-1``)."""
    env, rng = BlackjackEnv(), random.Random(seed)
    return sum(play(env, policy, seed=seed + i, rng=rng) for i in range(episodes)) / episodes


if __name__ == "__main__":  # the README's figures: python -m envs.builtin_blackjack
    for name, pol in (("random", random_policy), ("basic strategy", basic_policy)):
        print(f"{name}: {mean_reward(pol, 100000):+.3f}")
