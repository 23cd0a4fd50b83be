"""``streamforge replay``: re-train the exact batches of a finished run and compare every step with the original.

A fresh ``TrainEngine`` (``consumers/engine.py``, the trainer's own step) starts from the run's initial model
(``initial_model``: ``<run_dir>/model``, built and warm-started by ``up`` and never written after; a ``model.source``
model from its conversion cache, converted again if the cache is gone; ``model.path`` as configured) with the
run's trainer settings and seed, on one rank. It reads the batches the run trained from the retained ``batches``
topic (``streamforge/runlog.py`` reopens the run's log), in the order of the trainer's ledger
(``<run_dir>/trainer/ledger.jsonl``), trains them one step each, and compares each step's ``loss`` and
``grad_norm`` with the original ``<run_dir>/metrics.jsonl``.

Before training anything every batch is located on the topic (one pass over it); batches that are gone (deleted,
or past the topic's retention) are named with their steps (``BatchesGone``) and nothing is trained. The batches are
then read in ledger order, sequentially per partition (the trainer consumed each partition in offset order).

Determinism: on CPU in fp32, one rank, the step is a function of the weights, the optimizer state and the batch
(no dropout, no sampling); the replay uses the run's ``trainer.seed`` and ``trainer.threads`` (0: torch's default,
one thread per core, which matches the original run on the same machine: a different thread count changes the
order of floating-point reductions). Checkpoint restarts of the original trainer do not break it (a checkpoint
holds the exact weights and optimizer state). ``identical``: every compared step's loss within ``tolerance``
(1e-6) and its grad norm within ``tolerance`` relative to the original.

``loss``: replay the same batches under another loss (and its default arguments, or ``loss_args``): an off-policy
comparison on identical data; the differences then measure how the two losses' updates part, not reproducibility.
Output: ``<out>/metrics.jsonl`` (a row per step: ``step``, ``batch_id``, ``loss``, ``orig_loss``, ``grad_norm``,
``orig_grad_norm``, the step's other metrics) and ``<out>/replay.json`` (the summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson

from topics.errors import ConfigError, StreamforgeError

log = logging.getLogger("streamforge.replay")

TOLERANCE = 1e-6


class BatchesGone(StreamforgeError):
    """Batches the ledger names are no longer on the ``batches`` topic; ``missing``: ``[(step, batch_id)]``."""

    def __init__(self, topic: str, missing: list[tuple[int, str]]) -> None:
        shown = ", ".join(f"step {s}: {b}" for s, b in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        super().__init__(f"{len(missing)} trained batches are gone from {topic} (deleted, or past its retention: "
                         f"topics.retention_ms / retention_bytes): {shown}{more}")
        self.topic = topic
        self.missing = missing


def initial_model(config: Any) -> Path:
    """The model the run's trainer started from (module docstring); rebuilt the way ``up`` built it if a tiny
    model's directory is gone (same seed, same warm start)."""
    from models.tiny_model import ensure_model

    m = config.model
    target = config.run_dir / "model"
    if not m.path and not m.source and m.warmstart_task and not (target / "config.json").exists():
        from models.tiny_model import build_tiny_model
        from models.warmstart import warm_start

        log.warning("%s is gone: building the tiny model again and warm-starting it (seed %d)", target,
                    config.run.seed)
        build_tiny_model(target, seed=config.run.seed)
        warm_start(target, m.warmstart_task, seed=config.run.seed, target_accuracy=m.warmstart_accuracy)
        return target
    return Path(ensure_model(m.path, config.run_dir, seed=config.run.seed, source=m.source, cache_dir=m.cache_dir))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return out


def _engine(config: Any, model_dir: Path, out: Path, loss: str, loss_args: dict[str, Any] | None) -> Any:
    import torch

    from consumers.engine import TrainEngine
    from consumers.parallel import Dist

    tcfg = config.trainer
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    same_loss = not loss or loss == tcfg.loss
    tcfg = dataclasses.replace(tcfg, world_size=1, tp=1, loss=loss or tcfg.loss,
                               loss_args=dict(loss_args if loss_args is not None else
                                              (tcfg.loss_args if same_loss else {})))
    return TrainEngine(tcfg, model_dir=model_dir, run_dir=out, d=Dist(), max_seq_len=config.model.max_seq_len,
                       temperature=config.generator.temperature, max_completion_length=config.generator.max_tokens)


def _diff(a: Any, b: Any, *, relative: bool = False) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if (a == b or (math.isnan(a) and math.isnan(b))) else math.inf
    d = abs(a - b)
    return d / max(1.0, abs(b)) if relative else d


