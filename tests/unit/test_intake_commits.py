"""The generator's intake commits in the background: a prompt's slot frees once its pipeline is done, not after a
commit round trip of its own, and prompts that finish while a commit is in flight share the next commit.

Pure intake logic: the consumer is a stand-in that hands out records and holds each commit until the test lets it
go (the real broker path is covered by tests/integration/test_generator.py)."""

from __future__ import annotations

import asyncio

import pytest

from producers.config import GeneratorConfig
from producers.flow import Backpressure
from producers.intake import Intake
from topics.kafka import Received
from topics.schemas import Prompt


class HeldConsumer:
    """Hands out ``records`` a few at a time; each ``commit`` waits for ``release``."""

    def __init__(self, records: list[Received]) -> None:
        self.records = list(records)
        self.commits: list[dict] = []
        self.release = asyncio.Event()
        self.committing = asyncio.Event()

    async def getmany(self, timeout_ms: int = 0, max_records: int = 1) -> list[Received]:
        if not self.records:
            await asyncio.sleep(timeout_ms / 1000)
            return []
        out, self.records = self.records[:max_records], self.records[max_records:]
        return out

    async def commit(self, offsets: dict) -> None:
        self.committing.set()
        await self.release.wait()
        self.commits.append(dict(offsets))

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def seek(self, tp, offset) -> None: ...


class Checker:
    def check(self, prompt: Prompt) -> tuple[list[int], str]:
        return [1, 2, 3], ""


def _record(i: int) -> Received:
    return Received(topic="p", partition=0, offset=i, key=None, raw=b"",
                    value=Prompt(prompt_id=f"p{i}", text="x", task="t"))


@pytest.mark.timeout(30)
async def test_slots_free_before_their_commit_and_commits_coalesce():
    ran: list[str] = []

    async def run_prompt(prompt, tokens, ctx, origin) -> None:
        ran.append(prompt.prompt_id)

    cfg = GeneratorConfig(max_concurrent_prompts=1, poll_timeout_ms=20)
    intake = Intake(cfg, backpressure=Backpressure(max_policy_lag=1), checker=Checker(), run_prompt=run_prompt,
                    dead=None, engine_version=lambda: 0, stats={"dead_lettered": 0, "commits": 0})
    consumer = HeldConsumer([_record(i) for i in range(6)])
    intake.consumer = consumer
    loop = asyncio.create_task(intake.loop())
    try:
        await asyncio.wait_for(consumer.committing.wait(), 5)  # the first prompt's commit is in flight, held
        async with asyncio.timeout(5):  # one slot, yet every prompt runs while that commit is held
            while len(ran) < 6:
                await asyncio.sleep(0.01)
        assert consumer.commits == []
        consumer.release.set()
        async with asyncio.timeout(5):
            while not consumer.commits or list(consumer.commits[-1].values()) != [6]:
                await asyncio.sleep(0.01)
        # the first commit, then one for the five prompts that finished while it was held
        assert len(consumer.commits) == 2, consumer.commits
        assert [list(c.values()) for c in consumer.commits] == [[1], [6]]
    finally:
        intake.close()
        await asyncio.wait_for(loop, 5)
        await intake.finish_tasks()
    assert intake.failure is None


@pytest.mark.timeout(30)
async def test_a_failed_commit_fails_intake():
    async def run_prompt(prompt, tokens, ctx, origin) -> None:
        pass

    class Broken(HeldConsumer):
        async def commit(self, offsets: dict) -> None:
            raise RuntimeError("broker gone")

    cfg = GeneratorConfig(max_concurrent_prompts=2, poll_timeout_ms=20)
    intake = Intake(cfg, backpressure=Backpressure(max_policy_lag=1), checker=Checker(), run_prompt=run_prompt,
                    dead=None, engine_version=lambda: 0, stats={"dead_lettered": 0, "commits": 0})
    intake.consumer = Broken([_record(i) for i in range(3)])
    with pytest.raises(RuntimeError, match="broker gone"):
        await asyncio.wait_for(intake.loop(), 5)
    await intake.cancel_tasks()


@pytest.mark.timeout(30)
async def test_the_engine_adopting_a_version_opens_backpressure_at_once():
    """Lag 0 (sync): nothing is taken while the engine is behind the published version; the engine's swap wakes the
    intake (``Intake.adopted``), which takes the next prompt then, not at its next ``poll_timeout_ms`` re-check."""
    ran: list[str] = []
    version = [0]

    async def run_prompt(prompt, tokens, ctx, origin) -> None:
        ran.append(prompt.prompt_id)

    cfg = GeneratorConfig(max_concurrent_prompts=2, poll_timeout_ms=10_000)
    intake = Intake(cfg, backpressure=Backpressure(max_policy_lag=0), checker=Checker(), run_prompt=run_prompt,
                    dead=None, engine_version=lambda: version[0], stats={"dead_lettered": 0, "commits": 0})
    intake.consumer = HeldConsumer([_record(i) for i in range(2)])
    intake.consumer.release.set()
    intake.published(1)
    loop = asyncio.create_task(intake.loop())
    try:
        await asyncio.sleep(0.3)
        assert ran == []  # the engine is a version behind: closed
        version[0] = 1
        t0 = asyncio.get_running_loop().time()
        intake.adopted(1)
        async with asyncio.timeout(2):
            while len(ran) < 2:
                await asyncio.sleep(0.01)
        assert asyncio.get_running_loop().time() - t0 < 2  # well before the 10 s re-check
    finally:
        intake.close()
        loop.cancel()  # it may be in the stand-in's 10 s fetch
        await asyncio.gather(loop, return_exceptions=True)
        await intake.finish_tasks()


async def test_the_engine_tells_its_listeners_each_version_it_adopts():
    from producers.engine import Engine

    class Labels:  # stands in for vLLM's AsyncLLM: relabel only calls update_weight_version
        def __init__(self) -> None:
            self.labels: list[str] = []

        async def update_weight_version(self, label: str) -> None:
            self.labels.append(label)

    engine = Engine("unused")
    engine.llm = Labels()
    heard: list[int] = []
    stop = engine.on_version(heard.append)
    await engine.relabel(3)
    assert heard == [3] and engine.version == 3 and engine.llm.labels == ["3"]
    stop()
    await engine.relabel(4)
    assert heard == [3] and engine.version == 4
    stop()  # twice is harmless
