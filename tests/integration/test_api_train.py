"""``streamforge.train`` (the notebook API) end to end on the demo task: a dataset of addmod10 rows scored by a
reward in TRL's batch shape, through every role (brokers, feeder, generator, buffer, trainer, as ``up`` runs them)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from helpers.audits import assert_nothing_lost
from streamforge import RLConfig, train
from streamforge.plots import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TESTS = Path(__file__).resolve().parents[1]


def addmod10_rows(n: int) -> list[dict[str, str]]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"id": f"am-{i}", "prompt": f"{a}+{b}=", "answer": str((a + b) % 10), "level": "easy"})
    return rows


def test_train_a_dataset_with_a_trl_batch_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the generator processes import helpers.rewards
    for k in ("STREAMFORGE_KAFKA_BOOTSTRAP", "STREAMFORGE_NATS_URL"):
        monkeypatch.delenv(k, raising=False)
    from helpers.rewards import addmod10_batch

    cfg = RLConfig(output_dir=str(tmp_path / "run"), max_completion_length=2, max_steps=12, prompts_per_step=4,
                   extra={"model.warmstart_task": "addmod10", "trainer.checkpoint_every": 100,
                          "trainer.publish_busy": "skip", "up.lag_every_s": 0})
    result = train(cfg, reward_functions=[addmod10_batch], dataset=addmod10_rows(200), budget_s=420)
    assert result.exit_code == 0, (result.run_dir / "logs" / "generator-0.log").read_text()[-3000:]
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert result.last_metrics["step"] == 12
    assert any(r["reward_mean"] > 0 for r in rows)  # the batch reward scored real completions
    assert_nothing_lost(result.audit)
    assert result.audit["dropped"].get("malformed", 0) == 0  # nothing dead-lettered for want of a reward


def test_a_dataset_without_rewards_is_refused_at_call_time(tmp_path: Path) -> None:
    from topics.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        train(RLConfig(output_dir=str(tmp_path / "run")), dataset=addmod10_rows(4))
    assert err.value.key == "reward_functions"
    assert not (tmp_path / "run").exists()  # nothing started
