"""Toy tasks the tiny model can learn in a few hundred GRPO steps (tests, the demo, the learning check).

Each task makes a prompt from a ``random.Random`` and scores a response against the answer:

* ``addmod10``: ``"a+b="`` with digits a, b -> ``str((a + b) % 10)``.
* ``reverse``: ``"reverse abc:"`` -> ``"cba"`` (three lower-case letters).

``score(response_text, answer)`` is 1.0 when the response, stripped of surrounding whitespace and cut at the
first end-of-answer character (newline, space or ``.``), equals the answer, else 0.0 (a plain 0/1 reward: the
learning check in FACTS.md reaches mean reward 0.8 with it).

Two tasks are for pretrained instruct models (``configs/smollm2.yaml``), in the shape TRL users write: the question
asks for the answer inside ``<answer>...</answer>`` tags, and ``score`` is 1.0 when the last tag holds the answer:

* ``add1``: ``"What is 3 + 5? ..."`` (digits) -> ``"8"``;
* ``add2``: ``"What is 47 + 38? ..."`` (two-digit numbers) -> ``"85"``.

Two tasks only warm-start the tiny model for the built-in environments (``configs/blackjack.yaml``,
``configs/calculator.yaml``): their prompts are contexts as the multi-turn loop builds them (observations in the
environments' own words, earlier turns ending in ``<eos>``) and their answers valid moves, so RL starts from a
policy that acts validly but no better than chance:

* ``blackjack_moves``: ``"you 13, dealer 7: "`` (after 0-2 earlier hits) -> ``hit`` or ``stand`` at random (the
  random policy);
* ``calculator_moves``: a problem -> a tool call ``<calc>a*b</calc>`` or a guessed number, at random; after a
  ``<result>V</result>`` -> ``V`` (reading the tool's answer back).

The ``answer_format`` and ``answer`` rewards (``producers.rewards``) score the format and the answer separately.

Held-out items: every task splits its items into ``train`` and ``eval`` by a hash of the prompt text
(``is_eval_item``: one item in ``EVAL_SHARE``, e.g. 13 of addmod10's 100 sums, 12 of add1's 81), and
``ToyTask.prompt(rng, split)`` draws from one side only. Training (the feeder's ``toy:`` source, the warm start)
draws ``train`` items, the evaluator (``producers/evaluator.py``) ``eval`` items: the two never share a prompt,
whatever the seeds. ``make_prompt`` draws from both (the tasks' own tests and benches).
"""

from __future__ import annotations

import random
import re
import string
import zlib
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

    def prompt(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        """A prompt of the ``train`` or ``eval`` items only (rejection sampling on ``is_eval_item``)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        while True:
            text, answer = self.make_prompt(rng)
            if is_eval_item(text) == (split == "eval"):
                return text, answer


SPLITS = ("train", "eval")
EVAL_SHARE = 8  # one item in EVAL_SHARE is held out for evaluation


def is_eval_item(text: str) -> bool:
    """Whether a prompt text is one of the held-out items (deterministic: a CRC-32 of the text)."""
    return zlib.crc32(text.encode()) % EVAL_SHARE == 0


def _addmod10_prompt(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str((a + b) % 10)


def _reverse_prompt(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
    return f"reverse {word}:", word[::-1]


def _blackjack_hand(rng: random.Random) -> str:
    soft = rng.random() < 0.2
    total = rng.randint(13, 21) if soft else rng.randint(4, 21)
    dealer = rng.choice(["a", *map(str, range(2, 11))])
    return f"you {'s' if soft else ''}{total}, dealer {dealer}: "


def _blackjack_moves_prompt(rng: random.Random) -> tuple[str, str]:
    text = "".join(f"{_blackjack_hand(rng)}hit<eos>" for _ in range(rng.choice([0, 0, 1, 2])))
    return text + _blackjack_hand(rng), rng.choice(["hit", "stand"])


_CALC_TEMPLATES = (("{a} boxes of {b} pens. pens? ", "*"), ("{a} pens and {b} more. pens? ", "+"),
                   ("{a} pens, {b} lost. pens left? ", "-"))


def _calculator_moves_prompt(rng: random.Random) -> tuple[str, str]:
    text, op = rng.choice(_CALC_TEMPLATES)
    a, b = rng.randrange(100, 1000) if op == "-" else rng.randrange(12, 100), rng.randrange(12, 100)
    problem = text.format(a=a, b=b)
    value = a * b if op == "*" else a + b if op == "+" else a - b
    if rng.random() < 1 / 3:  # the second turn: read the result back
        return f"{problem}<calc>{a}{op}{b}</calc><eos><result>{value}</result>", str(value)
    if rng.random() < 0.5:
        return problem, f"<calc>{a}{op}{b}</calc>"
    return problem, str(rng.randrange(10, max(100, 10 ** len(str(value)))))


ANSWER_INSTRUCTION = "Put only the final number inside <answer></answer> tags."
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def tagged_score(response_text: str, answer: str) -> float:
    """1.0 if the last ``<answer>...</answer>`` of the response holds exactly ``answer`` (stripped), else 0.0."""
    tags = _TAG.findall(response_text)
    return 1.0 if tags and tags[-1].strip() == answer.strip() else 0.0


def _sum_prompt(lo: int, hi: int) -> Callable[[random.Random], tuple[str, str]]:
    def make(rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return f"What is {a} + {b}? {ANSWER_INSTRUCTION}", str(a + b)

    return make


TASKS: dict[str, ToyTask] = {
    "add1": ToyTask("add1", _sum_prompt(1, 9), tagged_score, max_answer_tokens=12),
    "add2": ToyTask("add2", _sum_prompt(10, 99), tagged_score, max_answer_tokens=12),
    "blackjack_moves": ToyTask("blackjack_moves", _blackjack_moves_prompt, exact_score, max_answer_tokens=6),
    "calculator_moves": ToyTask("calculator_moves", _calculator_moves_prompt, exact_score, max_answer_tokens=20),
    "addmod10": ToyTask("addmod10", _addmod10_prompt, exact_score, max_answer_tokens=2),
    "reverse": ToyTask("reverse", _reverse_prompt, exact_score, max_answer_tokens=4),
}


def get_task(name: str) -> ToyTask:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown toy task {name!r}; known: {sorted(TASKS)}") from None
