"""The generator role with the real vLLM CPU engine and real brokers.

One engine serves the whole module (starting one takes 15-25 s). Proven here:
* episodes for a set of prompts appear with the right group sizes, ids, tokens, logprobs, versions and rewards,
  and the prompts' offsets are committed;
* the behaviour logprobs match a transformers fp32 forward pass on the same tokens (mean abs < 1e-4);
* a reward that raises or times out sends that Episode to dead-letter with the reason; the generator goes on;
* a generator process SIGKILLed mid-run leaves its unfinished prompts to another generator: none is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Self

import numpy as np
import orjson
import pytest

from models.tasks import TASKS
from models.tiny_model import build_tiny_model
from producers.engine import Engine
from producers.feeder import GroupOffsets
from producers.sources import toy_prompts
from streamforge.config import dump_config
from streamforge.roles import build_role
from topics import codec
from topics.admin import read_topic
from topics.kafka import Consumer, Producer, TopicPartition
from topics.schemas import DeadLetter, Episode, Prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


# -- rewards used by the tests (resolved by import path, as a user's would be) ------------------------------

def scripted_reward(prompt: Prompt, response_text: str) -> float:
    """Raises, hangs or scores, as the prompt's metadata says."""
    action = prompt.metadata.get("reward", "")
    if action == "raise":
        raise RuntimeError("scripted failure")
    if action == "hang":
        time.sleep(1.0)
    return 0.25


def slow_reward(prompt: Prompt, response_text: str) -> float:
    time.sleep(1.0)
    return 0.0


# -- fixtures and helpers -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
async def engine(model_dir):
    eng = Engine(str(model_dir), max_model_len=128, seed=0)
    await eng.start()
    yield eng
    await eng.stop()


def configure(cfg, model_dir: Path, **generator):
    generator.setdefault("groups_per_step", 0.0)  # no trainer publishes here: no quota unless a test sets one
    gen = dataclasses.replace(cfg.generator, **generator)
    return dataclasses.replace(cfg, generator=gen, model=dataclasses.replace(cfg.model, path=str(model_dir)))


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01".encode()


async def feed(cfg, prompts: list[Prompt]) -> None:
    """Produce the prompts, as the feeder would, each with a W3C trace context in its headers."""
    async with Producer(cfg.kafka) as producer:
        futs = [await producer.enqueue(cfg.names.prompts, p, key=p.prompt_id, headers=[("traceparent", TRACEPARENT)])
                for p in prompts]
        await asyncio.gather(*futs)


class Tail:
    """Reads a topic from the start, accumulating decoded records (manual assignment: no group join)."""

    def __init__(self, cfg, topic: str, expect: type) -> None:
        self.consumer = Consumer(cfg.kafka, [], group_id=None, expect=expect)
        self.topic = topic
        self.records: list = []

    async def __aenter__(self) -> Self:
        await self.consumer.start()
        parts = None
        while not parts:
            parts = self.consumer.raw.partitions_for_topic(self.topic)
            if not parts:
                await self.consumer.raw.topics()
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self.consumer.raw.assign(tps)
        for tp in tps:
            self.consumer.seek(tp, 0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.consumer.stop()

    async def until(self, predicate, timeout_s: float, what: str, task: asyncio.Task | None = None) -> list:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.records):
            if task is not None and task.done():
                task.result()
                raise AssertionError(f"the generator stopped before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what} ({len(self.records)} records)")
            self.records.extend(await self.consumer.getmany(timeout_ms=200))
        return self.records


async def committed_offsets(cfg) -> dict[int, int]:
    reader = GroupOffsets(cfg.kafka, cfg.names.generators_group, cfg.names.prompts)
    await reader.start()
    try:
        return await reader.read()
    finally:
        await reader.stop()


def prompt_partitions(records) -> dict[int, int]:
    """Highest offset + 1 per partition of the prompts we fed (from the tail of the prompts topic)."""
    out: dict[int, int] = {}
    for r in records:
        out[r.partition] = max(out.get(r.partition, 0), r.offset + 1)
    return out


async def stop_role(stop: asyncio.Event, task: asyncio.Task) -> None:
    stop.set()
    await asyncio.wait_for(task, 60)


