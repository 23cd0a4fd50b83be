"""The service layer on a real nats-server: registration, least-loaded routing, heartbeat loss, call_one/fanout."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from runtime.registration import ServiceRegistration
from runtime.services import ServiceCallFailed, ServiceDirectory, ServiceUnavailable
from topics.nats import connect
from topics.schemas import RewardReply, RewardRequest

pytestmark = pytest.mark.timeout(60)


def registration(nc, names, replica_id: str, *, load: int = 0, capacity: int = 10, heartbeat_s: float = 0.2,
                 health_timeout_s: float = 1.0, handler=None, service: str = "svc") -> ServiceRegistration:
    return ServiceRegistration(nc, names, service=service, replica_id=replica_id, kind="test", capacity=capacity,
                               heartbeat_s=heartbeat_s, health_timeout_s=health_timeout_s,
                               address="" if handler else f"ws://127.0.0.1/{replica_id}",
                               load=None if handler else (lambda: load), handler=handler)


async def until(predicate, timeout_s: float = 5.0) -> float:
    """Seconds until ``predicate()`` holds (polled every 10 ms); fails the test after ``timeout_s``."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_least_loaded_routing_skips_draining_and_full_replicas_and_late_callers_see_all(run_config) -> None:
    nc = await connect(run_config.nats, name="test-services")
    names = run_config.names
    regs = [registration(nc, names, "a", load=5), registration(nc, names, "b", load=1),
            registration(nc, names, "c", load=3), registration(nc, names, "full", load=2, capacity=2)]
    directory = ServiceDirectory(nc, names)
    try:
        for reg in regs:
            await reg.start()
        await directory.start()  # a caller that starts after the replicas: the watch's initial values
        assert {r.replica_id for r in directory.healthy("svc")} == {"a", "b", "c", "full"}
        assert directory.get("svc", "b").address == "ws://127.0.0.1/b"
        # least loaded first; each pick counts on its replica until the replica's next beat
        picks = [directory.pick("svc").replica_id for _ in range(6)]
        assert picks[:2] == ["b", "b"]  # 1/10, then 2/10, then b and c tie at 3/10
        assert set(picks[2:4]) == {"b", "c"} and "full" not in picks
        assert directory.pick("svc", exclude=["b", "c"]).replica_id == "a"
        with pytest.raises(ServiceUnavailable):
            directory.pick("other")
        await regs[1].drain()  # draining: healthy, but routed nothing new
        await until(lambda: directory.get("svc", "b").beat.state == "draining")
        assert all(directory.pick("svc").replica_id != "b" for _ in range(5))
        await regs[0].stop()  # a stop deletes the key: gone from every caller at once
        await until(lambda: directory.get("svc", "a") is None)
        assert {r.replica_id for r in directory.healthy("svc")} == {"b", "c", "full"}
    finally:
        await directory.stop()
        for reg in regs:
            await reg.stop()
        await nc.close()


