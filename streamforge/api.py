"""The Python API for notebooks, in the shape users know from TRL-like trainers.

    from streamforge import RLConfig, train

    result = train(RLConfig(num_generations=8, learning_rate=3e-4, max_steps=200, output_dir="runs/nb"),
                   reward_functions=["my_rewards:exact_answer"],
                   dataset=[{"prompt": "2+3=", "answer": "5"}, ...])

``train`` runs the very same role processes as ``streamforge up`` (brokers, feeder, generators, buffer,
trainer) and returns a ``TrainResult`` with the run directory, the last metrics row and the audit. Reward
functions run inside generator processes, so each must be importable there: pass ``"module:function"``, a
builtin name (``toy``, ``math``, ``format``, ``exact``, ``length``, ``reasoning_gym``), or a function defined
in an importable module (a function defined in a notebook's ``__main__`` is rejected with a clear error).
Two signatures (``producers/rewards.py``): per response, ``fn(prompt: topics.schemas.Prompt, response_text: str)
-> float``; or batched as TRL's GRPOTrainer calls them, ``fn(prompts, completions, **columns) -> list[float]``
(the dataset's other columns, ``answer`` among them, arrive as lists). A ``dataset`` needs ``reward_functions``:
without them ``train`` raises ``ConfigError`` at once; with neither a dataset nor rewards it trains the toy
``task`` (default ``addmod10``) on its own ``toy`` reward.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamforge.config import load_config
from topics.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """TRL GRPOConfig-style names, mapped onto streamforge's RunConfig (``extra`` takes any ``section.key``)."""

    output_dir: str = "runs/train"
    model: str = ""  # HF dir; empty = the built-in tiny model
    learning_rate: float = 3e-4
    num_generations: int = 8  # group size
    prompts_per_step: int = 8  # groups per batch
    max_completion_length: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    max_steps: int = 100
    reward_target: float = 0.0
    reward_weights: list[float] | None = None
    max_staleness: int = 2  # staleness.max_versions: 0 = synchronous (TRL AsyncGRPOTrainer's max_staleness)
    max_policy_lag: int | None = None  # generator.max_policy_lag; None = derived from max_staleness
    num_generators: int = 1
    # topics.episodes_partitions: the run's one buffer forms each batch from one partition's groups, so with more
    # partitions a batch waits for its partition to fill while the trainer moves on (streamforge/staleness.py);
    # bench/e2e.py's synchronous mode dropped 58% of its episodes as stale with 4 and took 135 s, 40 s with 1
    episodes_partitions: int = 1
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # {"buffer.advantage": "rloo", ...}

    def overrides(self) -> list[str]:
        loss_args: dict[str, Any] = {"epsilon": self.epsilon, "beta": self.beta}
        if self.epsilon_high is not None:
            loss_args["epsilon_high"] = self.epsilon_high
        out = [
            f"run.run_dir={self.output_dir}", f"run.seed={self.seed}",
            f"trainer.lr={self.learning_rate}", f"trainer.loss={self.loss_type}",
            f"trainer.max_steps={self.max_steps}", f"trainer.reward_target={self.reward_target}",
            f"trainer.loss_args={orjson.dumps(loss_args).decode()}",
            f"generator.group_size={self.num_generations}",
            f"generator.max_tokens={self.max_completion_length}",
            f"generator.temperature={self.temperature}", f"generator.top_p={self.top_p}",
            f"staleness.max_versions={self.max_staleness}",
            f"buffer.groups_per_batch={self.prompts_per_step}",
            f"up.generators={self.num_generators}",
            f"topics.episodes_partitions={self.episodes_partitions}",
        ]
        if self.max_policy_lag is not None:
            out.append(f"generator.max_policy_lag={self.max_policy_lag}")
        if self.model:
            out.append(f"model.path={self.model}")
        if self.reward_weights:
            out.append(f"generator.reward_weights=[{','.join(str(w) for w in self.reward_weights)}]")
        out += [f"{k}={v}" for k, v in self.extra.items()]
        return out


@dataclass
class TrainResult:
    exit_code: int
    run_dir: Path
    last_metrics: dict[str, Any]
    audit: dict[str, Any]


def reward_spec(fn: str | Callable[..., float]) -> str:
    """The config string of a reward: a builtin name, ``module:function``, or an importable function."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ConfigError(
            "reward_functions",
            f"{fn!r} is not importable by the generator processes: define it in a module and pass it "
            "(or 'module:function')",
        )
    from producers.rewards import is_batch_reward

    if not is_batch_reward(fn) and len(inspect.signature(fn).parameters) < 2:
        raise ConfigError("reward_functions", f"{qualname} must take (prompt, response_text), or "
                          "(prompts, completions, **columns) as TRL's reward functions do")
    return f"{module}:{qualname}"


def write_dataset(dataset: Iterable[Mapping[str, Any]] | str | os.PathLike, run_dir: Path) -> str:
    """A JSONL path for ``feeder.source``: an existing file as is, or rows written to ``<run_dir>/dataset.jsonl``."""
    if isinstance(dataset, (str, os.PathLike)):
        return str(dataset)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "dataset.jsonl"
    with open(path, "wb") as fh:
        fh.writelines(orjson.dumps(dict(row)) + b"\n" for row in dataset)
    return str(path)


def build_run_config(config: RLConfig, *, reward_functions: Sequence[str | Callable[..., float]],
                     dataset: Iterable[Mapping[str, Any]] | str | os.PathLike | None,
                     task: str = "") -> tuple[Any, list[str]]:
    overrides = config.overrides()
    if dataset is not None and not reward_functions:
        raise ConfigError("reward_functions", "a dataset needs reward functions to score its completions "
                          "(a name, 'module:function', or an importable function)")
    specs = [reward_spec(fn) for fn in reward_functions] or ["toy"]
    overrides.append(f"generator.rewards=[{','.join(specs)}]")
    if dataset is not None:
        overrides.append(f"feeder.source=jsonl:{write_dataset(dataset, Path(config.output_dir))}")
    elif task:
        overrides.append(f"feeder.source=toy:{task}")
    return load_config(None, overrides), ["--" + o for o in overrides]


def train(config: RLConfig, *, reward_functions: Sequence[str | Callable[..., float]] = (),
          dataset: Iterable[Mapping[str, Any]] | str | os.PathLike | None = None, task: str = "",
          budget_s: float = 0.0) -> TrainResult:
    """Run a whole training (brokers and every role as processes) and return where it went and how it ended.

    ``budget_s`` > 0 stops the run gracefully after that many seconds of wall-clock time."""
    from streamforge.up import run_up

    if budget_s:
        config.extra = {**config.extra, "up.max_wall_s": budget_s}
    run_config, overrides = build_run_config(config, reward_functions=reward_functions, dataset=dataset, task=task)
    code = run_up(run_config, config_path=None, overrides=overrides)
    run_dir = run_config.run_dir
    last: dict[str, Any] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_bytes().splitlines()
        if lines:
            last = orjson.loads(lines[-1])
    audit_path = run_dir / "audit.json"
    audit = orjson.loads(audit_path.read_bytes()) if audit_path.exists() else {}
    return TrainResult(code, run_dir, last, audit)