# -- tests ------------------------------------------------------------------------------------------------------

async def test_episodes_groups_tokens_logprobs_rewards(run_config, engine, model_dir):
    from runtime.metrics import configure_metrics

    cfg = configure(run_config, model_dir, group_size=4, max_tokens=8, rewards=["toy"], generator_id="g1",
                    metrics_every_s=0.5)
    prompts = [p for _, p in zip(range(6), toy_prompts("addmod10", seed=11))]
    await feed(cfg, prompts)
    configure_metrics("generator-g1", cfg.run_dir, ["jsonl"])
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            records = await tail.until(lambda rs: len(rs) >= 24, 90, "24 episodes", task)
        await stop_role(stop, task)
    finally:
        configure_metrics("", None, [])

    # metrics rows (record_metric): rates, counts and the engine's version; the last one, at drain, is final
    rows = [orjson.loads(x) for x in (cfg.run_dir / "metrics-generator-g1.jsonl").read_bytes().splitlines()]
    assert rows and rows[-1]["generator/episodes"] == 24 and rows[-1]["generator/prompts"] == 6
    assert rows[-1]["generator/policy_version"] == 0 and rows[-1]["generator/in_flight"] == 0
    assert any(r["generator/tokens_per_s"] > 0 for r in rows)
    assert any("generator/reward_mean" in r and 0 <= r["generator/reward_mean"] <= 1 for r in rows)
    assert any(r.get("generator/response_tokens", 0) >= 1 for r in rows)

    episodes = [r.value for r in records]
    assert all(r.error is None for r in records)
    by_group: dict[str, list[Episode]] = defaultdict(list)
    for r, ep in zip(records, episodes):
        assert r.key == ep.group_id  # keyed by group so a group lands in one partition
        assert r.headers["traceparent"].split(b"-")[1].decode() == TRACE_ID  # the prompt's trace continues
        by_group[ep.group_id].append(ep)
    assert set(by_group) == {p.prompt_id for p in prompts}
    tok = engine.tokenizer
    for p in prompts:
        group = by_group[p.prompt_id]
        assert sorted(e.episode_id for e in group) == [f"{p.prompt_id}/{i}" for i in range(4)]
        for ep in group:
            assert ep.group_size == 4 and ep.generator_id == "g1" and ep.task == "addmod10"
            assert list(ep.prompt_tokens) == tok(p.text)["input_ids"]
            n = len(ep.response_tokens)
            assert 1 <= n <= 8 and len(ep.logprobs) == n and len(ep.token_versions) == n
            assert (ep.token_versions == 0).all() and ep.policy_version == 0
            assert np.isfinite(ep.logprobs).all() and (ep.logprobs <= 0).all()
            assert ep.finish_reason in ("length", "stop")
            assert ep.finish_reason == "stop" or n == 8
            assert ep.response_text == tok.decode(list(ep.response_tokens), skip_special_tokens=True)
            assert ep.reward == TASKS["addmod10"].score(ep.response_text, p.answer)
            assert ep.reward_components == {"toy": ep.reward}
            assert ep.timings["generate_s"] > 0 and "reward_s" in ep.timings

    # committed: every prompt offset, after its episodes were acked
    fed = await read_topic(cfg.kafka, cfg.names.prompts, expect=Prompt)
    assert await committed_offsets(cfg) == prompt_partitions(fed)
    assert role.stats["prompts"] == 6 and role.stats["episodes"] == 24

    # behaviour logprobs == a transformers fp32 forward on the same tokens
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors = []
    with torch.no_grad():
        for ep in episodes:
            ids = torch.tensor(np.concatenate([ep.prompt_tokens, ep.response_tokens]).astype(np.int64))[None]
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            p = len(ep.prompt_tokens)
            ref = logp[p - 1:-1].gather(1, ids[0, p:, None])[:, 0].numpy()
            errors.append(np.abs(ref - ep.logprobs))
    err = np.concatenate(errors)
    print(f"logprob agreement vs transformers: mean abs {err.mean():.2e}, max abs {err.max():.2e}")
    assert err.mean() < 1e-4


