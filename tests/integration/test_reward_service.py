"""Reward services as real processes (``streamforge run reward``) scoring a generator's ``remote:<service>`` rewards
through the ``RewardSet``: the example toy judge agrees with the local ``toy`` reward; rows that raise, are not
numbers or run late fail alone; no replica fails every row; bad config names its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.replicas import ENV, ROOT, start_role, stop
from producers.rewards import RewardFailed, RewardSet
from runtime.services import ServiceDirectory
from topics.nats import connect
from topics.schemas import Prompt

pytestmark = pytest.mark.timeout(120)

BEATS = ["--reward.heartbeat_s=0.5", "--reward.health_timeout_s=1.5"]


async def test_remote_rewards_score_groups_through_reward_replicas(run_config) -> None:
    logs = Path(run_config.run.run_dir) / "logs"
    procs = [start_role("reward", run_config, logs / "judge-0.log", "--reward.name=judge", "--reward.replica_id=judge-0",
                        "--reward.impl=services.reward_examples:toy_judge", *BEATS),
             start_role("reward", run_config, logs / "flaky-0.log", "--reward.name=flaky", "--reward.replica_id=flaky-0",
                        "--reward.impl=helpers.rewards:flaky_judge", "--reward.timeout_s=1.0", *BEATS)]
    nc = await connect(run_config.nats, name="test-rewards")
    directory = ServiceDirectory(nc, run_config.names)
    sets: list[RewardSet] = []
    try:
        await directory.start()
        await directory.wait_for("judge", 1, timeout_s=60)
        await directory.wait_for("flaky", 1, timeout_s=60)
        assert directory.get("judge", "judge-0").beat.kind == "reward"
        both = RewardSet(["toy", "remote:judge"], [1.0, 2.0], timeout_s=10)
        flaky = RewardSet(["remote:flaky"], timeout_s=10)
        nobody = RewardSet(["remote:nobody"], timeout_s=2)
        sets += [both, flaky, nobody]
        for s in sets:
            s.bind(directory)
        prompt = Prompt(prompt_id="p1", task="addmod10", text="3+4=", answer="7", metadata={"level": 1})
        texts = ["7", "3", "7 and more", "", "\u00e9\u6f22"]
        scored = await both.score_group(prompt, texts)
        for text, s in zip(texts, scored):  # one request per group; the served toy judge agrees with the local toy
            assert not isinstance(s, RewardFailed), s
            assert s.components["judge"] == s.components["toy"] and s.reward == 3 * s.components["toy"], (text, s)
        assert [s.components["judge"] for s in scored][:2] == [1.0, 0.0]
        out = await flaky.score_group(prompt, ["ok", "raise", "nan", "slow", "four"])
        assert [o.reward for o in (out[0], out[4])] == [2.0, 4.0]
        assert [o.reason for o in out[1:4]] == ["reward_error", "reward_error", "reward_timeout"], out
        assert "cannot read this" in out[1].detail and "not a finite number" in out[2].detail
        missing = await nobody.score_group(prompt, ["a", "b"])
        assert all(isinstance(m, RewardFailed) and "ServiceUnavailable" in m.detail for m in missing)
        assert all(p.poll() is None for p in procs)  # the replicas serve on
    finally:
        for s in sets:
            s.close()
        await directory.stop()
        await nc.close()
        stop(procs)


@pytest.mark.parametrize(("args", "key"), [
    (["--reward.name=judge"], "reward.impl"),
    (["--reward.impl=services.reward_examples:toy_judge"], "reward.name"),
    (["--reward.name=judge", "--reward.impl=services.reward_examples:nosuch"], "reward.impl"),
    (["--reward.name=judge", "--reward.impl=x:y", "--reward.health_timeout_s=0.5"], "reward.health_timeout_s"),
])
def test_run_reward_with_bad_config_fails_naming_the_key(tmp_path: Path, args: list[str], key: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "streamforge", "run", "reward", "--run.run_dir=" + str(tmp_path),
                           "--nats.url=nats://127.0.0.1:1", *args], capture_output=True, text=True, timeout=60,
                          env=ENV, cwd=ROOT)
    assert proc.returncode != 0
    assert f"config key '{key}'" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
