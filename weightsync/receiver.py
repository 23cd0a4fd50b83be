"""Generator side of weight sync: follow the policy store, load each new version into the engine, acknowledge it.

``WeightReceiver(cfg, engine=, nc=, names=, generator_id=)`` is driven by the generator role: ``start()``, then the
role supervises ``loop()``, then ``stop()`` (which says ``leave``). ``loop()`` runs two tasks:

* heartbeat: a ``Membership`` ``heartbeat`` with the loaded version every ``heartbeat_s`` (waits on a timer only);
* follow: consumes ``PolicyStore.watch()`` (the current version first, which is how a late joiner catches up, then
  every newer one). For each version newer than ``engine.version``:

  - ``file``: ``engine.swap_rpc(v, "reload_weights", kwargs={"weights_path": pv.path})``;
  - ``gloo``/``nccl``: if not joined to that trainer's rendezvous yet (or the pair broke), *join*: a NATS request
    on the membership subject that the trainer answers after starting its side of the pair group, with the version
    it will push at once (``-1`` for none); then ``init_weight_transfer_engine``. Each push is received and
    staged by the worker while generation continues (``weightsync_prefetch``: the transfer, then vLLM's layerwise
    reload into a shadow model, ``weightsync/staging.py``); the receiver waits for that (``weightsync_ready``)
    before it pauses, so the pause holds only the commit of the staged version (tensor copies): vLLM's
    ``start_weight_update``, ``update_weights`` and ``finish_weight_update`` run in the worker in one call
    (``weightsync_commit``), and the pause, that call, the new version's label and the resume are one call into
    the engine core (``Engine.swap_rpc``, producers/vllm_swap.py), so a swap costs the engine a prefetch, a few
    readiness polls and the pause around the commit;
  - ``none``: the initial weights of the model path; adopted without loading.

  and publishes a ``VersionAck`` (ok, pause and transfer times, or the error). A failed transfer drops the pair;
  the next attempt re-joins, and the trainer's join push brings the newest version. Every RPC into the engine and
  every NATS request is bounded by ``timeout_s``; timeouts are logged and counted in ``counters``.

Generation keeps going throughout: with ``pause_mode="keep"`` paused requests continue after the swap, and their
later tokens carry the new version (the engine stamps per token).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from typing import Any, Self

import nats.errors
from opentelemetry import trace

from topics.deadlines import cancel_and_wait, within
from topics.errors import StreamforgeError, TimeoutExpired
from topics.names import Names
from topics.nats import PolicyStore, publish_msg, request_msg
from topics.schemas import Membership, PolicyVersion, VersionAck
from topics.tracing import context_of_version, link_to
from weightsync.config import COLLECTIVE_TRANSPORTS, NCCL_TRANSPORTS, WeightSyncConfig
from weightsync.members import FENCED_KEY, Registry, parse_fenced

log = logging.getLogger("streamforge.weightsync.receiver")
# what a join request meets when no trainer answers it (none started yet, or it is busy past the timeout)
NO_TRAINER = (TimeoutExpired, nats.errors.NoRespondersError, nats.errors.TimeoutError)
_tracer = trace.get_tracer("streamforge.weightsync")


class LoadFailed(StreamforgeError):
    """A version could not be loaded into the engine (retriable: the next attempt re-joins)."""

    retriable = True


class WeightReceiver:
    """Keeps one generator's engine on the latest policy version; see the module docstring."""

    name = "weightsync"

    def __init__(self, cfg: WeightSyncConfig, *, engine: Any, nc: Any, names: Names, generator_id: str) -> None:
        self.cfg = cfg
        self.engine = engine
        self.nc = nc
        self.names = names
        self.generator_id = generator_id
        self.store = PolicyStore(nc, names)
        self.counters: Counter[str] = Counter()
        self.latest_seen = -1  # newest version announced by the store
        self.pauses_ms: list[float] = []
        self._address = ""  # trainer rendezvous this engine is joined to ("" = none)
        self._expected_s = 0.0  # how long the last push took to receive and stage in the worker
        self._started = False
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self.store.start()
        await self._announce("join")

    async def stop(self) -> None:
        if not self._started or self._stopped:
            return
        self._stopped = True
        try:
            await self._announce("leave")
        except Exception as exc:  # noqa: BLE001 - the broker may already be gone at shutdown
            log.warning("could not announce leave: %s", exc)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def loop(self) -> None:
        """Heartbeat and follow the store until cancelled (a crash of either propagates to the supervisor).

        Not a ``TaskGroup``: on Python 3.11 it cancels its tasks once, and a cancel that nats-py's ``wait_for``
        dropped (inside a request or the watch's setup) left ``_follow`` in the watch and the group waiting on it
        for ever. Both tasks are ended by ``cancel_and_wait``, which cancels again until they are."""
        tasks = [asyncio.create_task(self._heartbeat(), name="weightsync-heartbeat"),
                 asyncio.create_task(self._follow(), name="weightsync-follow")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a crash; the heartbeat never returns, and the watch only when its store is closed
        finally:
            await cancel_and_wait(tasks)

    # -- membership -------------------------------------------------------------------------------
    def _membership(self, event: str) -> Membership:
        return Membership(generator_id=self.generator_id, event=event, version=int(self.engine.version),
                          host=socket.gethostname(), pid=os.getpid())

    async def _announce(self, event: str) -> None:
        await within(publish_msg(self.nc, self.names.membership_subject, self._membership(event)), self.cfg.timeout_s)

    async def _heartbeat(self) -> None:
        """Waits ``heartbeat_s`` between beats; a failed beat is logged and counted, never fatal."""
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                await self._announce("heartbeat")
            except Exception as exc:  # noqa: BLE001 - a missed beat is counted, never fatal
                self.counters["heartbeat_failures"] += 1
                log.warning("heartbeat failed: %s", exc)

    async def _join(self, pv: PolicyVersion) -> int:
        """Join the trainer's rendezvous at ``pv.address``; returns the version the trainer pushes now (-1: none)."""
        try:
            msg, reply = await self._request_join()
        except NO_TRAINER as exc:
            self.counters["join_timeouts"] += 1
            raise LoadFailed(f"no trainer answered the join for version {pv.version}: {exc}") from exc
        await self._open_pair(msg, reply, pv)
        return reply.version

    async def _request_join(self) -> tuple[Membership, PolicyVersion]:
        """The join request and the trainer's answer (it answers after starting its side of a new pair group)."""
        msg = self._membership("join")
        return msg, await request_msg(self.nc, self.names.membership_subject, msg, timeout=self.cfg.join_timeout_s,
                                      expect=PolicyVersion)

    async def _open_pair(self, msg: Membership, reply: PolicyVersion, pv: PolicyVersion | None = None) -> None:
        """Start this engine's side of the pair group of the join ``msg``, at the address the trainer's ``reply``
        names (``init_weight_transfer_engine`` returns at once: the rendezvous, and the staging copy's build, run on
        the worker's transport thread)."""
        address = reply.address or (pv.address if pv is not None else "")
        transport = reply.transport or (pv.transport if pv is not None else "")
        backend = transport if transport in NCCL_TRANSPORTS else "gloo"
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {"address": address, "session": Registry.session_of(msg),
                "timeout_s": self.cfg.timeout_s, "host": self.cfg.generator_host,
                "staged": self.cfg.staged_load, "rehearsals": self.cfg.staged_rehearsals, "backend": backend}
        await self._rpc(self.engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                        "init_weight_transfer_engine")
        self._address = address
        self.counters["joins"] += 1
        log.info("joined the trainer at %s (push of version %d)", address, reply.version)

    async def _warm_join(self) -> None:
        """Join a trainer that is already up before it publishes anything, so that its first push finds the pair
        group formed and the worker's staging copy built (both were part of the first swap, with the generator
        idle behind it). No trainer answering (none started yet) leaves the join to the first version, as does a
        trainer whose transport has no pair group; a trainer that has published pushes its version at once."""
        try:
            msg, reply = await self._request_join()
        except NO_TRAINER as exc:
            log.info("no trainer to join yet (%s): joining at its first version", type(exc).__name__)
            return
        if reply.transport not in COLLECTIVE_TRANSPORTS or not reply.address:
            return
        try:
            await self._open_pair(msg, reply)
        except Exception as exc:  # noqa: BLE001 - the first version joins again
            log.warning("early join failed (%s: %s): joining at the first version", type(exc).__name__, exc)
            self._address = ""
            return
        if reply.version > self.engine.version:  # this trainer has published: its push of that version is coming
            await self.sync(reply)

    # -- following the store ------------------------------------------------------------------
    async def _follow(self) -> None:
        """Joins a trainer already up (``_warm_join``), then consumes the store's watch; waits on it between
        versions; each version is loaded (or fails) and acked."""
        await self._warm_join()
        async for pv in self.store.watch():
            self.latest_seen = max(self.latest_seen, pv.version)
            if pv.version <= self.engine.version:
                continue
            await self.sync(pv)

    async def sync(self, pv: PolicyVersion) -> bool:
        """Bring the engine to ``pv`` (or newer, for a join push); ack; returns whether it succeeded.

        Traced as ``generator.swap``, linked to the span that published ``pv`` (its ``trace_context``), so an
        episode's trace reaches every generator's adoption of the weights it trained."""
        link = link_to(context_of_version(pv))
        with _tracer.start_as_current_span("generator.swap", links=[link] if link else [], attributes={
                "version": pv.version, "generator_id": self.generator_id, "transport": pv.transport}) as span:
            for attempt in (1, 2):
                try:
                    await self._sync_once(pv)
                    span.set_attribute("ok", True)
                    return True
                except Exception as exc:  # noqa: BLE001 - any failure is retried once, then acked as failed
                    self.counters["load_failures"] += 1
                    log.warning("version %d: attempt %d failed: %s: %s", pv.version, attempt, type(exc).__name__,
                                exc)
                    self._address = ""
                    err = f"{type(exc).__name__}: {exc}"
            span.set_attribute("ok", False)
            await self._ack(pv.version, ok=False, error=err)
            return False

    async def _sync_once(self, pv: PolicyVersion) -> None:
        if pv.transport == "none":
            await self.engine.relabel(pv.version)
            await self._ack(pv.version)
            return
        if pv.transport == "file":
            t0 = time.perf_counter()
            self._check_weights_dir(pv.path)
            pause, _ = await self._swap(pv.version, "reload_weights", kwargs={"weights_path": pv.path})
            await self._ack(pv.version, pause_ms=pause, transfer_ms=(time.perf_counter() - t0) * 1000)
            return
        if pv.transport not in COLLECTIVE_TRANSPORTS:
            raise LoadFailed(f"unknown transport {pv.transport!r}")
        if not self._address or self._address != pv.address or await self._fenced():
            pushed = await self._join(pv)
            if pushed > self.engine.version:
                await self._receive(pushed)
            elif pushed < 0:  # this trainer has nothing to push (it has not published since it started)
                log.info("version %d: the trainer at %s pushes nothing now; waiting for its next version",
                         pv.version, self._address)
                return
        if pv.version > self.engine.version:
            await self._receive(pv.version)

    async def _fenced(self) -> bool:
        """Whether the trainer fenced this generator (then it re-joins to get a fresh pair and the latest push)."""
        try:
            data = await within(self.store.get(FENCED_KEY), self.cfg.timeout_s)
        except Exception as exc:  # noqa: BLE001 - unknown fencing state: carry on with the current pair
            log.warning("could not read the fencing record: %s", exc)
            return False
        return self.generator_id in parse_fenced(data)

    async def _receive(self, version: int) -> None:
        """Prefetch the push of ``version`` (generation continues), then load it inside ``engine.swap``."""

        t0 = time.perf_counter()
        llm = self.engine.llm
        await self._rpc(llm.collective_rpc("weightsync_prefetch", args=(version,)), "prefetch")
        await self._wait_staged(llm)
        pause, stats = await self._swap(version, "weightsync_commit", (version,))  # the commit of the staged version
        self._expected_s = float(stats.get("receive_s", 0.0)) + float(stats.get("stage_s", 0.0))
        if int(stats["version"]) != version:
            await self.engine.relabel(int(stats["version"]))
            raise LoadFailed(f"expected version {version}, the trainer pushed {int(stats['version'])}")
        self.pauses_ms.append(pause)
        log.info("version %d: %.0f MB received in %.2f s (%d buffers reused), staged in %.2f s, paused %.1f ms",
                 version, float(stats.get("bytes", 0)) / 1e6, float(stats.get("receive_s", 0.0)),
                 int(stats.get("reused_buffers", 0)), float(stats.get("stage_s", 0.0)), pause)
        await self._ack(version, pause_ms=pause, transfer_ms=(time.perf_counter() - t0) * 1000)

    async def _wait_staged(self, llm: Any) -> None:
        """Wait until the worker has received and staged the push, so that none of it happens inside the pause.

        Asks ``weightsync_ready`` (non-blocking): a blocking wait inside the worker would stall the engine's loop,
        and the engine offers no completion channel. The first ask comes after 70% of the time the last push took
        to receive and stage, then asks back off from 2 ms to a twentieth of that time (5 to 50 ms), so a push that
        takes as long as the last one is seen within a few ms of being ready with a handful of asks. Bounded by
        ``2 * timeout_s``; past that (or on a failed receive) the commit reports the failure under its own bound."""
        deadline = time.monotonic() + self.cfg.timeout_s * 2
        expected = self._expected_s
        if expected > 0:
            await asyncio.sleep(min(0.7 * expected, self.cfg.timeout_s))
        delay, cap = 0.002, min(max(expected / 20, 0.005), 0.05)
        while time.monotonic() < deadline:
            state = (await self._rpc(llm.collective_rpc("weightsync_ready"), "weightsync_ready"))[0]
            if state["done"] or not state["pending"]:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)

    @staticmethod
    def _check_weights_dir(path: str) -> None:
        # vLLM's reload_weights on a missing or empty directory leaves the model on meta tensors (the next step
        # kills the engine): refuse before pausing anything.
        if not os.path.isdir(path) or not any(name.endswith(".safetensors") for name in os.listdir(path)):
            raise LoadFailed(f"no safetensors in {path!r}")

    async def _swap(self, version: int, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                    ) -> tuple[float, Any]:
        """``engine.swap_rpc`` with the worker RPC ``method``: (pause ms, its result). Bounded by 3 x ``timeout_s``
        in ``keep`` mode, where the pause completes within a scheduler step; a ``wait`` pause first lets in-flight
        requests finish, which a long generation can stretch past any bound, so it is not bounded."""
        call = self.engine.swap_rpc(version, method, args, kwargs, mode=self.cfg.pause_mode)
        if self.cfg.pause_mode == "wait":
            return await call
        return await self._rpc(call, method, factor=3)

    async def _rpc(self, coro: Any, what: str, *, factor: float = 1.0) -> Any:
        try:
            return await within(coro, self.cfg.timeout_s * factor)
        except TimeoutError:
            self.counters["rpc_timeouts"] += 1
            raise TimeoutExpired(f"engine call {what} took longer than {self.cfg.timeout_s * factor:.1f} s") from None

    async def _ack(self, version: int, *, ok: bool = True, pause_ms: float = 0.0, transfer_ms: float = 0.0,
                   error: str = "") -> None:
        ack = VersionAck(generator_id=self.generator_id, version=version, ok=ok, pause_ms=pause_ms,
                         transfer_ms=transfer_ms, error=error[:500])
        try:
            await within(publish_msg(self.nc, self.names.ack_subject, ack), self.cfg.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a lost ack is counted; the trainer fences on its deadline
            self.counters["ack_failures"] += 1
            log.warning("could not ack version %d: %s", version, exc)