async def test_local_source_mode(run_config, engine, model_dir):
    """``prompt_source=local``: the feeder's source runs in-process; episodes still go to the topic."""
    cfg = configure(run_config, model_dir, prompt_source="local", group_size=2, max_tokens=4, rewards=["toy"])
    cfg = dataclasses.replace(cfg, feeder=dataclasses.replace(cfg.feeder, source="toy:reverse", num_prompts=3))
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    async with Tail(cfg, cfg.names.episodes, Episode) as tail:
        records = await tail.until(lambda rs: len(rs) >= 6, 60, "6 episodes", task)
    await stop_role(stop, task)
    assert sorted({r.value.group_id for r in records}) == [f"reverse-0-{i}" for i in range(3)]
    assert role.consumer is None and role.stats["commits"] == 0


async def test_reward_failures_go_to_dead_letter(run_config, engine, model_dir):
    cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, generator_id="g2", reward_timeout_s=0.3,
                    rewards=["toy", "tests.integration.test_generator:scripted_reward"])
    prompts = [Prompt(prompt_id=f"p{i}", task="addmod10", text=f"{i}+1=", answer=str((i + 1) % 10),
                      metadata={"reward": action}) for i, action in enumerate(["", "raise", "hang", ""])]
    await feed(cfg, prompts)
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    async with Tail(cfg, cfg.names.dead_letter, DeadLetter) as dead:
        letters = await dead.until(lambda rs: len(rs) >= 4, 90, "4 dead letters", task)
    async with Tail(cfg, cfg.names.episodes, Episode) as tail:
        records = await tail.until(lambda rs: len(rs) >= 4, 60, "4 good episodes", task)
    fed = await read_topic(cfg.kafka, cfg.names.prompts, expect=Prompt)
    deadline = time.monotonic() + 30
    while await committed_offsets(cfg) != prompt_partitions(fed):  # the generator kept going to the end
        assert time.monotonic() < deadline, "offsets of the failed prompts were not committed"
        await asyncio.sleep(0.2)
    await stop_role(stop, task)

    assert sorted(r.value.group_id for r in records) == ["p0", "p0", "p3", "p3"]
    assert all(r.value.reward_components["scripted_reward"] == 0.25 for r in records)
    reasons = defaultdict(list)
    for r in letters:
        letter = r.value
        assert letter.source == cfg.names.episodes and letter.role == "generator:g2"
        ep = codec.decode(letter.value, expect=Episode)  # the Episode, as it would have been sent
        assert len(ep.response_tokens) == len(ep.logprobs) > 0
        reasons[ep.group_id].append((letter.reason, letter.detail))
    assert sorted(reasons) == ["p1", "p2"]
    assert all(r == "reward_error" and "scripted failure" in d for r, d in reasons["p1"])
    assert all(r == "reward_timeout" and "0.3 s" in d for r, d in reasons["p2"])


async def test_remote_reward_is_scored_by_a_reward_replica(run_config, engine, model_dir):
    """``remote:judge`` in ``generator.rewards``: the generator builds its service directory and each group is scored
    by a real reward replica (``streamforge run reward`` serving ``toy_judge``, which scores as ``toy`` does)."""
    from helpers.replicas import start_role, stop
    from runtime.services import ServiceDirectory
    from topics.nats import connect

    replica = start_role("reward", run_config, run_config.run_dir / "logs" / "judge-0.log", "--reward.name=judge",
                         "--reward.replica_id=judge-0", "--reward.impl=services.reward_examples:toy_judge",
                         "--reward.heartbeat_s=0.5", "--reward.health_timeout_s=1.5")
    nc = await connect(run_config.nats, name="test-remote-reward")
    directory = ServiceDirectory(nc, run_config.names)
    try:
        await directory.start()
        await directory.wait_for("judge", 1, timeout_s=60)  # registered: the generator's first group finds it
        cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, generator_id="g-remote",
                        rewards=["toy", "remote:judge"], reward_weights=[1.0, 2.0])
        prompts = [p for _, p in zip(range(4), toy_prompts("addmod10", seed=5))]
        await feed(cfg, prompts)
        role = build_role("generator", cfg, engine=engine)
        stop_event = asyncio.Event()
        task = asyncio.create_task(role.serve(stop_event))
        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            records = await tail.until(lambda rs: len(rs) >= 8, 60, "8 episodes", task)
        assert role.services is not None and role.services.get("judge", "judge-0") is not None
        await stop_role(stop_event, task)
    finally:
        await directory.stop()
        await nc.close()
        stop([replica])
    answers = {p.prompt_id: p.answer for p in prompts}
    assert sorted({r.value.group_id for r in records}) == sorted(answers)
    for r in records:
        ep = r.value
        toy = TASKS["addmod10"].score(ep.response_text, answers[ep.group_id])
        assert ep.reward_components == {"toy": toy, "judge": toy}, ep.reward_components  # the replica's score
        assert ep.reward == 3 * toy
    assert role.stats["dead_lettered"] == 0 and replica.returncode == 0  # the replica drained and exited cleanly


