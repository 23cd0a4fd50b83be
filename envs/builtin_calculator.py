"""The built-in ``calculator`` environment: arithmetic word problems with a calculator tool (``env.impl:
calculator``).

``reset(seed)`` poses one problem drawn from ``random.Random(seed)``, e.g. ``"47 boxes of 38 pens. pens? "``
(a product, a sum or a difference of two- and three-digit numbers: hard to do in one's head, easy with the
tool). Each turn the model either calls the tool, writing ``<calc>EXPR</calc>`` anywhere in its action, and
reads ``<result>VALUE</result>`` back (reward 0, not done; a bad expression reads ``<result>error</result>``), or
answers: any action without a tool call is the final answer, whose first number is compared with the right
one (reward 1 or 0, done). ``info["tool_call"]`` marks the observations that answer a tool call (the generator
counts them: ``env/tool_calls_mean``).

``evaluate(expr)`` is the tool: a recursive-descent parser of numbers, ``+ - * /``, unary minus and
parentheses over exact fractions (never ``eval``); at most ``MAX_EXPR_CHARS`` characters, ``MAX_DEPTH`` nested
parentheses and values below ``MAX_VALUE`` in magnitude, else ``CalcError``.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

MAX_EXPR_CHARS = 200
MAX_DEPTH = 16
MAX_VALUE = 10**15
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class CalcError(ValueError):
    """An expression the tool cannot evaluate (syntax, division by zero, too long, too deep, too large)."""


class _Parser:
    """``expr := term (("+"|"-") term)*; term := unary (("*"|"/") unary)*; unary := "-" unary | atom;
    atom := NUMBER | "(" expr ")"``."""

    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        for number, other in _TOKEN.findall(text):
            if other and other.isspace():
                continue
            if other and other not in "+-*/()":
                raise CalcError(f"unexpected {other!r}")
            self.tokens.append(number or other)
        self.at = 0
        self.depth = 0

    def parse(self) -> Fraction:
        value = self.expr()
        if self.at != len(self.tokens):
            raise CalcError(f"unexpected {self.tokens[self.at]!r}")
        return value

    def _peek(self) -> str:
        return self.tokens[self.at] if self.at < len(self.tokens) else ""

    def _check(self, value: Fraction) -> Fraction:
        if abs(value) >= MAX_VALUE or value.denominator >= MAX_VALUE:
            raise CalcError("value too large")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.at]
            self.at += 1
            value = self._check(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/"):
            op = self.tokens[self.at]
            self.at += 1
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = self._check(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self) -> Fraction:
        if self._peek() == "-":
            self.at += 1
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CalcError("too deeply nested")
            try:
                return -self.unary()
            finally:
                self.depth -= 1
        return self.atom()

    def atom(self) -> Fraction:
        tok = self._peek()
        if tok == "(":
            self.at += 1
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CalcError("too deeply nested")
            value = self.expr()
            if self._peek() != ")":
                raise CalcError("missing )")
            self.at += 1
            self.depth -= 1
            return value
        if not tok or not tok[0].isdigit():
            raise CalcError(f"expected a number, got {tok or 'the end'!r}")
        self.at += 1
        return self._check(Fraction(tok))


def evaluate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression (module docstring); ``CalcError`` if it has none."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"longer than {MAX_EXPR_CHARS} characters")
    return _Parser(expr).parse()


def format_value(value: Fraction) -> str:
    """An integer as itself; any other value as a decimal of at most 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


_TEMPLATES = (
    ("{a} boxes of {b} pens. pens? ", lambda a, b: a * b),
    ("{a} pens and {b} more. pens? ", lambda a, b: a + b),
    ("{a} pens, {b} lost. pens left? ", lambda a, b: a - b),
)


def make_problem(rng: random.Random) -> tuple[str, int]:
    """``(text, answer)`` of one problem."""
    text, fn = rng.choice(_TEMPLATES)
    a, b = rng.randrange(12, 100), rng.randrange(12, 100)
    if fn(3, 1) == 2:  # the difference: a first number of three digits, above the second
        a = rng.randrange(100, 1000)
    return text.format(a=a, b=b), fn(a, b)


def first_number(text: str) -> str:
    found = _NUMBER.search(text)
    return found.group(0) if found else ""


class CalculatorAction(Action):
    text: str  # a tool call "<calc>EXPR</calc>" or the final answer


class CalculatorObservation(Observation):
    text: str = ""
    tool_call: bool = False  # this observation answers a tool call


class CalculatorEnv(Environment[CalculatorAction, CalculatorObservation, State]):
    """See the module docstring."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.answer = 0
        self._episode_id: str | None = None
        self._steps = 0
        self._done = False

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CalculatorObservation:
        text, self.answer = make_problem(random.Random(seed))
        self._episode_id, self._steps, self._done = episode_id, 0, False
        return CalculatorObservation(text=text, reward=0.0, done=False)

    def step(self, action: CalculatorAction, timeout_s: float | None = None, **kwargs: Any) -> CalculatorObservation:
        self._steps += 1
        call = _CALL.search(action.text)
        if call is not None and not self._done:
            try:
                result = format_value(evaluate(call.group(1)))
            except CalcError:
                result = "error"
            return CalculatorObservation(text=f"<result>{result}</result>", tool_call=True, reward=0.0, done=False)
        right = first_number(action.text) == str(self.answer)
        self._done = True
        return CalculatorObservation(text="right" if right else "wrong", reward=1.0 if right else 0.0, done=True)

    @property
    def state(self) -> State:
        return State(episode_id=self._episode_id, step_count=self._steps)
