"""Trainer side of weight sync: publish a new policy version to every generator, with deadlines and fencing.

``WeightPublisher.publish(version=, step=, named_tensors=, batch_ids=)`` runs one *round*:

1. snapshot: the Hugging Face-named tensors are copied into flat buckets (``weightsync/wire.py``), so training
   may go on while the copy travels (``submit`` returns right after this step: the overlap handle);
2. transport: ``file`` writes ``<shared_dir>/v<version>/model.safetensors``; ``gloo``/``nccl`` queue a push of the
   snapshot on every member's pair group (one sender thread per generator, so a slow or dead one delays nobody).
   ``nccl`` pair groups are NCCL groups and the snapshot's buckets stay on the trainer's current CUDA device, so a
   push goes GPU to GPU (``weightsync/collective.py``); it needs CUDA and NCCL here (checked at ``start``);
3. the ``PolicyVersion`` is written to the KV store with compare-and-set (``StaleWriter`` if another trainer wrote
   first) which also notifies ``names.policy_subject``;
4. acks (``VersionAck`` on ``names.ack_subject``) are collected until every targeted member acked or
   ``ack_deadline_s`` passed; a member whose push failed or that did not ack is fenced (``members.py`` documents
   the ``fenced`` key in the policy bucket that the buffer reads);
5. a provenance line goes to ``<run_dir>/weightsync/versions.jsonl``.

Rounds are serialised; ``publish`` awaits the round, ``submit`` returns a task after the snapshot. No step waits
on a peer without a bound: rendezvous and pushes are bounded by ``timeout_s`` (gloo raises), the round by
``ack_deadline_s``. Timeouts, failed pushes and fencings are logged and counted in ``counters``.

Membership (``names.membership_subject``): ``join`` arrives as a NATS request; the publisher starts its side of the
generator's pair-group rendezvous, queues a push of the latest snapshot (so a late joiner catches up at once), and
replies with the latest ``PolicyVersion`` (``version=-1`` if none was pushed by this trainer yet). ``heartbeat``
keeps a member alive, ``leave`` removes it; a member silent for ``member_timeout_s`` is dropped.

Hostile or broken input never stops a round or the trainer (each refusal is counted and dead-lettered with its
subject as the source and the reason):

* a join with an id that is not ``topics.names.valid_member_id``, or beyond ``max_members``, is refused;
* a round waits for a member whose handshake is not done (``members.py``) only until its ``handshake_timeout_s``
  is up, then drops and fences it: a join that never completes the handshake costs no round its ack deadline;
* an ack for a version this trainer never published, or from a generator that is not a member, is refused;
* the trainer owns the ``latest`` key: a value there that does not decode, or an older version written by someone
  else, is dead-lettered and rewritten; only a newer version of another trainer stops it (``StaleWriter``); a
  failed write of the fencing record is retried until it lands (``weightsync/policy_kv.py``).

Each member's pair group and sender thread: ``weightsync/pairs.py``; the membership state: ``weightsync/members.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

import orjson
import torch

from topics import codec
from topics.deadlines import within
from topics.errors import CodecError, ConfigError, InvalidMessage, StreamforgeError
from topics.names import MAX_MEMBER_ID, Names
from topics.nats import OnBadMessage, PolicyStore, publish_msg
from topics.schemas import Membership, PolicyVersion, VersionAck
from weightsync.collective import Rendezvous, device_of, nccl_usable, trainer_pair
from weightsync.config import COLLECTIVE_TRANSPORTS, NCCL_TRANSPORTS, WeightSyncConfig
from weightsync.files import write_version
from weightsync.members import FENCED_KEY, Member, Registry
from weightsync.pairs import Pair, call_soon, queue_push
from weightsync.policy_kv import PolicyKV
from weightsync.wire import Snapshot, dtype_of, pack

log = logging.getLogger("streamforge.weightsync.publisher")


class VersionRegression(StreamforgeError):
    """A version not newer than the one already in the store; continue from ``publisher.latest_version + 1``."""

    retriable = False


def _metric(key: str, value: float) -> None:
    try:
        from runtime.metrics import record_metric
    except ImportError:
        return
    record_metric(key, value)


class WeightPublisher:
    """Makes each new policy version available to the generators; see the module docstring for a round."""

    def __init__(self, cfg: WeightSyncConfig, *, nc: Any, names: Names, run_dir: Path,
                 trainer_id: str = "trainer") -> None:
        self.cfg = cfg
        self.nc = nc
        self.names = names
        self.run_dir = Path(run_dir)
        self.trainer_id = trainer_id
        self.transport = cfg.resolved_transport()
        self.shared_dir = Path(cfg.shared_dir) if cfg.shared_dir else self.run_dir / "weights"
        # floating-point tensors packed in the engines' dtype (push_dtype; "auto" unresolved by roles.py: "keep")
        self._push_dtype = None if cfg.push_dtype in ("auto", "keep") else dtype_of(cfg.push_dtype)
        self.store = PolicyStore(nc, names)
        self.registry = Registry(member_timeout_s=cfg.member_timeout_s)
        self.counters: Counter[str] = Counter()
        self.latest_version = -1
        self.kv = PolicyKV(self.store, self.registry, timeout_s=cfg.timeout_s, counters=self.counters, metric=_metric)
        self._latest: Snapshot | None = None
        self._latest_pv: PolicyVersion | None = None
        self._rdzv: Rendezvous | None = None
        self._lock = asyncio.Lock()
        self._round: asyncio.Task | None = None
        self._waiting: set[str] = set()
        self._round_version = -1
        self._acks_done = asyncio.Event()
        self._round_acks: dict[str, dict[str, Any]] = {}
        self._subs: list[Any] = []
        self._detached: dict[str, Pair] = {}  # pairs of members expired for silence, kept in case they are alive
        self._started = False
        self._stopped = False

    @property
    def on_bad(self) -> OnBadMessage | None:
        """What to do with a membership or ack message that does not decode, or a policy-store value this trainer
        cannot use (the trainer dead-letters them)."""
        return self.kv.on_bad

    @on_bad.setter
    def on_bad(self, fn: OnBadMessage | None) -> None:
        self.kv.on_bad = fn

    @property
    def collective(self) -> bool:
        return self.transport in COLLECTIVE_TRANSPORTS

    def _pair_device(self):
        """The CUDA device the NCCL pairs and the snapshots use (the event loop thread's current one); None for
        the other transports."""
        return device_of(self.transport) if self.transport in NCCL_TRANSPORTS else None

    @property
    def address(self) -> str:
        return self._rdzv.address if self._rdzv else ""

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        if self.transport in NCCL_TRANSPORTS and not nccl_usable():
            raise ConfigError("weightsync.transport", f"{self.transport} needs a CUDA device and a torch built with NCCL")
        self._started = True
        await self.store.start()
        pv = await self.kv.read_latest()
        self.latest_version = pv.version if pv is not None else -1
        self.registry.latest_version = self.latest_version
        self.registry.load_fenced(await self.store.get(FENCED_KEY))
        if self.collective:
            self._rdzv = await asyncio.to_thread(Rendezvous, self.cfg.host, self.cfg.port,
                                                 timeout_s=self.cfg.timeout_s)
        self._subs.append(await self.nc.subscribe(self.names.membership_subject, cb=self._on_membership))
        self._subs.append(await self.nc.subscribe(self.names.ack_subject, cb=self._on_ack))
        await self.nc.flush()  # the server has both subscriptions before start returns: no join or ack is missed
        (self.run_dir / "weightsync").mkdir(parents=True, exist_ok=True)
        log.info("weight publisher %s: transport %s%s, latest version %d", self.trainer_id, self.transport,
                 f" at {self.address}" if self._rdzv else "", self.latest_version)

    async def stop(self) -> None:
        if not self._started or self._stopped:
            return
        self._stopped = True
        if self._round is not None and not self._round.done():
            try:
                await within(asyncio.shield(self._round), self.cfg.ack_deadline_s + 1)
            except Exception:  # noqa: BLE001 - stopping: a failed or slow last round must not block it
                self._round.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001, S110 - the connection may already be closed at shutdown
                pass
        self.kv.stop()
        for m in self.registry.members.values():
            if isinstance(m.state, Pair):
                m.state.close()
        for pair in self._detached.values():
            pair.close()
        if self._rdzv is not None:
            self._rdzv.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- publication ----------------------------------------------------------------------------
    async def publish(self, *, version: int, step: int,
                      named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                      batch_ids: list[str]) -> PolicyVersion:
        """Run one round (see the module docstring) and return the published ``PolicyVersion``."""
        return await (await self.submit(version=version, step=step, named_tensors=named_tensors,
                                        batch_ids=batch_ids))

    async def submit(self, *, version: int, step: int,
                     named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                     batch_ids: list[str]) -> asyncio.Task[PolicyVersion]:
        """Snapshot the weights now and return the round as a task, so the caller's next step overlaps it.

        The snapshot is taken in the caller's thread (a DTensor's ``full_tensor()`` is a collective every rank
        must run in the same order). Rounds run one at a time, in submission order.
        """
        if not self._started or self._stopped:
            raise RuntimeError("WeightPublisher is not running")
        if version <= self.latest_version:
            raise VersionRegression(f"version {version} is not newer than the published {self.latest_version}")
        self.latest_version = version
        t0 = time.perf_counter()
        device = self._pair_device() or "cpu"
        snapshot = pack(named_tensors(), version=version, step=step, bucket_bytes=self.cfg.bucket_bytes,
                        device=device, dtype=self._push_dtype)
        snapshot_s = time.perf_counter() - t0
        previous = self._round
        self._round = asyncio.ensure_future(self._run_round(previous, snapshot, list(batch_ids), snapshot_s))
        return self._round

    async def _run_round(self, previous: asyncio.Task | None, snapshot: Snapshot, batch_ids: list[str],
                         snapshot_s: float) -> PolicyVersion:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        t0 = time.perf_counter()
        version = snapshot.version
        pv = PolicyVersion(version=version, step=snapshot.layout.step, transport=self.transport,
                           trainer_id=self.trainer_id, batch_ids=batch_ids)
        if self.transport == "file":
            pv.path = str(await asyncio.to_thread(write_version, self.shared_dir, snapshot,
                                                  keep=self.cfg.keep_versions))
        else:
            pv.address = self.address
        sends: dict[str, tuple[Pair, asyncio.Future]] = {}
        async with self._lock:
            now = time.time()
            for m in self.registry.expire(now=now):
                log.warning("generator %s silent for %.1f s: dropped from membership", m.generator_id,
                            now - m.last_seen)
                self.counters["members_expired"] += 1
                if m.generator_id not in self.registry.fenced:
                    self.counters["fenced"] += 1
                self.registry.fence(m.generator_id, version, now=now, last_acked=m.acked_version)
                if isinstance(m.state, Pair) and not m.state.broken:
                    self._detached[m.generator_id] = m.state  # re-attached if it turns out to be alive
            if self.collective:  # one known from heartbeats only joins on this version: its handshake starts now
                for m in self.registry.members.values():
                    if not m.confirmed and not m.joined:
                        m.joined_at = now
            self._expire_unconfirmed(now)
            for gid in self.registry.expire_fences(self.cfg.fence_expiry_s, now=now):
                log.info("fencing record: %s never acked and is gone: forgotten", gid)
                self.counters["fences_expired"] += 1
            # Every member is expected to ack. A member without a working pair group (its pair broke, or it is
            # known from its heartbeats only) joins on this notification and gets the snapshot pushed at once; a
            # dead one is fenced at the deadline and expires from the membership later. One whose handshake is not
            # done is waited for only until its handshake time is up (then it is dropped and fenced).
            targets = list(self.registry.members.values())
            self._round_version = version
            self._round_acks = {}
            self._waiting = {m.generator_id for m in targets if not self.registry.acked(m.generator_id, version)}
            self._acks_done = asyncio.Event()
            if not self._waiting:
                self._acks_done.set()
            self.registry.latest_version = version
            await self.kv.store_version(pv)
            self._latest_pv = pv
            if self.collective:
                self._latest = snapshot
                for m in self.registry.members.values():
                    if self._reachable(m):
                        sends[m.generator_id] = (m.state, queue_push(m.state, m.generator_id, snapshot,
                                                                          timeout_s=self.cfg.timeout_s))
                # best effort to members expired for silence: a starved but live one still gets the version (its
                # heartbeat re-attaches it); a dead one fails its push, and nobody waits for either
                for gid, pair in list(self._detached.items()):
                    fut = queue_push(pair, gid, snapshot, timeout_s=self.cfg.timeout_s)
                    fut.add_done_callback(lambda f, gid=gid, pair=pair: self._on_detached_push_done(gid, pair, f))
        for gid, (pair, fut) in sends.items():
            fut.add_done_callback(lambda f, gid=gid, pair=pair: self._on_push_done(gid, version, pair, f))
        if self.kv.fence_dirty:  # a failed write of an earlier round: retried now
            await self.kv.write_fenced()
        if not await self._wait_for_acks():
            late = sorted(self._waiting)
            log.warning("version %d: no ack within %.1f s from %s: fencing", version, self.cfg.ack_deadline_s, late)
            self.counters["ack_timeouts"] += len(late)
            for gid in late:
                self._fence(gid, version)
        self._waiting = set()
        await self.kv.write_fenced()
        round_s = time.perf_counter() - t0
        self.counters["rounds"] += 1
        _metric("weightsync/round_s", round_s)
        _metric("weightsync/snapshot_s", snapshot_s)
        self._provenance(pv, snapshot, targets=[m.generator_id for m in targets], round_s=round_s,
                         snapshot_s=snapshot_s)
        return pv

    async def _wait_for_acks(self) -> bool:
        """Waits for the round's acks until ``ack_deadline_s``; an unconfirmed member is waited for only until its
        handshake time is up, then dropped. Returns whether every awaited member acked."""
        deadline = time.monotonic() + self.cfg.ack_deadline_s
        while not self._acks_done.is_set():
            wake = deadline - time.monotonic()
            if wake <= 0:
                return False
            pending = [m.joined_at for gid in self._waiting
                       if (m := self.registry.members.get(gid)) is not None and not m.confirmed]
            if pending:
                wake = min(wake, max(0.05, min(pending) + self.cfg.handshake_timeout_s - time.time() + 0.01))
            try:
                await within(self._acks_done.wait(), wake)
            except TimeoutError:
                async with self._lock:
                    self._expire_unconfirmed(time.time())
        return True

    # -- transport --------------------------------------------------------------------------------
    def _reachable(self, m: Member) -> bool:
        return isinstance(m.state, Pair) and not m.state.broken

    def _on_detached_push_done(self, gid: str, pair: Pair, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        self.counters["transfer_failures"] += 1
        log.info("push to expired generator %s failed: it is gone (%s)", gid, type(fut.exception()).__name__)
        pair.close()
        if self._detached.get(gid) is pair:
            del self._detached[gid]

    def _on_push_done(self, gid: str, version: int, pair: Pair, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        m = self.registry.members.get(gid)
        if exc is None:
            self.counters["pushes"] += 1
            _metric("weightsync/push_s", fut.result())
            return
        kind = "timeouts" if "imeout" in str(exc) or isinstance(exc, TimeoutError) else "transfer_failures"
        self.counters[kind] += 1
        log.warning("version %d: push to %s failed (%s: %s); dropping its pair group and fencing it", version,
                    gid, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        pair.close()
        if m is None or m.state is not pair:
            return  # the generator already re-joined on a new pair, which brings it the latest version
        if version == self._round_version and gid in self._waiting and not self.registry.acked(gid, version):
            self._fence(gid, version)
            self._done_waiting(gid)

    # -- membership and acks -------------------------------------------------------------------
    async def _on_membership(self, msg: Any) -> None:
        try:
            mem = codec.decode(msg.data, expect=Membership)
        except CodecError as exc:  # a bad message is counted and dead-lettered, never fatal
            log.warning("bad membership message: %s", exc)
            self.counters["bad_messages"] += 1
            if self.on_bad is not None:
                await self.on_bad(msg.subject, bytes(msg.data), exc)
            return
        log.debug("membership %s from %s (version %d)", mem.event, mem.generator_id[:MAX_MEMBER_ID],
                  mem.version)
        refusal = self.registry.refuse_membership(mem, max_members=self.cfg.max_members)
        if refusal:
            self.counters["refused_joins"] += 1
            if self.counters["refused_joins"] <= 10 or self.counters["refused_joins"] % 1000 == 0:
                log.warning("membership refused (%d so far): %s", self.counters["refused_joins"], refusal)
            if self.on_bad is not None:
                await self.on_bad(msg.subject, bytes(msg.data), InvalidMessage(refusal))
            return
        async with self._lock:
            previous = self.registry.members.get(mem.generator_id)
            old_state = previous.state if previous is not None else self._detached.get(mem.generator_id)
            self._detached.pop(mem.generator_id, None)
            m = self.registry.on_membership(mem)
            if m is not None and not self.collective:
                m.confirmed = True  # the file transport has no handshake: a join or heartbeat is the whole of it
            elif m is not None and mem.event == "join" and not msg.reply:
                m.joined = False  # a plain announcement opens no pair: its handshake starts with a round it can join
            if mem.event == "leave":
                log.info("generator %s left", mem.generator_id)
                self._waiting.discard(mem.generator_id)
                if isinstance(old_state, Pair):
                    old_state.close()
                if not self._waiting:
                    self._acks_done.set()
                return
            if mem.event != "join" or m is None:
                if m is not None and m.state is None and isinstance(old_state, Pair):
                    m.state = old_state  # a member that was expired for silence, back with its pair intact
                    group = old_state.group
                    m.confirmed = group is not None and group.done() and group.exception() is None
                return
            log.info("generator %s joined (pid %d, version %d)", mem.generator_id, mem.pid, mem.version)
            if isinstance(old_state, Pair):
                old_state.close()
            m.state = None
            reply = self._latest_pv
            if self.collective and self._rdzv is not None and msg.reply:  # a plain announcement opens no pair
                pair = Pair(session=m.session)
                pair.group = pair.executor.submit(trainer_pair, self._rdzv, m.session, timeout_s=self.cfg.timeout_s,
                                                  backend=self.transport, device=self._pair_device())
                loop = asyncio.get_running_loop()
                pair.group.add_done_callback(lambda f, gid=m.generator_id, pair=pair: call_soon(
                    loop, self._on_pair_ready, gid, pair, f))
                m.state = pair
                if self._latest is not None and self._latest.version > mem.version:
                    fut = queue_push(pair, m.generator_id, self._latest, timeout_s=self.cfg.timeout_s)
                    v = self._latest.version
                    fut.add_done_callback(lambda f, gid=m.generator_id, v=v, pair=pair:
                                          self._on_push_done(gid, v, pair, f))
                else:
                    reply = None
        if msg.reply:
            if reply is None:
                reply = PolicyVersion(version=-1, step=-1, transport=self.transport, address=self.address,
                                      trainer_id=self.trainer_id)
            await publish_msg(self.nc, msg.reply, reply)

    async def _on_ack(self, msg: Any) -> None:
        try:
            ack = codec.decode(msg.data, expect=VersionAck)
        except CodecError as exc:  # a bad message is counted and dead-lettered, never fatal
            log.warning("bad ack message: %s", exc)
            self.counters["bad_messages"] += 1
            if self.on_bad is not None:
                await self.on_bad(msg.subject, bytes(msg.data), exc)
            return
        refusal = self.registry.refuse_ack(ack, published=self.latest_version)
        if refusal:
            self.counters["refused_acks"] += 1
            if self.counters["refused_acks"] <= 10 or self.counters["refused_acks"] % 1000 == 0:
                log.warning("ack refused (%d so far): %s", self.counters["refused_acks"], refusal)
            if self.on_bad is not None:
                await self.on_bad(msg.subject, bytes(msg.data), InvalidMessage(refusal))
            return
        unfenced = self.registry.on_ack(ack)
        if unfenced:
            log.info("generator %s caught up at version %d: unfenced", ack.generator_id, ack.version)
            self.kv.spawn(self.kv.write_fenced())
        if ack.version == self._round_version:
            self._round_acks[ack.generator_id] = {"ok": ack.ok, "pause_ms": ack.pause_ms,
                                                  "transfer_ms": ack.transfer_ms, "at": ack.created_at,
                                                  "error": ack.error}
        if ack.version >= self._round_version and ack.generator_id in self._waiting:
            if not ack.ok:
                log.warning("generator %s failed to load version %d: %s", ack.generator_id, ack.version, ack.error)
                self.counters["load_failures"] += 1
                self._fence(ack.generator_id, ack.version)
            self._done_waiting(ack.generator_id)

    def _on_pair_ready(self, gid: str, pair: Pair, fut: Future) -> None:
        """A member's pair group came up (in the event loop): its handshake is done, it is confirmed."""
        m = self.registry.members.get(gid)
        if m is not None and m.state is pair and not fut.cancelled() and fut.exception() is None:
            m.confirmed = True

    def _expire_unconfirmed(self, now: float) -> None:
        for m in self.registry.expire_unconfirmed(self.cfg.handshake_timeout_s, now=now):
            log.warning("generator %s joined %.1f s ago without completing the handshake: dropped", m.generator_id,
                        now - m.joined_at)
            self.counters["handshake_timeouts"] += 1
            if m.generator_id in self._waiting:  # it missed this round's version: fenced (it expires, never acked)
                self._fence(m.generator_id, self._round_version)
                self._done_waiting(m.generator_id)
            if isinstance(m.state, Pair):
                m.state.close()

    def _done_waiting(self, gid: str) -> None:
        self._waiting.discard(gid)
        if not self._waiting:
            self._acks_done.set()

    def _fence(self, gid: str, version: int) -> None:
        if gid not in self.registry.fenced:
            self.counters["fenced"] += 1
            log.warning("generator %s fenced at version %d", gid, version)
        self.registry.fence(gid, version)

    def _provenance(self, pv: PolicyVersion, snapshot: Snapshot, *, targets: list[str], round_s: float,
                    snapshot_s: float) -> None:
        line = {"version": pv.version, "step": pv.step, "transport": pv.transport, "path": pv.path,
                "address": pv.address, "trainer_id": pv.trainer_id, "batch_ids": pv.batch_ids,
                "published_at": pv.created_at, "bytes": snapshot.nbytes, "targets": targets,
                "acks": self._round_acks, "fenced": sorted(self.registry.fenced), "round_s": round_s,
                "snapshot_s": snapshot_s}
        with open(self.run_dir / "weightsync" / "versions.jsonl", "ab") as f:
            f.write(orjson.dumps(line) + b"\n")

    def members(self) -> dict[str, dict[str, Any]]:
        """A status view: every member's acked version, whether it completed its handshake (rounds wait only for
        those) and whether it is fenced."""
        return {gid: {"acked_version": m.acked_version, "last_seen": m.last_seen, "confirmed": m.confirmed,
                      "fenced": gid in self.registry.fenced,
                      "connected": self._reachable(m) if self.collective else True}
                for gid, m in self.registry.members.items()}
