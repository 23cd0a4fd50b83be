"""Rewards: pluggable scoring functions combined with weights, bounded in time.

A reward is ``fn(prompt: Prompt, response_text: str) -> float``, or a batch reward in the shape TRL's
GRPOTrainer uses, ``fn(prompts, completions, **columns) -> list[float]``: one call per GRPO group, ``prompts`` the
prompt text once per completion, ``completions`` the response texts, and ``columns`` each of the prompt's columns as
a list of the same length (``answer``, ``task``, ``prompt_id`` and every ``metadata`` key, which is where a JSONL
dataset's extra columns go). A callable is a batch reward when its parameters include ``prompts`` and
``completions`` (or it has ``batched = True``). ``generator.rewards`` lists them by builtin name or import path
``"package.module:callable"``; ``generator.reward_weights`` weighs them (default 1.0 each):

    reward = sum_i w_i * r_i(prompt, response_text)        components = {name_i: r_i}

Builtins (``BUILTINS``):

* ``toy``: the toy task's own score (``models.tasks.TASKS[prompt.task]``), 0/1.
* ``math``: the last ``\\boxed{...}`` or ``#### ...`` answer of the response against ``prompt.answer``; numbers
  compare with a relative/absolute tolerance of 1e-6 (commas, ``$`` and ``%`` ignored), other answers as
  normalised strings; 1.0 or 0.0.
* ``format``: 1.0 if the response is ``<think>...</think>`` followed by a non-empty answer, else 0.0.
* ``exact``: 1.0 if the stripped response equals the stripped ``prompt.answer``.
* ``length``: ``-min(1, len(response_text) / budget)`` with ``budget = prompt.metadata.get("length_budget", 64)``
  characters: a penalty in [-1, 0] to combine with a small weight.
* ``answer_format``: 1.0 if the response holds exactly one non-empty ``<answer>...</answer>``, else 0.0 (the format
  reward TRL users pair with a correctness reward).
* ``answer``: 1.0 if the content of the response's last ``<answer>...</answer>`` matches ``prompt.answer`` (numbers
  with the tolerance of ``math``, other answers as normalised strings), else 0.0.
* ``last_number``: 1.0 if the last number in the response (the content of its last ``<answer>`` tag when it has
  one) equals ``prompt.answer`` as a number, else 0.0: the answer extraction of GSM8K-style graders, which credits
  "3 + 5 = 8" before the model has learned any format.
* ``reasoning_gym``: reasoning-gym's own verifier for the prompt's dataset
  (``prompt.metadata["dataset"]`` and ``["entry"]``, as ``producers.sources`` writes them), applied to the
  ``<answer>...</answer>`` of the response if it has one, else to the whole stripped response.

``remote:<service>`` names a reward served by the replicas of a reward service (``streamforge run reward``,
``runtime/remote_reward.py``): each group goes to one replica as one request; the generator binds it to its
service directory (``RewardSet.bind``). A row the replica could not score, or a call that fails, is a
``RewardFailed`` like any other.

A reward that raises, returns a non-finite number (or, batched, not one number per completion), or runs longer
than ``timeout_s`` raises ``RewardFailed`` (``reason`` = ``reward_error`` or ``reward_timeout``); the generator
dead-letters that Episode (every Episode of the group, for a batch reward) and keeps going.
Rewards run in a small thread pool so a slow one never blocks the event loop; a timed-out reward's thread cannot
be killed and is abandoned (it finishes in the background, its result ignored). The builtins that only look at
the response's text (all but ``reasoning_gym``: ``INLINE``) run in the event loop itself: a thread hop and a timer
per sample cost more than such a reward (a group of 8 spent 5-7 ms on the tiny e2e task, 13-18 ms with 24 groups
in flight), and they cannot hang.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from models.tasks import get_task
from runtime.remote_reward import REMOTE_PREFIX, RemoteReward
from topics.deadlines import within
from topics.errors import ConfigError, StreamforgeError, TimeoutExpired
from topics.schemas import Prompt

RewardFn = Callable[[Prompt, str], float]


class RewardFailed(StreamforgeError):
    """A reward raised, returned a non-finite value, or timed out. ``reason`` is the dead-letter reason."""

    retriable = False

    def __init__(self, name: str, reason: str, detail: str) -> None:
        super().__init__(f"reward {name!r}: {reason}: {detail}")
        self.name = name
        self.reason = reason
        self.detail = detail


# -- builtins ---------------------------------------------------------------------------------------------

def toy_reward(prompt: Prompt, response_text: str) -> float:
    return get_task(prompt.task).score(response_text, prompt.answer)


def exact_match(prompt: Prompt, response_text: str) -> float:
    return 1.0 if response_text.strip() == prompt.answer.strip() else 0.0


def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in ``text``, with nested braces balanced."""
    out = []
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def extract_math_answer(text: str) -> str | None:
    """The last boxed answer, else the text after the last ``####`` (first line), else None."""
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1].strip()
    hashes = re.findall(r"####\s*([^\n]*)", text)
    if hashes:
        return hashes[-1].strip()
    return None