async def test_graceful_stop_finishes_and_commits_prompts_in_flight(run_config, engine, model_dir):
    """``stop`` while prompts are in flight: drain finishes them (Episodes acked) and commits their offsets."""
    cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, max_concurrent_prompts=4, generator_id="g4",
                    rewards=["tests.integration.test_generator:slow_reward"])
    prompts = [p for _, p in zip(range(4), toy_prompts("reverse", seed=8))]
    await feed(cfg, prompts)
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    deadline = time.monotonic() + 60
    while role.offsets.in_flight() < 4:
        assert time.monotonic() < deadline and not task.done(), "the prompts were not taken"
        await asyncio.sleep(0.02)
    assert role.stats["episodes"] == 0  # every reward still sleeping
    await stop_role(stop, task)
    assert role.stats["prompts"] == 4 and role.stats["episodes"] == 8
    fed = await read_topic(cfg.kafka, cfg.names.prompts, expect=Prompt)
    assert await committed_offsets(cfg) == prompt_partitions(fed)
    episodes = await read_topic(cfg.kafka, cfg.names.episodes, expect=Episode)
    assert sorted(r.value.episode_id for r in episodes) == sorted(f"{p.prompt_id}/{i}" for p in prompts for i in (0, 1))


async def test_sigkilled_generator_leaves_no_prompt_lost(run_config, engine, model_dir, tmp_path):
    import psutil

    overrides = {"group_size": 2, "max_tokens": 6, "max_concurrent_prompts": 2}
    # the module's engine pins its worker to core 0; the victim's engine runs on the other core, the model in the
    # engine core's own process (generator.vllm_executor: uni), and the victim's own process moves to every core
    # once the engine has started (generator.loop_cpus): one SIGKILL of the group ends both
    every_core = sorted(os.sched_getaffinity(0))
    cfg = configure(run_config, model_dir, **overrides, generator_id="victim", kv_cache_gib=1.0,
                    cpus=str(every_core[-1]), vllm_executor="uni", loop_cpus=",".join(map(str, every_core)),
                    rewards=["tests.integration.test_generator:slow_reward"])
    cfg = dataclasses.replace(cfg, kafka=dataclasses.replace(cfg.kafka, session_timeout_ms=6000,
                                                             heartbeat_interval_ms=1000),
                              telemetry=dataclasses.replace(cfg.telemetry, traces="none"))
    prompts = [p for _, p in zip(range(12), toy_prompts("addmod10", seed=5))]
    await feed(cfg, prompts)
    config_path = tmp_path / "victim.yaml"
    config_path.write_text(dump_config(cfg))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    env = {k: v for k, v in env.items() if not k.startswith("STREAMFORGE_")}
    log_path = tmp_path / "victim.log"
    with open(log_path, "wb") as log_file:  # noqa: ASYNC230 - a local file, once
        victim = subprocess.Popen(
            [sys.executable, "-m", "streamforge", "run", "generator", "--config", str(config_path)],
            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            await tail.until(lambda rs: len(rs) >= 1, 180, "the victim's first episode")
            engine_core = [p for p in psutil.Process(victim.pid).children() if p.name().startswith("VLLM::")]
            assert [p.cpu_affinity() for p in engine_core] == [[every_core[-1]]]  # generator.cpus
            assert psutil.Process(victim.pid).cpu_affinity() == every_core  # generator.loop_cpus
            os.killpg(victim.pid, signal.SIGKILL)  # the generator and its vLLM engine processes
            victim.wait(10)
            at_kill = {r.value.episode_id for r in tail.records}
            committed_at_kill = await committed_offsets(cfg)
            fed = await read_topic(cfg.kafka, cfg.names.prompts, expect=Prompt)
            assert committed_at_kill != prompt_partitions(fed), "the victim finished everything before the kill"

            survivor_cfg = configure(cfg, model_dir, **overrides, generator_id="survivor", rewards=["toy"])
            role = build_role("generator", survivor_cfg, engine=engine)
            stop = asyncio.Event()
            task = asyncio.create_task(role.serve(stop))
            want = {f"{p.prompt_id}/{i}" for p in prompts for i in range(2)}
            records = await tail.until(lambda rs: want <= {r.value.episode_id for r in rs}, 120,
                                       "every prompt's episodes", task)
            deadline = time.monotonic() + 30
            while await committed_offsets(cfg) != prompt_partitions(fed):
                assert time.monotonic() < deadline, "the survivor did not commit every prompt"
                await asyncio.sleep(0.2)
            await stop_role(stop, task)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(10)

    by_gen = defaultdict(set)
    for r in records:
        by_gen[r.value.generator_id].add(r.value.group_id)
    assert by_gen["victim"] and by_gen["survivor"], dict(by_gen)
    assert "(executor uni)" in log_path.read_text()  # the in-process executor on its one core
    assert by_gen["victim"] | by_gen["survivor"] == {p.prompt_id for p in prompts}  # none lost
    # what the victim had not finished, the survivor did (episode ids are the same on redelivery); the
    # victim's last episodes may reach the tail after the kill, so "finished" is read from every record
    victim_episodes = {r.value.episode_id for r in records if r.value.generator_id == "victim"}
    finished = {p.prompt_id for p in prompts if all(f"{p.prompt_id}/{i}" in victim_episodes for i in range(2))}
    unfinished = {p.prompt_id for p in prompts} - finished
    assert {e.rsplit("/", 1)[0] for e in at_kill} <= finished | by_gen["survivor"]
    assert unfinished and unfinished <= by_gen["survivor"]
    print(f"victim produced {len(by_gen['victim'])} groups before SIGKILL; survivor {len(by_gen['survivor'])}; "
          f"{len(records) - len(want)} duplicate episodes (at-least-once)")


async def test_swap_mid_sequence_shows_in_the_token_versions(engine, model_dir):
    """``Engine.swap`` (pause keep -> load -> version -> resume): later tokens of running requests carry it."""
    from producers.engine import Sampling

    async def reload(llm) -> None:  # the same weights again: the point is the pause and the stamping
        await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})

    tokens_before = engine.tokens_out
    gen = asyncio.create_task(engine.generate(engine.tokenizer("reverse abc:")["input_ids"], 8,
                                              Sampling(max_tokens=100)))
    while engine.tokens_out == tokens_before:  # tokens are flowing
        await asyncio.sleep(0.005)
    try:
        pause_ms = await engine.swap(1, reload, mode="keep")
        completions = await asyncio.wait_for(gen, 60)
    finally:
        await engine.relabel(0)  # identical weights: later tests see version 0
    print(f"swap pause {pause_ms:.1f} ms")
    assert pause_ms > 0
    for c in completions:
        assert c.versions == sorted(c.versions) and set(c.versions) <= {0, 1}
    assert any(c.versions[0] == 0 and c.versions[-1] == 1 for c in completions), [c.versions for c in completions]


