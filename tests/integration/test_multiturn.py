"""Multi-turn episodes through the system: the generator role (real vLLM CPU engine) plays episodes against real
environment replicas (``streamforge run env``, found on NATS) and produces them to Kafka.

* every episode's model tokens carry their logprobs and version, the environment's are masked (-1, 0), each
  episode stayed on one replica (its log), and the batch the buffer builds from them trains a step whose loss
  mask is the episodes' own;
* a replica SIGKILLed mid-run: its episodes restart on the other replica, every episode of every prompt arrives
  exactly once, nothing is dead-lettered, and no gap between episodes exceeds the failover bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from test_generator import Tail, stop_role

from buffer.policies import build_batch, score_group
from consumers.config import TrainerConfig
from consumers.losses import make_loss
from consumers.model import load_policy
from consumers.optim import build_optimizer
from consumers.step import batch_inputs, rl_step
from envs.routing import RemoteEnvSession
from helpers.replicas import start_env_replica, stop
from models.tiny_model import build_tiny_model, load_tokenizer
from producers.engine import Engine
from runtime.services import ServiceDirectory
from streamforge.roles import build_role
from topics import codec
from topics.nats import connect
from topics.schemas import Episode

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(240)]

FAILOVER_S = 10.0  # env.step_timeout_s 5 + env.health_timeout_s 1.5, with room for a loaded CPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
async def engine(model_dir):
    eng = Engine(str(model_dir), max_model_len=128, seed=0)
    await eng.start()
    yield eng
    await eng.stop()


def configure(cfg, model_dir: Path, *, prompts: int, group_size: int):
    """The count environment (done after 3 turns, any text is an action) played from a local env: source."""
    env = dataclasses.replace(cfg.env, name="count", impl="helpers.countenv:CountEnv", heartbeat_s=0.5,
                              health_timeout_s=1.5, step_timeout_s=5.0, max_turns=3, max_turn_tokens=6,
                              max_restarts=2)
    gen = dataclasses.replace(cfg.generator, prompt_source="local", group_size=group_size, max_tokens=90,
                              max_concurrent_prompts=4, groups_per_step=0.0, generator_id="g-multiturn")
    feeder = dataclasses.replace(cfg.feeder, source="env:count", num_prompts=prompts)
    return dataclasses.replace(cfg, env=env, generator=gen, feeder=feeder,
                               model=dataclasses.replace(cfg.model, path=str(model_dir)))


async def replicas_up(cfg, n: int) -> tuple[list, object, object]:
    logs = Path(cfg.run.run_dir) / "logs"
    procs = [start_env_replica(cfg, f"count-{c}", logs / f"count-{c}.log") for c in "ab"[:n]]
    nc = await connect(cfg.nats, name="test-multiturn")
    directory = ServiceDirectory(nc, cfg.names)
    await directory.start()
    await directory.wait_for("count", n, timeout_s=90)
    return procs, nc, directory


async def test_multiturn_episodes_from_real_replicas_train_with_their_mask(run_config, engine, model_dir):
    cfg = configure(run_config, model_dir, prompts=3, group_size=4)
    procs, nc, directory = await replicas_up(cfg, 2)
    try:
        role = build_role("generator", cfg, engine=engine)
        stop_event = asyncio.Event()
        task = asyncio.create_task(role.serve(stop_event))
        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            records = await tail.until(lambda rs: len(rs) >= 12, 120, "12 episodes", task)
        await stop_role(stop_event, task)
    finally:
        await directory.stop()
        await nc.close()
        stop(procs)
    tok = load_tokenizer(model_dir)
    episodes = [r.value for r in records]
    assert role.stats["dead_lettered"] == 0
    logs = {rid: (Path(cfg.run.run_dir) / "logs" / f"{rid}.log").read_text(errors="replace")
            for rid in ("count-a", "count-b")}
    for ep in episodes:
        mask, versions = ep.token_mask, ep.token_versions
        assert ep.env_name == "count" and ep.turns == 3 and ep.finish_reason == "done", ep.finish_reason
        assert ep.reward == 3.0 and ep.turn_rewards.tolist() == [1.0, 1.0, 1.0]  # CountEnv: 1 a turn
        assert (versions[mask == 1] == 0).all() and (versions[mask == 0] == -1).all()
        assert (ep.logprobs[mask == 0] == 0).all() and (ep.logprobs[mask == 1] < 0).all()
        env_text = tok.decode(ep.response_tokens[(mask == 0)].tolist())
        assert re.fullmatch(r"turn 1: .*turn 2: .*", env_text, re.DOTALL), env_text  # the last observation not appended
        assert tok.decode(ep.prompt_tokens.tolist(), skip_special_tokens=True) == f"episode {ep.episode_id} starts"
        # sticky: every message of the episode's session is in its replica's log, none in the other's
        mine = f"episode={ep.episode_id}\n"
        other = "count-b" if ep.env_replica == "count-a" else "count-a"
        assert logs[ep.env_replica].count(mine) == 5 and mine not in logs[other]  # reset, 3 steps, close
    # the buffer's batch of one group, through the wire, trains one step on the model's tokens only
    group = score_group(episodes[0].group_id, [e for e in episodes if e.group_id == episodes[0].group_id],
                        latest_version=0, max_policy_lag=4, filter_zero_variance=False).kept
    batch = codec.decode(codec.encode(build_batch([group])))
    inputs = batch_inputs(batch)
    for i, ep in enumerate(group.episodes):
        p, r = len(ep.prompt_tokens), len(ep.response_tokens)
        assert inputs.mask[i, p:p + r].tolist() == ep.token_mask.tolist() and inputs.mask[i, :p].sum() == 0
    policy = load_policy(model_dir, max_seq_len=128)
    opt, sched = build_optimizer(policy.model, TrainerConfig(lr=1e-4))
    metrics = rl_step(policy.model, opt, sched, make_loss("grpo"), inputs)
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] == sum(int(e.token_mask.sum()) for e in group.episodes)


async def test_a_replica_killed_mid_run_restarts_its_episodes_on_the_other(run_config, engine, model_dir,
                                                                          monkeypatch):
    cfg = configure(run_config, model_dir, prompts=8, group_size=4)
    procs, nc, directory = await replicas_up(cfg, 2)
    expected = {f"count-0-{i}/{j}" for i in range(8) for j in range(4)}
    # count-a is killed as one of its sessions takes a step, so it dies with that session open (killing it at a
    # moment chosen from outside can find all its sessions ended: then nothing restarts). The step itself is real.
    kill: dict[str, float | bool] = {"armed": False, "at": 0.0}
    real_step = RemoteEnvSession.step

    async def step(session: RemoteEnvSession, action: str, **kw):
        if kill["armed"] and not kill["at"] and session.replica_id == "count-a":
            procs[0].send_signal(signal.SIGKILL)
            kill["at"] = time.monotonic()
        return await real_step(session, action, **kw)

    monkeypatch.setattr(RemoteEnvSession, "step", step)
    try:
        role = build_role("generator", cfg, engine=engine)
        stop_event = asyncio.Event()
        task = asyncio.create_task(role.serve(stop_event))
        arrivals: list[float] = []

        def seen(rs: list) -> bool:
            arrivals.extend([time.monotonic()] * (len(rs) - len(arrivals)))
            return len(rs) >= len(expected)

        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            await tail.until(lambda rs: seen(rs) or len(rs) >= 4, 120, "the first episodes", task)
            kill["armed"] = True
            records = await tail.until(seen, 180, "every episode", task)
        await stop_role(stop_event, task)
    finally:
        await directory.stop()
        await nc.close()
        stop(procs)
    assert kill["at"], "no session stepped on count-a after the first episodes: it was never killed"
    killed_at = float(kill["at"])
    ids = [r.value.episode_id for r in records]
    assert sorted(ids) == sorted(expected)  # nothing lost, nothing twice
    assert role.stats["dead_lettered"] == 0
    restarted = [r.value for r in records if r.value.env_restarts]
    assert restarted and all(ep.env_replica == "count-b" for ep in restarted)
    assert role.pipeline.counts["restarts"] == sum(ep.env_restarts for ep in restarted)
    after = [killed_at] + [t for t in arrivals if t >= killed_at]
    assert max(np.diff(after)) < FAILOVER_S, np.diff(after)  # the generator never stalled on the dead replica
