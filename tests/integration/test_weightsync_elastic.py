"""Elastic membership with real engines: a generator joins mid-run, one is SIGKILLed during a transfer, one leaves.

Two vLLM engines: ``g0`` in this process and ``g1`` a separate ``tests/helpers/follower.py`` process (own
process group, so the SIGKILL takes its engine processes down with it, like a lost host). The trainer side is a
``WeightPublisher`` over gloo in this process. What must hold: the late joiner catches up at once and receives the
next version; a kill during a push costs the round at most its ack deadline (the dead one is fenced, the survivor
gets the version); later versions reach the survivor without waiting once the dead member expired; a generator
that leaves is no longer waited for.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from topics.nats import PolicyStore, connect
from weightsync import vllm_args
from weightsync.config import WeightSyncConfig
from weightsync.members import FENCED_KEY, parse_fenced
from weightsync.publisher import WeightPublisher
from weightsync.receiver import WeightReceiver

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

ACK_DEADLINE = 20.0  # both engines share one CPU core here: a CI run saw a live g0 miss 8 s under load
FOLLOWER = Path(__file__).parents[1] / "helpers" / "follower.py"  # a weights-only generator process
LAST_CORE = max(os.sched_getaffinity(0))  # g1's core (see the test)
MEMBER_TIMEOUT = 6.0  # generous: a starved CPU can delay heartbeats by seconds


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _weights(base: dict[str, torch.Tensor], version: int):
    g = torch.Generator().manual_seed(version)
    return lambda: ((k, v + 0.01 * torch.randn(v.shape, generator=g)) for k, v in base.items())


async def _until(pred, timeout: float, what: str) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.05)


async def test_join_mid_run_sigkill_during_transfer_and_leave(run_config, tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from producers.engine import Engine

    names = run_config.names
    cfg = WeightSyncConfig(transport="gloo", timeout_s=10, ack_deadline_s=ACK_DEADLINE, heartbeat_s=0.5,
                           member_timeout_s=MEMBER_TIMEOUT, join_timeout_s=10)
    ws_args = [f"--weightsync.{k}={getattr(cfg, k)}" for k in
               ("transport", "timeout_s", "ack_deadline_s", "heartbeat_s", "member_timeout_s", "join_timeout_s")]
    base = load_file(str(tiny_dir / "model.safetensors"))
    log = open(tmp_path / "g1.log", "wb")  # noqa: SIM115, ASYNC230 - the child's stdout, closed in finally
    g1 = await asyncio.create_subprocess_exec(
        sys.executable, str(FOLLOWER), "--load", f"--nats.url={run_config.nats.url}",
        f"--run.prefix={run_config.run.prefix}", f"--run.run_dir={tmp_path / 'g1'}", f"--model.path={tiny_dir}",
        "--generator.generator_id=g1", "--generator.max_tokens=32", *ws_args,
        stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        # vLLM binds each CPU engine's OpenMP threads to core 0 by default: g1 sampling without pause there starved
        # g0's weight load (a CI run saw g0 miss a 20 s ack deadline). g1 gets the last core, as a second host would:
        # its OpenMP threads, and (by affinity, inherited by its engine processes) all the rest of it too, since its
        # scheduler loop alone took most of a core and starved this process (a CI run saw the trainer here hear no
        # heartbeat for 23 s and miss g1's ack)
        preexec_fn=lambda: os.sched_setaffinity(0, {LAST_CORE}),
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(LAST_CORE)})
    engine = Engine(str(tiny_dir), max_model_len=128, extra_args=vllm_args(cfg))
    nc_t = await connect(run_config.nats, name="trainer")
    nc_g = await connect(run_config.nats, name="g0")
    follow = None
    try:
        await engine.start()
        receiver = WeightReceiver(cfg, engine=engine, nc=nc_g, names=names, generator_id="g0")
        await receiver.start()
        follow = asyncio.create_task(receiver.loop())
        async with WeightPublisher(cfg, nc=nc_t, names=names, run_dir=run_config.run_dir) as pub:
            await _until(lambda: "g0" in pub.members(), 10, "g0 registered")
            await pub.publish(version=1, step=1, named_tensors=_weights(base, 1), batch_ids=[])
            assert engine.version == 1

            # g1 joins mid-run: it catches up to the latest version at once, then gets the next one
            await _until(lambda: b"FOLLOWER_READY g1" in (tmp_path / "g1.log").read_bytes() or g1.returncode is not None,
                         240, "g1 ready")
            assert g1.returncode is None, (tmp_path / "g1.log").read_text()[-3000:]
            await _until(lambda: pub.members().get("g1", {}).get("acked_version") == 1, 60, "g1 caught up")
            pv2 = await pub.publish(version=2, step=2, named_tensors=_weights(base, 2), batch_ids=[])
            assert pv2.version == 2 and pub.members()["g1"]["acked_version"] == 2
            assert not pub.members()["g1"]["fenced"]
            # g0 too: in the round, or (if a starved CPU made it miss the deadline) caught up and unfenced after it
            await _until(lambda: pub.members().get("g0", {}).get("acked_version") == 2, 60, "g0 acked 2")

            # g1 is SIGKILLed (with its engine processes) while version 3 is being pushed to it
            killed = asyncio.Event()

            async def kill_on_notification(msg):
                if not killed.is_set():
                    os.killpg(g1.pid, signal.SIGKILL)
                    killed.set()

            sub = await nc_t.subscribe(names.policy_subject, cb=kill_on_notification)
            t0 = time.monotonic()
            await pub.publish(version=3, step=3, named_tensors=_weights(base, 3), batch_ids=[])
            took = time.monotonic() - t0
            await sub.unsubscribe()
            assert killed.is_set()
            assert took < ACK_DEADLINE + 3, took  # the round ends within its deadline, not a hang
            await _until(lambda: engine.version == 3, 30, "g0 at version 3")
            await _until(lambda: pub.members().get("g0", {}).get("acked_version") == 3, 30, "g0 acked 3")
            store = PolicyStore(nc_t, names)
            await store.start()
            async with asyncio.timeout(30):  # g1 fenced at its last ack; g0 not (or no longer)
                while parse_fenced(await store.get(FENCED_KEY)) != {"g1": 2}:
                    await asyncio.sleep(0.1)
            assert await asyncio.wait_for(g1.wait(), 10) == -signal.SIGKILL

            # once the dead member expired, the next versions reach the survivor without waiting for anyone
            await _until(lambda: "g1" not in pub.members() or time.time() - pub.members()["g1"]["last_seen"]
                         > MEMBER_TIMEOUT + 0.5, 15, "g1 silent")
            t0 = time.monotonic()
            await pub.publish(version=4, step=4, named_tensors=_weights(base, 4), batch_ids=[])
            assert time.monotonic() - t0 < ACK_DEADLINE / 2
            await _until(lambda: engine.version == 4, 30, "g0 at version 4")
            assert "g1" not in pub.members()

            # g0 leaves: it is no longer waited for
            await receiver.stop()
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            follow = None
            await _until(lambda: not pub.members(), 5, "g0 left")
            t0 = time.monotonic()
            await pub.publish(version=5, step=5, named_tensors=_weights(base, 5), batch_ids=[])
            assert time.monotonic() - t0 < ACK_DEADLINE / 2
            assert engine.version == 4
            assert receiver.counters["load_failures"] == 0
    finally:
        if follow is not None:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
        if g1.returncode is None:
            try:
                os.killpg(g1.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await g1.wait()
        log.close()
        await nc_g.close()
        await nc_t.close()
        await engine.stop()