async def test_a_replica_that_stops_beating_is_out_of_routing_within_its_health_timeout(run_config) -> None:
    nc = await connect(run_config.nats, name="test-services")
    names = run_config.names
    live, silent = registration(nc, names, "live"), registration(nc, names, "silent", load=0)
    live_task = silent_task = None
    directory = ServiceDirectory(nc, names)
    try:
        await directory.start()
        for reg in (live, silent):
            await reg.start()
        live_task, silent_task = asyncio.ensure_future(live.loop()), asyncio.ensure_future(silent.loop())
        await until(lambda: len(directory.healthy("svc")) == 2)
        await asyncio.sleep(0.5)  # a few beats each
        silent_task.cancel()  # stops beating without a word (a hung or partitioned process)
        last_beat = time.monotonic()
        out = await until(lambda: "silent" not in {r.replica_id for r in directory.healthy("svc")}, timeout_s=3)
        assert out <= silent.health_timeout_s + 0.3, out  # the stated bound: health_timeout_s after its last beat
        assert all(directory.pick("svc").replica_id == "live" for _ in range(5))
        # the server forgets it too (TTL of health_timeout_s rounded up to 1 s): its delete marker reaches callers
        await until(lambda: directory.get("svc", "silent") is None, timeout_s=4)
        assert time.monotonic() - last_beat <= 1.0 + 1.5
        assert directory.get("svc", "live").healthy()
        # a caller that marks a replica lost skips it until it beats again a heartbeat later
        directory.mark_lost("svc", "live")
        with pytest.raises(ServiceUnavailable):
            directory.pick("svc")
        await until(lambda: directory.get("svc", "live").healthy(), timeout_s=2)
    finally:
        for task in (live_task, silent_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await directory.stop()
        for reg in (live, silent):
            await reg.stop()
        await nc.close()


def echo_handler(replica_id: str, calls: list[str], *, fail: bool = False):
    async def handle(request: RewardRequest) -> RewardReply:
        calls.append(replica_id)
        if fail:
            raise ValueError("this replica always fails")
        n = len(request.responses)
        return RewardReply(request_id=request.request_id, scores=np.arange(n, dtype=np.float64), errors=[""] * n,
                           replica_id=replica_id)
    return handle


def request(n: int = 2) -> RewardRequest:
    return RewardRequest(request_id="r", prompt_ids=["p"] * n, tasks=["t"] * n, prompt_texts=["x"] * n,
                         answers=["1"] * n, responses=[str(i) for i in range(n)])


async def test_call_one_goes_to_the_least_loaded_replica_and_fails_over_fanout_reaches_all(run_config) -> None:
    nc = await connect(run_config.nats, name="test-services")
    names = run_config.names
    calls: list[str] = []
    regs = [registration(nc, names, f"r{i}", handler=echo_handler(f"r{i}", calls), service="echo") for i in range(3)]
    broken = registration(nc, names, "broken", handler=echo_handler("broken", calls, fail=True), service="bad")
    directory = ServiceDirectory(nc, names)
    try:
        for reg in [*regs, broken]:
            await reg.start()
        await directory.start()
        reply = await directory.call_one("echo", request(3), expect=RewardReply, timeout_s=2)
        assert list(reply.scores) == [0.0, 1.0, 2.0] and reply.replica_id in {"r0", "r1", "r2"}
        replies = await directory.fanout("echo", request(1), expect=RewardReply, timeout_s=2)
        assert sorted(replies) == ["r0", "r1", "r2"]
        assert all(isinstance(r, RewardReply) and r.replica_id == rid for rid, r in replies.items())
        # a replica that vanished without deleting its key (no responders): the call goes to another one
        await regs[0]._sub.unsubscribe()
        regs[0]._sub = None
        for _ in range(50):  # ties go at random: call until one went to r0 ((2/3)^50 that none does)
            reply = await directory.call_one("echo", request(1), expect=RewardReply, timeout_s=2)
            assert reply.replica_id in {"r1", "r2"}
            if directory.get("echo", "r0").lost_at is not None:
                break
        assert directory.get("echo", "r0").lost_at is not None
        # a handler that raises: the caller gets the replica's reason, typed
        with pytest.raises(ServiceCallFailed) as err:
            await directory.call_one("bad", request(1), timeout_s=2)
        assert err.value.code == "handler_error" and "always fails" in str(err.value) and not err.value.retriable
        # bytes that are not a message: a malformed fault, and the replica keeps serving
        raw = await nc.request(regs[1].address, b"\xc1garbage", timeout=2)
        assert b"malformed" in raw.data
        assert (await directory.call_one("echo", request(1), expect=RewardReply, timeout_s=2)).replica_id
    finally:
        await directory.stop()
        for reg in [*regs, broken]:
            await reg.stop()
        await nc.close()


async def test_calls_beyond_capacity_wait_for_room_instead_of_failing(run_config) -> None:
    """Two callers, 40 requests at once, on two replicas that serve 2 at a time: every call is served, never more
    than its capacity at once on a replica (a caller that meets "overloaded" waits for room)."""
    nc = await connect(run_config.nats, name="test-services")
    names = run_config.names
    busy = {"r0": 0, "r1": 0}
    peak = {"r0": 0, "r1": 0}

    def slow_handler(rid: str):
        async def handle(request: RewardRequest) -> RewardReply:
            busy[rid] += 1
            peak[rid] = max(peak[rid], busy[rid])
            await asyncio.sleep(0.05)
            busy[rid] -= 1
            return RewardReply(request_id=request.request_id, scores=np.zeros(1), errors=[""], replica_id=rid)
        return handle

    regs = [registration(nc, names, rid, handler=slow_handler(rid), service="slow", capacity=2) for rid in busy]
    callers = [ServiceDirectory(nc, names), ServiceDirectory(nc, names)]
    beating: list[asyncio.Future] = []
    try:
        for d in callers:  # callers first: the service is not registered yet, a call waits for it
            await d.start()
        early = asyncio.ensure_future(callers[0].call_one("slow", request(1), expect=RewardReply, timeout_s=10))
        await asyncio.sleep(0.2)
        assert not early.done()
        for reg in regs:
            await reg.start()
        beating += [asyncio.ensure_future(reg.loop()) for reg in regs]
        assert (await early).replica_id in busy
        replies = await asyncio.gather(*(callers[i % 2].call_one("slow", request(1), expect=RewardReply, timeout_s=20)
                                         for i in range(40)))
        assert len(replies) == 40 and {r.replica_id for r in replies} == set(busy)
        assert max(peak.values()) <= 2, peak
        with pytest.raises(ServiceUnavailable):  # no replica of it ever: the wait ends with the call's timeout
            await callers[0].call_one("nobody", request(1), timeout_s=0.3)
    finally:
        for task in beating:
            task.cancel()
        for d in callers:
            await d.stop()
        for reg in regs:
            await reg.stop()
        await nc.close()