async def replay(config: Any, *, steps: int = 0, out: Path | None = None, loss: str = "",
                 loss_args: dict[str, Any] | None = None, tolerance: float = TOLERANCE,
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Replay the run of ``config`` (its brokers reachable: ``runlog.reopen``); see the module docstring.
    ``steps``: the first N ledger steps (0 = all). Returns the summary (the CLI's last line)."""
    from consumers.ledger import JsonlAppender, Ledger
    from streamforge.runlog import locate, records_at
    from topics.schemas import Batch

    run_dir = config.run_dir
    if config.trainer.mode != "rl":
        raise ConfigError("trainer.mode", "replay re-trains RL batches (the batches topic); this run trained SFT")
    ledger = Ledger.read(run_dir)
    if not ledger:
        raise StreamforgeError(f"run {run_dir}: no trainer ledger ({run_dir / 'trainer' / 'ledger.jsonl'})")
    ledger = ledger[:steps] if steps > 0 else ledger
    for row in ledger:
        if len(row.get("batch_ids", [])) != 1:
            raise StreamforgeError(f"ledger step {row['step']} names {len(row.get('batch_ids', []))} batches, not 1")
    if config.trainer.world_size > 1:
        log.warning("the run trained on %d ranks; a replay runs on one, so it agrees only to rounding",
                    config.trainer.world_size)
    original = {int(r["step"]): r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r}
    topic = config.names.batches
    wanted = {row["batch_ids"][0] for row in ledger}
    where = await locate(config.kafka, topic, wanted, expect=Batch)
    missing = [(int(row["step"]), row["batch_ids"][0]) for row in ledger if row["batch_ids"][0] not in where]
    if missing:
        raise BatchesGone(topic, missing)
    plan = [(*where[row["batch_ids"][0]], row["batch_ids"][0]) for row in ledger]
    out = Path(out) if out else run_dir / (f"replay-{loss}" if loss and loss != config.trainer.loss else "replay")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    model_dir = await asyncio.to_thread(initial_model, config)
    engine = await asyncio.to_thread(_engine, config, model_dir, out, loss, loss_args)
    rows = JsonlAppender(out / "metrics.jsonl")
    max_loss = max_grad = 0.0
    compared = done = 0
    t0 = time.monotonic()
    try:
        async with contextlib.aclosing(records_at(config.kafka, topic, plan, expect=Batch)) as batches:
            async for batch in _gone_as(batches, ledger):
                row = ledger[done]
                metrics = await asyncio.to_thread(engine.step, batch)
                done += 1
                orig = original.get(int(row["step"]), {})
                loss_diff, grad_diff = _diff(metrics.get("loss"), orig.get("loss")), _diff(
                    metrics.get("grad_norm"), orig.get("grad_norm"))
                if loss_diff is not None:
                    compared += 1
                    max_loss = max(max_loss, loss_diff)
                if grad_diff is not None:
                    max_grad = max(max_grad, grad_diff)
                line = {"step": int(row["step"]), "batch_id": batch.batch_id, "loss": metrics.get("loss"),
                        "orig_loss": orig.get("loss"), "grad_norm": metrics.get("grad_norm"),
                        "orig_grad_norm": orig.get("grad_norm"), "loss_diff": loss_diff, "grad_norm_diff": grad_diff,
                        **{k: v for k, v in metrics.items() if k not in ("loss", "grad_norm")}}
                rows.append(line)
                if on_step is not None:
                    on_step(line)
    finally:
        rows.close()
    grad_rel = max((_diff(r.get("grad_norm"), r.get("orig_grad_norm"), relative=True) or 0.0)
                   for r in read_jsonl(out / "metrics.jsonl")) if done else 0.0
    result = {"replay": str(run_dir), "steps": done, "max_loss_diff": max_loss, "max_grad_norm_diff": max_grad,
              "identical": bool(done and compared == done and max_loss <= tolerance and grad_rel <= tolerance),
              "loss": loss or config.trainer.loss, "compared_steps": compared, "out": str(out),
              "seconds": round(time.monotonic() - t0, 3)}
    (out / "replay.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result


async def _gone_as(batches: AsyncIterator[Any], ledger: list[dict[str, Any]]) -> AsyncIterator[Any]:
    """``batches`` with a ``RecordGone`` (deleted after it was located) told as ``BatchesGone`` with its step."""
    from streamforge.runlog import RecordGone

    try:
        async for batch in batches:
            yield batch
    except RecordGone as exc:
        step = next((int(r["step"]) for r in ledger if r["batch_ids"][0] == exc.ident), 0)
        raise BatchesGone(exc.topic, [(step, exc.ident)]) from None

