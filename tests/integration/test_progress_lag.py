"""Consumer lag as ``streamforge up`` shows it, read from a real broker (Tansu): produced minus committed."""

from __future__ import annotations

import asyncio

from streamforge.progress import Lag, read_lag
from topics.kafka import Consumer, Producer
from topics.schemas import Prompt


async def test_lag_is_produced_minus_committed(run_config) -> None:
    cfg = run_config
    names = cfg.names
    assert await read_lag(cfg) == {names.prompts: 0, names.episodes: 0, names.batches: 0}
    async with Producer(cfg.kafka) as producer:
        for i in range(5):
            await producer.send(names.prompts, Prompt(prompt_id=f"p{i}", text="1+2=", task="addmod10"), key=f"p{i}")
    assert (await read_lag(cfg))[names.prompts] == 5

    # the generators' group commits the first two records of each partition it read
    async with Consumer(cfg.kafka, [names.prompts], group_id=names.generators_group) as consumer:
        seen = []
        while len(seen) < 5:
            seen += await consumer.getmany(timeout_ms=1000)
        last = {}
        for rec in seen:
            last[rec.tp] = max(last.get(rec.tp, -1), rec.offset)
        await consumer.commit({tp: off + 1 for tp, off in last.items()})
    assert (await read_lag(cfg))[names.prompts] == 0

    lag = Lag(cfg, every_s=0.5)
    lag.start()
    try:
        async with Producer(cfg.kafka) as producer:
            await producer.send(names.prompts, Prompt(prompt_id="p9", text="1+2=", task="addmod10"), key="p9")
        for _ in range(60):
            if lag.value.get(names.prompts) == 1:
                break
            await asyncio.sleep(0.25)
        assert lag.value[names.prompts] == 1
    finally:
        await lag.stop()
