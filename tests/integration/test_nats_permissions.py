"""Per-role NATS users (``streamforge/permissions.py``) on a real nats-server: every role's own calls work, and a
generator's or buffer's credentials cannot write the policy store (only the trainer's can)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from streamforge.brokers import free_port, nats_server_binary
from streamforge.permissions import nats_authorization
from topics.config import NatsConfig
from topics.names import Names
from topics.nats import PolicyStore, connect, publish_msg
from topics.schemas import Membership, PolicyVersion, TrainerProgress, VersionAck

pytestmark = pytest.mark.timeout(120)

PASSWORDS = {f"STREAMFORGE_NATS_{r.upper()}_PASSWORD": f"pw-{r}" for r in ("trainer", "generator", "buffer", "status")}


@pytest.fixture
async def secured(tmp_path: Path):
    """A nats-server with JetStream and the run's per-role users; yields its URL and the run's names."""
    names = Names("perm")
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
                    + nats_authorization(names))
    env = {**os.environ, **PASSWORDS}
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:  # wait_nats connects without credentials: poll the port with the trainer's
            try:
                nc = await connect(as_role(url, "trainer"), name="probe")
                await nc.close()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        yield url, names
    finally:
        proc.terminate()
        proc.wait(10)


def as_role(url: str, role: str) -> NatsConfig:
    os.environ[f"SF_TEST_{role.upper()}"] = PASSWORDS[f"STREAMFORGE_NATS_{role.upper()}_PASSWORD"]
    return NatsConfig(url=url, user=role, password_env=f"SF_TEST_{role.upper()}", connect_retries=1,
                      request_timeout_s=2.0)


async def test_each_role_can_do_its_part_and_no_more(secured) -> None:
    url, names = secured
    trainer = await connect(as_role(url, "trainer"), name="trainer")
    gen = await connect(as_role(url, "generator"), name="generator")
    buf = await connect(as_role(url, "buffer"), name="buffer")
    status = await connect(as_role(url, "status"), name="status")
    try:
        # the trainer creates the bucket, publishes, writes its progress and the fencing record, hears members
        t_store = PolicyStore(trainer, names, timeout_s=2.0)
        await t_store.start()
        heard: list[str] = []

        async def on_member(msg) -> None:
            heard.append(msg.subject)
            if msg.reply:
                await publish_msg(trainer, msg.reply, PolicyVersion(version=-1, step=-1))

        await trainer.subscribe(names.membership_subject, cb=on_member)
        await trainer.subscribe(names.ack_subject, cb=on_member)
        await trainer.flush()
        rev = await t_store.publish(PolicyVersion(version=1, step=1, trainer_id="t"), expected_revision=0)
        await t_store.put_progress(TrainerProgress(step=1, version=1))
        await t_store.put("fenced", b"{}")
        # the generator reads and watches everything it needs, joins and acks
        g_store = PolicyStore(gen, names, timeout_s=2.0)
        await g_store.start()
        assert (await g_store.latest_good())[0].version == 1
        assert (await g_store.progress()).step == 1
        assert await g_store.get("fenced") == b"{}"
        watch = g_store.watch()
        assert (await asyncio.wait_for(watch.__anext__(), 5)).version == 1
        reply = await gen.request(names.membership_subject, b"x", timeout=2)
        assert reply.data
        await publish_msg(gen, names.ack_subject, VersionAck(generator_id="g", version=1))
        await gen.flush()
        # the buffer reads too
        b_store = PolicyStore(buf, names, timeout_s=2.0)
        await b_store.start()
        assert (await b_store.latest_good())[0].version == 1
        # status hears membership and acks
        got = []

        async def on_status(msg) -> None:
            got.append(msg)

        await status.subscribe(names.ack_subject, cb=on_status)
        await status.flush()
        await publish_msg(gen, names.ack_subject, VersionAck(generator_id="g", version=1))
        await asyncio.sleep(0.5)
        assert got and names.membership_subject in heard and names.ack_subject in heard
        # neither a generator nor a buffer can write the store: the write is refused, the value stays
        for store in (g_store, b_store):
            with pytest.raises(Exception):  # noqa: B017 - a permissions violation ends as a timeout or an error
                await asyncio.wait_for(store.publish(PolicyVersion(version=99, step=9), expected_revision=rev), 1.5)
            with pytest.raises(Exception):  # noqa: B017
                await asyncio.wait_for(store.put("fenced", b'{"x": 1}'), 1.5)
            with pytest.raises(Exception):  # noqa: B017
                await asyncio.wait_for(store.put_progress(TrainerProgress(step=99, version=99)), 1.5)
        pv, _ = await t_store.latest()
        assert pv is not None and pv.version == 1
        assert await t_store.get("fenced") == b"{}"
        # and a generator cannot pose as the trainer on its subjects
        with pytest.raises(Exception):  # noqa: B017
            sub = await gen.subscribe(names.ack_subject)
            await gen.flush()
            await sub.next_msg(timeout=1)
        assert Membership  # the schema of the joins above
    finally:
        for nc in (trainer, gen, buf, status):
            await nc.close()