def _as_number(text: str) -> float | None:
    cleaned = re.sub(r"[,\s$%]", "", text).rstrip(".")
    frac = re.fullmatch(r"(-?\d+)/(\d+)", cleaned)
    if frac:
        den = int(frac.group(2))
        return int(frac.group(1)) / den if den else None
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().strip("$").strip()).lower()


def answers_match(got: str, want: str, *, tol: float = 1e-6) -> bool:
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    return _normalise(got) == _normalise(want)


def math_answer(prompt: Prompt, response_text: str) -> float:
    got = extract_math_answer(response_text)
    want = extract_math_answer(prompt.answer) or prompt.answer
    return 1.0 if got is not None and answers_match(got, want) else 0.0


_THINK_RE = re.compile(r"^\s*<think>(.+?)</think>\s*(\S.*)$", re.DOTALL)


def thinking_format(prompt: Prompt, response_text: str) -> float:
    m = _THINK_RE.match(response_text)
    return 1.0 if m and m.group(1).strip() and "<think>" not in m.group(2) else 0.0


def length_penalty(prompt: Prompt, response_text: str) -> float:
    budget = float(prompt.metadata.get("length_budget", 64)) if prompt.metadata else 64.0
    return -min(1.0, len(response_text) / max(budget, 1.0))


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_format(prompt: Prompt, response_text: str) -> float:
    tags = _ANSWER_TAG.findall(response_text)
    return 1.0 if len(tags) == 1 and tags[0].strip() else 0.0


def answer_tag(prompt: Prompt, response_text: str) -> float:
    tags = _ANSWER_TAG.findall(response_text)
    return 1.0 if tags and answers_match(tags[-1].strip(), prompt.answer) else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(prompt: Prompt, response_text: str) -> float:
    tags = _ANSWER_TAG.findall(response_text)
    numbers = _NUMBER.findall(tags[-1] if tags else response_text)
    return 1.0 if numbers and answers_match(numbers[-1].rstrip(".,"), prompt.answer) else 0.0


def reasoning_gym_reward(prompt: Prompt, response_text: str) -> float:
    import reasoning_gym

    meta = prompt.metadata or {}
    dataset, entry = meta.get("dataset"), meta.get("entry")
    if not dataset or not isinstance(entry, dict):
        raise ValueError(f"prompt {prompt.prompt_id} has no reasoning-gym dataset/entry in its metadata")
    tags = _ANSWER_TAG.findall(response_text)
    answer = tags[-1].strip() if tags else response_text.strip()
    return float(reasoning_gym.get_score_answer_fn(dataset)(answer, entry))


BUILTINS: dict[str, RewardFn] = {
    "toy": toy_reward,
    "math": math_answer,
    "format": thinking_format,
    "exact": exact_match,
    "length": length_penalty,
    "reasoning_gym": reasoning_gym_reward,
    "answer_format": answer_format,
    "answer": answer_tag,
    "last_number": last_number,
}