async def test_swap_rpc_is_one_engine_core_call_and_resumes_after_a_failed_load(engine, model_dir, monkeypatch):
    """``Engine.swap_rpc`` through our plugin's ``streamforge_swap`` (producers/vllm_swap.py): tokens of running
    requests carry the new version, the engine core times the pause; a load that raises leaves the version as it
    was and generation running; an engine core without the method gets the four calls of ``swap``."""
    from producers import vllm_swap
    from producers.engine import Sampling

    prompt = engine.tokenizer("reverse abc:")["input_ids"]
    tokens_before = engine.tokens_out
    gen = asyncio.create_task(engine.generate(prompt, 8, Sampling(max_tokens=100)))
    while engine.tokens_out == tokens_before:
        await asyncio.sleep(0.005)
    try:
        pause_ms, result = await engine.swap_rpc(1, "reload_weights", kwargs={"weights_path": str(model_dir)})
        completions = await asyncio.wait_for(gen, 60)
        assert engine._fused_swap and engine.version == 1
        assert set(engine.last_swap_ms) == {"pause", "load", "resume"}
        assert pause_ms == pytest.approx(sum(engine.last_swap_ms.values()))
        assert result is None  # reload_weights returns nothing
        assert any(c.versions[0] == 0 and c.versions[-1] == 1 for c in completions), [c.versions for c in completions]

        with pytest.raises(Exception, match="no_such_worker_method"):
            await engine.swap_rpc(2, "no_such_worker_method")
        assert engine.version == 1 and await engine.llm.get_weight_version() == "1"
        after = await asyncio.wait_for(engine.generate(prompt, 2, Sampling(max_tokens=4)), 30)  # resumed
        assert all(c.versions and set(c.versions) == {1} for c in after)

        monkeypatch.setattr(vllm_swap, "METHOD", "streamforge_swap_of_another_plugin")
        await engine.swap_rpc(3, "reload_weights", kwargs={"weights_path": str(model_dir)})
        assert not engine._fused_swap and engine.version == 3 and await engine.llm.get_weight_version() == "3"
    finally:
        engine._fused_swap = True
        await engine.relabel(0)  # identical weights: later tests see version 0
    print(f"swap_rpc pause {pause_ms:.1f} ms ({engine.last_swap_ms})")


