"""WeightPublisher over a real nats-server (no engine): file transport, provenance, acks, deadlines, fencing."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import torch

from topics import codec
from topics.nats import PolicyStore, connect, publish_msg
from topics.schemas import Membership, PolicyVersion, VersionAck
from weightsync.config import WeightSyncConfig
from weightsync.fencing import FenceView
from weightsync.files import read_version
from weightsync.members import FENCED_KEY, parse_fenced
from weightsync.publisher import VersionRegression, WeightPublisher

pytestmark = pytest.mark.timeout(120)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(64, 16, generator=g)),
            ("model.norm.weight", torch.randn(16, generator=g)),
            ("lm_head.weight", torch.randn(64, 16, generator=g))]


async def _until(pred, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.02)


async def test_file_round_fences_a_silent_member_and_unfences_it_on_catch_up(run_config, tmp_path):
    names = run_config.names
    cfg = WeightSyncConfig(transport="file", shared_dir=str(tmp_path / "shared"), ack_deadline_s=3.0)
    nc = await connect(run_config.nats, name="trainer")
    gen = await connect(run_config.nats, name="generator")
    try:
        async with WeightPublisher(cfg, nc=nc, names=names, run_dir=run_config.run_dir) as pub:
            # a generator that acks and one that joins, then stays silent
            acks = []

            async def on_version(msg):
                pv = codec.decode(msg.data, expect=PolicyVersion)
                acks.append(pv.version)
                await publish_msg(gen, names.ack_subject, VersionAck(generator_id="live", version=pv.version))

            await gen.subscribe(names.policy_subject, cb=on_version)
            for gid in ("live", "silent"):
                await publish_msg(gen, names.membership_subject, Membership(generator_id=gid, event="join"))
            await gen.flush()
            await _until(lambda: set(pub.members()) == {"live", "silent"})

            view = FenceView(gen, names)
            await view.start()
            follow = asyncio.create_task(view.loop())
            t0 = time.monotonic()
            w1 = _weights(1)
            pv = await pub.publish(version=1, step=10, named_tensors=lambda: iter(w1), batch_ids=["b1", "b2"])
            took = time.monotonic() - t0
            assert 2.9 < took < 10.0, took  # waited for the deadline, not forever
            assert pv.transport == "file" and pv.batch_ids == ["b1", "b2"]
            stored = read_version(pv.path)
            for name, t in w1:
                assert torch.equal(stored[name], t)  # the file path yields identical weights
            store = PolicyStore(nc, names)
            await store.start()
            latest, _ = await store.latest()
            assert latest.version == 1 and latest.path == pv.path
            assert parse_fenced(await store.get(FENCED_KEY)) == {"silent": -1}
            assert pub.counters["ack_timeouts"] == 1 and pub.counters["fenced"] == 1
            assert acks == [1]
            await _until(lambda: view.fenced == {"silent": -1})  # what the buffer sees
            assert view.should_drop("silent", 1) and not view.should_drop("live", 1)

            # the silent generator catches up: unfenced, and the next round does not wait on anyone
            await publish_msg(gen, names.ack_subject, VersionAck(generator_id="silent", version=1))
            await gen.flush()
            for _ in range(400):
                if parse_fenced(await store.get(FENCED_KEY)) == {}:
                    break
                await asyncio.sleep(0.05)
            assert parse_fenced(await store.get(FENCED_KEY)) == {}
            await _until(lambda: view.fenced == {})
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            await publish_msg(gen, names.membership_subject, Membership(generator_id="silent", event="leave"))
            await gen.flush()
            await _until(lambda: set(pub.members()) == {"live"})
            t0 = time.monotonic()
            task = await pub.submit(version=2, step=20, named_tensors=lambda: iter(_weights(2)), batch_ids=["b3"])
            pv2 = await task
            assert pv2.version == 2 and time.monotonic() - t0 < 2.9
            with pytest.raises(VersionRegression):
                await pub.publish(version=2, step=21, named_tensors=lambda: iter(_weights(3)), batch_ids=[])

        lines = [orjson.loads(x) for x in (run_config.run_dir / "weightsync" / "versions.jsonl").read_bytes().split()]
        assert [ln["version"] for ln in lines] == [1, 2]
        assert lines[0]["acks"]["live"]["ok"] and lines[0]["fenced"] == ["silent"]
        assert lines[1]["targets"] == ["live"] and lines[1]["fenced"] == []
    finally:
        await gen.close()
        await nc.close()