# builtins bounded by their text (regexes without nested quantifiers, a bounded parser): scored in the event loop
INLINE: frozenset[RewardFn] = frozenset(fn for name, fn in BUILTINS.items() if name != "reasoning_gym")


def _import_reward(spec: str) -> RewardFn:
    """Resolve ``"package.module:callable"`` (from ``generator.rewards`` config only)."""
    from runtime.plugins import load_object

    if ":" not in spec:
        raise ConfigError("generator.rewards", f"{spec!r} is neither a builtin {sorted(BUILTINS)} nor module:callable")
    return load_object(spec, config_key="generator.rewards")


def resolve(spec: str) -> RewardFn:
    if spec.startswith(REMOTE_PREFIX):
        return RemoteReward.from_spec(spec)  # type: ignore[return-value]
    return BUILTINS[spec] if spec in BUILTINS else _import_reward(spec)


def is_batch_reward(fn: Callable[..., Any]) -> bool:
    """A TRL-shaped ``fn(prompts, completions, **columns) -> list[float]`` (module docstring)."""
    if getattr(fn, "batched", False):
        return True
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "prompts" in params and "completions" in params


def group_columns(prompt: Prompt, n: int) -> dict[str, list[Any]]:
    """The keyword columns of a batch reward for ``n`` completions of ``prompt``."""
    cols: dict[str, Any] = {**(prompt.metadata or {}), "answer": prompt.answer, "task": prompt.task,
                            "prompt_id": prompt.prompt_id}
    return {k: [v] * n for k, v in cols.items() if k not in ("prompts", "completions")}


# -- combination ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Scored:
    reward: float
    components: dict[str, float]
    seconds: float


