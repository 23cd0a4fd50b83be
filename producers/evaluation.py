"""The evaluator's config, the trainer exports it loads, and its metrics (pass@k): plain data and functions.

``EvalConfig`` is the run config's ``eval`` section (the role is ``producers/evaluator.py``).

Exports: the evaluator never joins weight sync; it loads weights the trainer writes anyway, found on disk:

* every checkpoint's ``checkpoints/step-<n>/hf/model.safetensors`` with its ``meta.json`` (``step``,
  ``policy_version``), written by ``consumers/checkpoint.py`` every ``trainer.checkpoint_every`` steps (a checkpoint
  directory appears complete, renamed from ``step-<n>.tmp``);
* with ``weightsync.transport: file``, the version directory that the latest ``PolicyVersion`` names
  (``path``, ``weightsync/files.py``): every version.

``due_export`` picks what to evaluate next: the newest export at least ``every_versions`` versions past the last
one evaluated (the first evaluation takes the newest at once, which is how a late joiner starts). Passing over
due versions is counted as skipped: after evaluating ``v`` the next evaluation falls due at ``v + every_versions``;
evaluating ``w`` instead skips ``(w - v) // every_versions - 1`` of them (the evaluator was busy, or those versions
were never exported).

``pass_at_k(n, c, k)`` is the unbiased estimator of Chen et al. (2021), the probability that at least one of ``k``
samples drawn without replacement from ``n`` of which ``c`` are correct is correct: ``1 - C(n - c, k) / C(n, k)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from runtime.cpus import parse_cpus
from topics.errors import ConfigError
from topics.schemas import PolicyVersion


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """The evaluator: which held-out prompts, how often, how many samples for pass@k, its own engine."""

    every_versions: int = 1  # evaluate a version at least this many versions after the last one evaluated
    size: int = 64  # held-out prompts (fewer when the eval split holds fewer: addmod10's has 13 items)
    samples: int = 8  # sampled completions per prompt for pass@k, beside the greedy one
    pass_k: int = 0  # the k of eval/pass_at_k (0 = samples); at most samples
    temperature: float = 1.0  # of the samples (the greedy completion is temperature 0)
    max_tokens: int = 0  # response tokens (0 = generator.max_tokens)
    # held-out prompts: "" = the eval split of feeder.source (a toy: source), else a spec such as jsonl:<path>
    source: str = ""
    seed: int = 1  # of the held-out draw, the samples and the engine
    correct_reward: str = ""  # a completion is correct when this reward is >= 1 ("" = the first of generator.rewards)
    kv_cache_gib: float = 1.0  # the evaluator engine's KV cache on CPU
    gpu_memory_utilization: float = 0.2  # its share of the GPU (it shares it with a generator's engine)
    cpus: str = ""  # the cores its engine runs on on a CPU host ("" = vLLM's choice, or what `up` gives it)

    def __post_init__(self) -> None:
        for key in ("every_versions", "size", "samples"):
            if getattr(self, key) < 1:
                raise ConfigError(f"eval.{key}", "must be at least 1")
        if not 0 <= self.pass_k <= self.samples:
            raise ConfigError("eval.pass_k", f"must be in [0, eval.samples = {self.samples}] (0 = eval.samples)")
        if self.temperature <= 0:
            raise ConfigError("eval.temperature", "must be positive (the greedy completion is always evaluated)")
        if self.max_tokens < 0:
            raise ConfigError("eval.max_tokens", "must be >= 0 (0 = generator.max_tokens)")
        if self.kv_cache_gib <= 0:
            raise ConfigError("eval.kv_cache_gib", "must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("eval.gpu_memory_utilization", "must be in (0, 1]")
        parse_cpus(self.cpus, key="eval.cpus")

    @property
    def k(self) -> int:
        return self.pass_k or self.samples


def resolve_source(cfg: EvalConfig, feeder_source: str) -> str:
    """The held-out prompt spec: ``eval.source``, else the eval split of a ``toy:`` feeder source."""
    if cfg.source:
        return cfg.source
    if feeder_source.startswith("toy:"):
        return feeder_source
    raise ConfigError("eval.source", f"feeder.source {feeder_source!r} has no held-out split: name the evaluator's "
                                     "prompts (e.g. jsonl:<a file kept apart from training>)")


# -- exports ------------------------------------------------------------------------------------------------

WEIGHTS_SUFFIX = ".safetensors"


@dataclass(frozen=True, slots=True)
class Export:
    """Weights of one policy version on disk: ``path`` is a directory holding its safetensors."""

    version: int
    step: int
    path: Path


def has_weights(path: Path) -> bool:
    return path.is_dir() and any(p.name.endswith(WEIGHTS_SUFFIX) for p in path.iterdir())


def checkpoint_exports(run_dir: str | Path) -> list[Export]:
    """The HF exports of the complete checkpoints in ``<run_dir>/checkpoints``, oldest first."""
    root = Path(run_dir) / "checkpoints"
    out = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for d in entries:
        if not (d.name.startswith("step-") and d.name[5:].isdigit()):
            continue  # step-<n>.tmp: not complete yet
        try:
            meta = orjson.loads((d / "meta.json").read_bytes())
            if has_weights(d / "hf"):
                out.append(Export(int(meta["policy_version"]), int(meta["step"]), d / "hf"))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # pruned while we looked, or not a checkpoint
    return sorted(out, key=lambda e: (e.version, e.step))


def available_exports(run_dir: str | Path, latest: PolicyVersion | None) -> list[Export]:
    """Every export the evaluator could load now: the checkpoints', and the latest version's own directory with
    the file transport. Oldest first."""
    found = checkpoint_exports(run_dir)
    if latest is not None and latest.transport == "file" and latest.path:
        try:
            if has_weights(Path(latest.path)):
                found.append(Export(latest.version, latest.step, Path(latest.path)))
        except OSError:
            pass  # pruned meanwhile
    return sorted(found, key=lambda e: (e.version, e.step))


def due_export(exports: Sequence[Export], last_version: int | None, every: int) -> tuple[Export | None, int]:
    """The export to evaluate next and the due versions it skips (module docstring); ``(None, 0)`` if none is due.
    ``last_version`` None: nothing evaluated yet."""
    if not exports:
        return None, 0
    newest = max(exports, key=lambda e: (e.version, e.step))
    if last_version is None:
        return newest, 0
    if newest.version < last_version + every:
        return None, 0
    return newest, (newest.version - last_version) // every - 1


# -- metrics ------------------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (module docstring)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(slots=True)
class PromptResult:
    """One held-out prompt at one version: the greedy completion's reward and correctness, and each sample's."""

    greedy_reward: float
    greedy_correct: bool
    samples_correct: list[bool]
    samples_reward: list[float]


def summarise(results: Sequence[PromptResult], k: int) -> dict[str, float]:
    """The ``eval/*`` metrics of one evaluation (greedy reward and accuracy, pass@k and pass@1 of the samples)."""
    if not results:
        raise ValueError("no prompt was evaluated")
    n = len(results)
    sampled = [r for r in results if r.samples_correct]
    out = {
        "eval/reward_mean": sum(r.greedy_reward for r in results) / n,
        "eval/accuracy": sum(r.greedy_correct for r in results) / n,
        "eval/pass_at_k": (sum(pass_at_k(len(r.samples_correct), sum(r.samples_correct), k) for r in sampled)
                           / len(sampled)) if sampled else float("nan"),
        "eval/pass_at_1": (sum(sum(r.samples_correct) / len(r.samples_correct) for r in sampled) / len(sampled))
                          if sampled else float("nan"),
        "eval/sample_reward_mean": (sum(sum(r.samples_reward) / len(r.samples_reward) for r in sampled)
                                    / len(sampled)) if sampled else float("nan"),
    }
    return out
