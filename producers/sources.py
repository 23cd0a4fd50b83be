"""Local prompt sources: toy tasks, a JSONL file, reasoning-gym generators; and SFT examples from JSONL.

``open_source(spec, seed=, num_prompts=)`` yields ``Prompt`` messages for a ``feeder.source`` spec:

* ``toy:<task>``: endless prompts of a toy task's training items (``models.tasks``), ``prompt_id =
  "<task>-<seed>-<i>"``; its held-out items are the evaluator's (``eval_prompts``).
* ``jsonl:<path>``: one JSON object per line with ``prompt`` (or ``text``/``question``), optional ``answer``,
  ``id``, ``task`` and ``metadata``; ``prompt_id`` = the ``id`` or ``"<file stem>-<line index>"``. Any other
  column joins ``metadata`` (a batch reward receives each as a keyword column, as TRL's reward functions do).
* ``reasoning_gym:<dataset>``: ``reasoning_gym.create_dataset(dataset, size=, seed=)`` (offline, with its
  verifier); the entry goes into ``metadata["entry"]`` (JSON-safe) for the ``reasoning_gym`` reward.
* ``env:<name>``: endless episodes of the environment ``<name>`` (``env.name``), ``prompt_id = "<name>-<seed>-<i>"``,
  task ``env:<name>``, ``metadata["seed"]`` the seed its group's episodes reset with (``producers/multiturn.py``:
  the environment writes the prompt).

Finite sources cycle when ``num_prompts`` asks for more (0 = endless); epoch ``e > 0`` suffixes ids with
``@e<e>`` so that a prompt seen again is a new group (the buffer deduplicates by episode id). Every source is
deterministic for its seed, so a restarted feeder can skip what it already produced.

``eval_prompts(spec, size=, seed=)`` is the evaluator's held-out set: for ``toy:<task>`` the first ``size``
distinct items of the task's ``eval`` split (fewer when the split holds fewer: addmod10 has 13), never a training
item; for ``jsonl:`` the file's first ``size`` rows (a file kept apart from training); for ``reasoning_gym:``
``size`` items generated with ``seed`` (choose a seed the feeder does not use).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from models.tasks import get_task
from topics.errors import ConfigError
from topics.schemas import Prompt, SFTExample


def toy_prompts(task: str, *, seed: int = 0) -> Iterator[Prompt]:
    t = get_task(task)
    rng = random.Random(seed)
    for i in itertools.count():
        text, answer = t.prompt(rng, "train")
        yield Prompt(prompt_id=f"{task}-{seed}-{i}", task=task, text=text, answer=answer)


def env_prompts(name: str, *, seed: int = 0) -> Iterator[Prompt]:
    for i in itertools.count():
        yield Prompt(prompt_id=f"{name}-{seed}-{i}", task=f"env:{name}", text=name,
                     metadata={"seed": seed * 1_000_003 + i})


def toy_eval_prompts(task: str, *, size: int, seed: int = 0, patience: int = 5000) -> list[Prompt]:
    """The first ``size`` distinct held-out items of a toy task, drawn with ``seed`` (fewer if ``patience``
    draws in a row find no new one: the split is exhausted). ``prompt_id = "<task>-eval-<i>"``."""
    t = get_task(task)
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    misses = 0
    while len(seen) < size and misses < patience:
        text, answer = t.prompt(rng, "eval")
        if text in seen:
            misses += 1
            continue
        seen[text], misses = answer, 0
    return [Prompt(prompt_id=f"{task}-eval-{i}", task=task, text=text, answer=answer)
            for i, (text, answer) in enumerate(seen.items())]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise ConfigError("feeder.source", f"{path} does not exist") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError("feeder.source", f"{path}:{n} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ConfigError("feeder.source", f"{path}:{n} must be a JSON object")
        rows.append(row)
    return rows


_JSONL_FIELDS = ("prompt", "text", "question", "answer", "id", "task", "metadata")


def jsonl_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    out = []
    for i, row in enumerate(_read_jsonl(path)):
        text = row.get("prompt", row.get("text", row.get("question")))
        if not isinstance(text, str):
            raise ConfigError("feeder.source", f"{path} line {i + 1}: needs a 'prompt' (or 'text'/'question') string")
        extra = {k: v for k, v in row.items() if k not in _JSONL_FIELDS}
        out.append(Prompt(
            prompt_id=str(row.get("id", f"{path.stem}-{i}")), task=str(row.get("task", path.stem)), text=text,
            answer=str(row.get("answer", "")), metadata={**extra, **dict(row.get("metadata") or {})},
        ))
    return out


def _json_safe(obj: Any) -> Any:
    """Tuples to lists, unknown objects to strings: what msgpack and orjson both carry."""
    return orjson.loads(orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS))


def reasoning_gym_prompts(dataset: str, *, seed: int = 0, size: int = 1000) -> list[Prompt]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(dataset, size=size, seed=seed)
    except Exception as exc:  # unknown name, bad arguments
        raise ConfigError("feeder.source", f"reasoning-gym dataset {dataset!r}: {exc}") from exc
    out = []
    for i in range(size):
        entry = _json_safe(ds[i])
        out.append(Prompt(
            prompt_id=f"rg-{dataset}-{seed}-{i}", task=dataset, text=entry["question"], answer=str(entry["answer"]),
            metadata={"source": "reasoning_gym", "dataset": dataset, "entry": entry},
        ))
    return out


def _cycle(prompts: list[Prompt]) -> Iterator[Prompt]:
    if not prompts:
        return
    for epoch in itertools.count():
        for p in prompts:
            if epoch == 0:
                yield p
            else:
                yield Prompt(prompt_id=f"{p.prompt_id}@e{epoch}", task=p.task, text=p.text, answer=p.answer,
                             token_ids=p.token_ids, metadata=p.metadata)


def open_source(spec: str, *, seed: int = 0, num_prompts: int = 0) -> Iterator[Prompt]:
    """The prompts of a ``feeder.source`` spec, ``num_prompts`` of them (0 = endless)."""
    kind, _, arg = spec.partition(":")
    if kind == "toy":
        it: Iterable[Prompt] = toy_prompts(arg, seed=seed)
    elif kind == "jsonl":
        it = _cycle(jsonl_prompts(arg))
    elif kind == "reasoning_gym":
        it = _cycle(reasoning_gym_prompts(arg, seed=seed, size=num_prompts or 1000))
    elif kind == "env":
        it = env_prompts(arg, seed=seed)
    else:
        raise ConfigError("feeder.source", f"{spec!r} is not a prompt source (toy:, jsonl:, reasoning_gym:, env:)")
    return itertools.islice(it, num_prompts) if num_prompts else iter(it)


def eval_prompts(spec: str, *, size: int, seed: int = 0) -> list[Prompt]:
    """The evaluator's held-out prompts for an ``eval.source`` spec (module docstring)."""
    kind, _, arg = spec.partition(":")
    if kind == "toy":
        try:
            return toy_eval_prompts(arg, size=size, seed=seed)
        except KeyError as exc:
            raise ConfigError("eval.source", str(exc)) from None
    if kind == "jsonl":
        return jsonl_prompts(arg)[:size]
    if kind == "reasoning_gym":
        return reasoning_gym_prompts(arg, seed=seed, size=size)
    raise ConfigError("eval.source", f"{spec!r} is not a prompt source (toy:, jsonl:, reasoning_gym:)")


def sft_examples(path: str | Path, *, num_examples: int = 0) -> Iterator[SFTExample]:
    """SFT pairs from JSONL (``prompt`` + ``completion``, optional ``id``), cycled like the prompt sources."""
    path = Path(path)
    rows = _read_jsonl(path)
    for i, row in enumerate(rows):
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise ConfigError("feeder.source", f"{path} line {i + 1}: needs 'prompt' and 'completion' strings")

    def gen() -> Iterator[SFTExample]:
        for epoch in itertools.count():
            for i, row in enumerate(rows):
                base = str(row.get("id", f"{path.stem}-{i}"))
                yield SFTExample(example_id=base if epoch == 0 else f"{base}@e{epoch}", prompt=row["prompt"],
                                 completion=row["completion"])

    return itertools.islice(gen(), num_examples) if num_examples else gen() if rows else iter(())