def _number(name: str, value: Any) -> float:
    """A reward's value as a finite float, else ``RewardFailed`` (``reward_error``)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RewardFailed(name, "reward_error", f"returned {type(value).__name__}, not a number") from None
    if not math.isfinite(value):
        raise RewardFailed(name, "reward_error", f"returned a non-finite value ({value})")
    return value


class RewardSet:
    """The configured rewards with their weights; ``await score(prompt, text)`` -> ``Scored`` or ``RewardFailed``."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] = (), *, timeout_s: float = 10.0,
                 max_workers: int = 4) -> None:
        if weights and len(weights) != len(specs):
            raise ConfigError("generator.reward_weights", "needs one weight per reward")
        self.names = [s if s in BUILTINS else s.rpartition(":")[2] for s in specs]
        if len(set(self.names)) != len(self.names):
            raise ConfigError("generator.rewards", f"reward names must be distinct: {self.names}")
        self.fns = [resolve(s) for s in specs]
        self.batched = [is_batch_reward(f) for f in self.fns]
        self.inline = [f in INLINE for f in self.fns]
        self.weights = [float(w) for w in weights] if weights else [1.0] * len(specs)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")
        self.remote = [f for f in self.fns if isinstance(f, RemoteReward)]

    def bind(self, directory: Any) -> None:
        """Route the ``remote:`` rewards through ``directory`` (a started ``runtime.services.ServiceDirectory``)."""
        for fn in self.remote:
            fn.bind(directory)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _one(self, name: str, fn: RewardFn, prompt: Prompt, text: str) -> float:
        loop = asyncio.get_running_loop()
        try:
            value = await within(loop.run_in_executor(self._pool, fn, prompt, text), self.timeout_s)
        except TimeoutError:
            raise RewardFailed(name, "reward_timeout", f"no result within {self.timeout_s} s") from None
        except Exception as exc:
            raise RewardFailed(name, "reward_error", f"{type(exc).__name__}: {exc}") from exc
        return _number(name, value)

    @staticmethod
    def _inline(name: str, fn: RewardFn, prompt: Prompt, texts: list[str]) -> list[float | RewardFailed]:
        """An ``INLINE`` builtin on every text, in the event loop."""
        out: list[float | RewardFailed] = []
        for text in texts:
            try:
                out.append(_number(name, fn(prompt, text)))
            except RewardFailed as exc:
                out.append(exc)
            except Exception as exc:  # noqa: BLE001 - a builtin's failure is the sample's, as in a thread
                out.append(RewardFailed(name, "reward_error", f"{type(exc).__name__}: {exc}"))
        return out

    async def _batch(self, name: str, fn: Callable[..., Any], prompt: Prompt, texts: list[str]) -> list[float]:
        loop = asyncio.get_running_loop()

        def call() -> Any:
            return fn(prompts=[prompt.text] * len(texts), completions=list(texts), **group_columns(prompt, len(texts)))

        try:
            values = await within(loop.run_in_executor(self._pool, call), self.timeout_s)
        except TimeoutError:
            raise RewardFailed(name, "reward_timeout", f"no result within {self.timeout_s} s") from None
        except Exception as exc:
            raise RewardFailed(name, "reward_error", f"{type(exc).__name__}: {exc}") from exc
        try:
            out = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardFailed(name, "reward_error", "did not return a list of numbers") from None
        if len(out) != len(texts):
            raise RewardFailed(name, "reward_error", f"returned {len(out)} values for {len(texts)} completions")
        if not all(math.isfinite(v) for v in out):
            raise RewardFailed(name, "reward_error", f"returned a non-finite value ({out})")
        return out

    async def _remote(self, name: str, fn: RemoteReward, prompt: Prompt, texts: list[str]) -> list[float | RewardFailed]:
        try:
            # the call waits for a replica with room and for its answer, all within timeout_s (the outer bound is
            # a guard): its own error says which
            values = await within(fn.score(prompt, texts, timeout_s=self.timeout_s), self.timeout_s + 1)
        except (TimeoutError, TimeoutExpired):
            return [RewardFailed(name, "reward_timeout", f"no result within {self.timeout_s} s")] * len(texts)
        except Exception as exc:  # noqa: BLE001 - no replica, a replica's fault: every row of the group fails
            return [RewardFailed(name, "reward_error", f"{type(exc).__name__}: {exc}")] * len(texts)
        return [v if isinstance(v, float) else RewardFailed(name, v.reason, v.detail) for v in values]

    async def score(self, prompt: Prompt, response_text: str) -> Scored:
        """All rewards of one response, concurrently; the first failure raises ``RewardFailed``."""
        result = (await self.score_group(prompt, [response_text]))[0]
        if isinstance(result, RewardFailed):
            raise result
        return result

    async def score_group(self, prompt: Prompt, texts: Sequence[str]) -> list[Scored | RewardFailed]:
        """Every reward of every response of one group, concurrently: per response a ``Scored``, or the first
        ``RewardFailed`` of its rewards (a failed batch reward fails every response)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        texts = list(texts)

        async def per_reward(name: str, fn: Callable[..., Any], batched: bool,
                             inline: bool) -> list[float | RewardFailed]:
            if isinstance(fn, RemoteReward):
                return await self._remote(name, fn, prompt, texts)
            if inline:
                return self._inline(name, fn, prompt, texts)
            if batched:
                try:
                    return list(await self._batch(name, fn, prompt, texts))
                except RewardFailed as exc:
                    return [exc] * len(texts)
            return list(await asyncio.gather(*(self._one(name, fn, prompt, t) for t in texts),
                                             return_exceptions=True))

        table = await asyncio.gather(*(per_reward(n, f, b, i)
                                       for n, f, b, i in zip(self.names, self.fns, self.batched, self.inline)))
        seconds = loop.time() - t0
        out: list[Scored | RewardFailed] = []
        for i in range(len(texts)):
            values = [column[i] for column in table]
            failed = next((v for v in values if isinstance(v, BaseException)), None)
            if failed is not None:
                if not isinstance(failed, RewardFailed):
                    raise failed
                out.append(failed)
                continue
            total = sum(w * v for w, v in zip(self.weights, values))
            out.append(Scored(total, dict(zip(self.names, values)), seconds))
        return out