async def test_follows_published_versions_and_holds_when_behind(run_config, engine, model_dir):
    """The weight receiver loads file versions into the engine; Episodes carry them; with max_policy_lag 0 a
    version the generator could not load stops the intake until a loadable one arrives."""
    from topics.nats import PolicyStore, connect
    from topics.schemas import PolicyVersion

    cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, rewards=["toy"], generator_id="g3",
                    max_policy_lag=0)
    cfg = dataclasses.replace(cfg, weightsync=dataclasses.replace(cfg.weightsync, transport="file", timeout_s=5.0))
    nc = await connect(cfg.nats, name="test-trainer")
    store = PolicyStore(nc, cfg.names)
    await store.start()
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    prompts = [p for _, p in zip(range(4), toy_prompts("addmod10", seed=21))]
    try:
        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            rev = await store.publish(PolicyVersion(version=1, step=1, transport="file", path=str(model_dir)),
                                      expected_revision=0)
            deadline = time.monotonic() + 60
            while engine.version != 1:
                assert time.monotonic() < deadline and not task.done(), "version 1 was not loaded"
                await asyncio.sleep(0.05)
            await feed(cfg, prompts[:2])
            first = await tail.until(lambda rs: len(rs) >= 4, 60, "episodes at version 1", task)
            assert all((r.value.token_versions == 1).all() and r.value.policy_version == 1 for r in first)

            # version 2 cannot be loaded: it names a gloo rendezvous, and no trainer answers the join
            rev = await store.publish(PolicyVersion(version=2, step=2, transport="gloo", address="127.0.0.1:9"),
                                      expected_revision=rev)
            deadline = time.monotonic() + 30
            while role.backpressure.latest != 2:
                assert time.monotonic() < deadline, "version 2 was not seen"
                await asyncio.sleep(0.05)
            await feed(cfg, prompts[2:])
            await asyncio.sleep(3.0)
            await tail.until(lambda rs: True, 1, "")
            assert len(tail.records) == 4, "the generator took prompts while its weights were behind"
            assert engine.version == 1 and "lag" in role.backpressure.reason(engine.version)

            await store.publish(PolicyVersion(version=3, step=3, transport="file", path=str(model_dir)),
                                expected_revision=rev)
            later = await tail.until(lambda rs: len(rs) >= 8, 60, "episodes after version 3", task)
            assert all((r.value.token_versions == 3).all() for r in later[4:])
        await stop_role(stop, task)
    finally:
        await engine.relabel(0)
        await nc.close()


