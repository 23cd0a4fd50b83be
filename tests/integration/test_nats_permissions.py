"""Per-role NATS users (``streamforge/permissions.py``) on a real nats-server: every role's own calls work, and a
generator's or buffer's credentials cannot write the policy store (only the trainer's can); the service replicas
(``env``, ``reward``) register and serve under their own users, a generator's user routes to them, and a user
without the right is refused with ``PermissionDenied`` at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from envs.config import EnvConfig
from envs.routing import ServiceEnvRouter
from runtime.registration import ServiceRegistration
from runtime.remote_reward import RemoteReward, request_for
from runtime.services import ServiceDirectory, open_bucket, read_services
from streamforge.brokers import free_port, nats_server_binary
from streamforge.config import load_config
from streamforge.permissions import ROLES, ServiceScope, nats_authorization
from streamforge.roles import build_role
from topics.config import NatsConfig
from topics.errors import PermissionDenied
from topics.names import Names
from topics.nats import PolicyStore, connect, publish_msg
from topics.schemas import Membership, PolicyVersion, Prompt, RewardReply, TrainerProgress, VersionAck

pytestmark = pytest.mark.timeout(120)

PASSWORDS = {f"STREAMFORGE_NATS_{r.upper()}_PASSWORD": f"pw-{r}" for r in ROLES}
SCOPE = ServiceScope(envs=("count",), rewards=("judge",))  # the services tests' run names its services


@contextlib.asynccontextmanager
async def secured_server(tmp_path: Path, names: Names, scope: ServiceScope | None = None,
                         procs: list[subprocess.Popen] | None = None):
    """A nats-server with JetStream and the run's per-role users; yields its URL (its process goes into
    ``procs`` if given)."""
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
                    + nats_authorization(names, scope=scope))
    env = {**os.environ, **PASSWORDS}
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    if procs is not None:
        procs.append(proc)
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
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def secured(tmp_path: Path):
    """A nats-server with the run's per-role users (any service); yields its URL and the run's names."""
    names = Names("perm")
    async with secured_server(tmp_path, names) as url:
        yield url, names


def as_role(url: str, role: str, *, request_timeout_s: float = 2.0) -> NatsConfig:
    os.environ[f"SF_TEST_{role.upper()}"] = PASSWORDS[f"STREAMFORGE_NATS_{role.upper()}_PASSWORD"]
    return NatsConfig(url=url, user=role, password_env=f"SF_TEST_{role.upper()}", connect_retries=1,
                      request_timeout_s=request_timeout_s)


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
        # core NATS delivers at most once (a drop is not a refusal): the ack is repeated until both heard it
        deadline = time.monotonic() + 20
        while not (got and names.membership_subject in heard and names.ack_subject in heard):
            assert time.monotonic() < deadline, (
                f"timed out: status heard {len(got)} acks, the trainer heard {heard}; connected: "
                f"{[(nc.options['name'], nc.is_connected, nc.stats['in_msgs'], nc.stats['out_msgs']) for nc in (trainer, gen, status)]}")
            await publish_msg(gen, names.ack_subject, VersionAck(generator_id="g", version=1))
            await gen.flush()
            await asyncio.sleep(0.5)
        # neither a generator nor a buffer can write the store: the write is refused at once, the value stays
        for store in (g_store, b_store):
            with pytest.raises(PermissionDenied):
                await asyncio.wait_for(store.publish(PolicyVersion(version=99, step=9), expected_revision=rev), 1.5)
            with pytest.raises(PermissionDenied):
                await asyncio.wait_for(store.put("fenced", b'{"x": 1}'), 1.5)
            with pytest.raises(PermissionDenied):
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


# -- the service replicas and their callers -----------------------------------------------------------------------

REPLICA_BEATS = {"reward": ["--reward.heartbeat_s=0.5", "--reward.health_timeout_s=1.5"],
                 "env": ["--env.heartbeat_s=0.5", "--env.health_timeout_s=1.5"]}


def role_config(url: str, run_dir: Path, role: str, *overrides: str):
    """The run config of one role of the run ``perm`` connecting as its own NATS user."""
    nats = as_role(url, role, request_timeout_s=5.0)
    return load_config(None, ["--run.prefix=perm", f"--run.run_dir={run_dir}", f"--nats.url={url}",
                              f"--nats.user={role}", f"--nats.password_env={nats.password_env}",
                              "--nats.connect_retries=1", "--kafka.bootstrap=127.0.0.1:1", "--telemetry.metrics=[]",
                              "--telemetry.traces=none", *REPLICA_BEATS[role], *overrides], environ={})


async def until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_replicas_serve_and_a_generator_routes_to_them_each_under_its_own_user(tmp_path: Path) -> None:
    names = Names("perm")
    async with secured_server(tmp_path, names, SCOPE) as url:
        gen = await connect(as_role(url, "generator"), name="generator")
        status = await connect(as_role(url, "status"), name="status")
        directory = ServiceDirectory(gen, names)
        stop = asyncio.Event()
        served: list[asyncio.Future] = []
        try:
            assert await read_services(status, names) == {}  # status creates nothing: no bucket, no services
            await directory.start()  # the generator starts first: its user creates the services bucket
            reward = build_role("reward", role_config(url, tmp_path / "run", "reward", "--reward.name=judge",
                                                      "--reward.replica_id=judge-0",
                                                      "--reward.impl=services.reward_examples:toy_judge"))
            env = build_role("env", role_config(url, tmp_path / "run", "env", "--env.name=count",
                                                "--env.replica_id=count-0", "--env.impl=helpers.countenv:CountEnv"))
            served = [asyncio.ensure_future(r.serve(stop)) for r in (reward, env)]
            await directory.wait_for("judge", 1, timeout_s=30)
            await directory.wait_for("count", 1, timeout_s=30)
            # a remote reward: one request per group to the reward replica, its answer back through the inbox
            remote = RemoteReward("judge")
            remote.bind(directory)
            prompt = Prompt(prompt_id="p1", task="addmod10", text="3+4=", answer="7")
            assert await remote.score(prompt, ["7", "3"], timeout_s=5) == [1.0, 0.0]
            replies = await directory.fanout("judge", request_for([prompt], ["7"]), expect=RewardReply)
            assert list(replies) == ["judge-0"] and replies["judge-0"].scores.tolist() == [1.0]
            # an env session on the env replica the generator's user found in the bucket
            router = ServiceEnvRouter(directory, EnvConfig(name="count", heartbeat_s=0.5, health_timeout_s=1.5,
                                                           step_timeout_s=5.0))
            session = await router.open("count")
            assert session.replica_id == "count-0"
            assert (await session.reset(episode_id="e1")).text == "episode e1 starts"
            assert (await session.step("hit")).text == "turn 1: hit"
            await session.close()
            # status lists both under its own user; the replicas keep beating under theirs
            listed = await read_services(status, names)
            assert {s: [r["replica_id"] for r in rows] for s, rows in listed.items()} == {
                "count": ["count-0"], "judge": ["judge-0"]}
            counts = reward.registration.counts, env.registration.counts
            before = [c["beats"] for c in counts]
            await until(lambda: all(c["beats"] > b for c, b in zip(counts, before)), 5, "a beat of each replica")
            assert reward.registration.counts["beat_failures"] == env.registration.counts["beat_failures"] == 0
            # a stop deletes each replica's key under its own user: every caller drops them at once
            stop.set()
            await asyncio.wait_for(asyncio.gather(*served), 30)
            await until(lambda: directory.get("judge", "judge-0") is None and directory.get("count", "count-0") is None,
                        1.0, "the stopped replicas' keys deleted (before their TTL)")
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*served, return_exceptions=True), 30)
            await directory.stop()
            for nc in (gen, status):
                await nc.close()


async def test_a_user_without_the_right_is_refused_at_once(tmp_path: Path) -> None:
    """Each refusal is ``PermissionDenied`` naming the subject, well within the 5 s request timeout."""
    names = Names("perm")
    async with secured_server(tmp_path, names, SCOPE) as url:
        conns = {role: await connect(as_role(url, role, request_timeout_s=5.0), name=role) for role in ROLES}

        def replica(role: str, service: str, *, serves: bool) -> ServiceRegistration:
            async def echo(request):
                return request

            return ServiceRegistration(conns[role], names, service=service, replica_id=f"{service}-{role}",
                                       kind=role, capacity=4, heartbeat_s=0.5, health_timeout_s=1.5,
                                       address="" if serves else "ws://127.0.0.1:1",
                                       handler=echo if serves else None, timeout_s=5.0)

        async def refused(awaitable, subject: str) -> None:
            t0 = time.monotonic()
            with pytest.raises(PermissionDenied) as info:
                await asyncio.wait_for(awaitable, 10)
            assert time.monotonic() - t0 < 2.0, "refused only when the request timed out"
            assert info.value.subject == subject.lower() and not info.value.retriable

        stream = f"KV_{names.services_bucket}"
        judge = replica("reward", "judge", serves=True)
        status_dir = ServiceDirectory(conns["status"], names)
        registrations = [judge]
        try:
            await judge.start()  # the reward replica starts first: its user creates the services bucket
            # the buffer's user has no business with services: it cannot open the bucket, register or serve
            await refused(ServiceDirectory(conns["buffer"], names).start(), f"$JS.API.STREAM.INFO.{stream}")
            registrations.append(replica("buffer", "judge", serves=True))
            await refused(registrations[-1].start(), f"$JS.API.STREAM.INFO.{stream}")
            # status reads the bucket but may not call a replica
            await status_dir.start()
            await status_dir.wait_for("judge", 1, timeout_s=5)
            request = request_for([Prompt(prompt_id="p", task="addmod10", text="1+1=")], ["2"])
            await refused(status_dir.call_one("judge", request), names.service_subject("judge", "judge-reward"))
            # an env replica cannot beat as a reward service, nor take a reward service's requests
            registrations.append(replica("env", "judge", serves=False))
            await refused(registrations[-1].start(), f"$KV.{names.services_bucket}.judge.judge-env")
            registrations.append(replica("env", "count", serves=True))
            await refused(registrations[-1].start(), names.service_subject("count", "count-env"))
            # a reward replica cannot beat as the environment, and a generator cannot pose as any replica
            registrations.append(replica("reward", "count", serves=False))
            await refused(registrations[-1].start(), f"$KV.{names.services_bucket}.count.count-reward")
            registrations.append(replica("generator", "judge", serves=False))
            await refused(registrations[-1].start(), f"$KV.{names.services_bucket}.judge.judge-generator")
            # and the replicas' users cannot touch the policy store
            for role in ("env", "reward"):
                await refused(PolicyStore(conns[role], names, timeout_s=5.0).start(),
                              f"$JS.API.STREAM.INFO.KV_{names.policy_bucket}")
            assert judge.counts["requests"] == 0  # nothing refused ever reached the replica
        finally:
            await status_dir.stop()
            for reg in registrations:
                await reg.stop()
            for nc in conns.values():
                await nc.close()


async def test_a_big_services_bucket_is_watched_to_the_end_through_flow_control(tmp_path: Path) -> None:
    """A watch of ~13 MB makes nats-server ask the watcher for flow control (``$JS.FC.<stream>.>``, seen in a
    server trace): the generator's and status's users may answer it, so they read every beat."""
    names = Names("perm")
    async with secured_server(tmp_path, names, SCOPE) as url:
        conns = {role: await connect(as_role(url, role, request_timeout_s=5.0), name=role)
                 for role in ("env", "generator", "status")}
        try:
            js = conns["env"].jetstream(timeout=5.0)
            await open_bucket(conns["env"], names)
            value = b"x" * 64_000
            await asyncio.gather(*(js.publish(f"$KV.{names.services_bucket}.count.r{i}", value) for i in range(200)))

            async def count(watcher) -> int:
                seen = 0
                async for entry in watcher:
                    if entry is None:  # the initial values are all read
                        return seen
                    seen += 1
                return seen

            for role in ("generator", "status"):
                watcher = await (await open_bucket(conns[role], names, create=False)).watch(">")
                try:  # without flow control answered, delivery stalls: bounded here
                    assert await asyncio.wait_for(count(watcher), 20) == 200, role
                finally:
                    await watcher.stop()
        finally:
            for nc in conns.values():
                await nc.close()




async def test_an_abandoned_flush_leaves_the_connection_reading(tmp_path: Path) -> None:
    """A flush that times out (nats-py's own timeout) or is cancelled (``subscribe_checked`` on a refused SUB)
    leaves its future in the PONG queue; nats-py alone ends the connection's read loop when that PONG arrives
    (``InvalidStateError``), after which no reply or refusal is ever read. ``topics.nats.connect``'s client goes
    on reading. The server is paused (SIGSTOP) so that the PONG comes after the flush gave up."""
    from nats.errors import FlushTimeoutError

    names = Names("perm")
    procs: list[subprocess.Popen] = []
    async with secured_server(tmp_path, names, procs=procs) as url:
        env = await connect(as_role(url, "env", request_timeout_s=5.0), name="env")
        try:
            procs[0].send_signal(signal.SIGSTOP)
            while Path(f"/proc/{procs[0].pid}/stat").read_text().split()[2] != "T":  # the signal takes a moment
                await asyncio.sleep(0.01)
            try:
                with pytest.raises(FlushTimeoutError):
                    await env.flush(timeout=0.2)
            finally:
                procs[0].send_signal(signal.SIGCONT)
            await asyncio.sleep(0.5)  # the abandoned flush's PONG arrives
            t0 = time.monotonic()  # a refusal on the same connection is still read at once
            with pytest.raises(PermissionDenied):
                await asyncio.wait_for(PolicyStore(env, names, timeout_s=5.0).start(), 10)
            assert time.monotonic() - t0 < 2.0
            assert env._reading_task is not None and not env._reading_task.done()
            await env.flush(timeout=2)  # and a flush gets its own PONG
        finally:
            await env.close()