async def test_quota_keeps_the_generator_within_its_window_of_trainer_steps(run_config, engine, model_dir):
    """The quota: ``groups_per_step`` groups per trainer step, at most ``quota_window_steps`` steps beyond the
    trainer's published step (before the first version too); the liveness guard grants one step's worth more
    after ``backpressure_stall_s`` with nothing in flight."""
    from topics.nats import PolicyStore, connect
    from topics.schemas import PolicyVersion

    cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, rewards=["toy"], generator_id="g5",
                    max_policy_lag=0, groups_per_step=1, quota_window_steps=2, backpressure_stall_s=3.0,
                    quota_counts_zero_variance=True)
    nc = await connect(cfg.nats, name="test-trainer")
    store = PolicyStore(nc, cfg.names)
    await store.start()
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        await feed(cfg, [p for _, p in zip(range(6), toy_prompts("addmod10", seed=31))])

        def groups(rs) -> int:
            return len({r.value.group_id for r in rs})

        async with Tail(cfg, cfg.names.episodes, Episode) as tail:
            await tail.until(lambda rs: len(rs) >= 4, 60, "the window's 2 groups, before any version", task)
            await asyncio.sleep(1.0)
            await tail.until(lambda rs: True, 1, "")
            assert groups(tail.records) == 2 and role.backpressure.ahead()  # holding for the trainer

            rev = await store.publish(PolicyVersion(version=0, step=1, transport="none"), expected_revision=0)
            await tail.until(lambda rs: groups(rs) >= 3, 60, "1 more group for the trainer's step 1", task)
            await store.publish(PolicyVersion(version=1, step=3, transport="none"), expected_revision=rev)
            await tail.until(lambda rs: groups(rs) >= 5, 60, "2 more: a version covering two steps", task)
            assert role.backpressure.quota() == 5
            t0 = time.monotonic()
            await tail.until(lambda rs: groups(rs) >= 6, 60, "the last group, after the liveness guard", task)
            assert time.monotonic() - t0 >= 2.0 and role.backpressure.granted == 1
        await stop_role(stop, task)
    finally:
        await engine.relabel(0)  # "none" versions only relabel the same weights
        await nc.close()


async def test_engine_takes_the_offline_batch_limits_and_a_burst_runs_in_one_wave(engine):
    """Unset ``generator.max_num_seqs`` / ``max_num_batched_tokens`` take vLLM's offline ``LLM`` defaults (on CPU
    256 and 4096), not the server's 128: a 32-prompt x 8-sample burst is admitted at once, not in two waves."""
    from producers.engine import Sampling

    sched = engine.llm.vllm_config.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (256, 4096)
    prompt = engine.tokenizer("reverse abc:")["input_ids"]
    t0 = time.monotonic()

    async def one() -> list[tuple[float, float, int]]:
        start = time.monotonic() - t0
        done = await engine.generate(prompt, 8, Sampling(max_tokens=24))
        return [(start + c.first_token_s, start + c.generate_s, len(c.token_ids)) for c in done]

    samples = [s for group in await asyncio.gather(*(one() for _ in range(32))) for s in group]
    assert len(samples) == 256 and all(n for _, _, n in samples)
    # in two waves, the second wave's first tokens come only as the first wave's samples finish
    full = [end for _, end, n in samples if n == 24]
    assert len(full) >= 32, f"only {len(full)} samples ran to max_tokens"
    assert max(first for first, _, _ in samples) < min(full), sorted(samples)[-3:]


async def test_an_idle_engine_leaves_the_cores_free(engine):
    """vLLM's engine core and worker poll their shared-memory queues for 1 s after each read (0.8 CPU s in this
    test's idle second with vLLM's own setting); the engine's default poll (``generator.vllm_poll_s``, applied by
    streamforge's vLLM plugin in those processes) puts them to sleep within 0.02 s, so between bursts of generation
    the trainer has the cores."""
    import psutil

    from producers.engine import Sampling

    def vllm_cpu_s() -> float:
        total = 0.0
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.name().startswith("VLLM::"):
                    times = proc.cpu_times()
                    total += times.user + times.system
        return total

    await engine.generate(engine.tokenizer("reverse abc:")["input_ids"], 8, Sampling(max_tokens=24))
    await asyncio.sleep(0.2)
    before = vllm_cpu_s()
    await asyncio.sleep(1.0)
    assert vllm_cpu_s() - before < 0.2, "vLLM's processes kept polling while idle"
