"""NATS clients: connection with auth/TLS and retries, schema messages with trace headers, the policy KV store.

``PolicyStore`` keeps the latest ``PolicyVersion`` in a JetStream KV bucket (``{prefix}_policy``, key
``latest``), and the trainer's ``TrainerProgress`` (key ``progress``, written after every step). ``publish`` is a compare-and-set on the bucket revision, so a stale trainer (a zombie after a
restart, say) cannot overwrite a newer version: it gets ``StaleWriter``. After a successful write the version is
also announced on the ``{prefix}.policy.version`` subject (with trace context), for subscribers that do not watch
the bucket. Every request is bounded by ``nats.request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from topics import codec, refusals
from topics.config import NatsConfig
from topics.deadlines import within
from topics.errors import BrokerUnavailable, CodecError, StaleWriter, TimeoutExpired
from topics.names import Names
from topics.schemas import PolicyVersion, TrainerProgress
from topics.tracing import context_from_nats, nats_headers

# ``on_bad(source, raw value, error)``: what a reader does with a NATS message or KV value it cannot decode
OnBadMessage = Callable[[str, bytes, CodecError], Awaitable[None]]

log = logging.getLogger("streamforge.nats")


class _Client(NATS):
    """nats-py's client, with a PONG that finds its flush abandoned ignored instead of fatal.

    nats-py 2.16 keeps a flush's future in its PONG queue when the flush times out or is cancelled (as
    ``refusals.subscribe_checked`` does when the server refuses the subscription) and later calls ``set_result`` on
    it: ``InvalidStateError`` ends the connection's read loop, and from then on nothing on that connection is read
    (a later refusal or reply never arrives; its request times out). Seen under load in
    tests/integration/test_nats_permissions.py."""

    async def _process_pong(self) -> None:
        if self._pongs:  # PONGs answer PINGs in order: the head is this PONG's, abandoned or not
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


def connect_kwargs(cfg: NatsConfig, *, name: str) -> dict[str, Any]:
    """nats-py connect() keyword arguments (auth and TLS); secrets come from the environment."""
    if not cfg.url:
        raise BrokerUnavailable("nats", "<unset>", "nats.url is empty (set STREAMFORGE_NATS_URL)")
    kw: dict[str, Any] = {
        "servers": cfg.url.split(","),
        "name": name,
        "connect_timeout": cfg.connect_timeout_s,
        "max_reconnect_attempts": 1,  # the initial connect is retried by ``connect`` below
        "reconnect_time_wait": 0.5,
    }
    token = os.environ.get(cfg.token_env, "")
    if token:
        kw["token"] = token
    if cfg.user:
        kw["user"] = cfg.user
        kw["password"] = os.environ.get(cfg.password_env, "")
    if cfg.tls_ca or cfg.tls_cert or any(u.startswith("tls://") for u in kw["servers"]):
        ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
        if cfg.tls_cert:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        kw["tls"] = ctx
    return kw


async def connect(cfg: NatsConfig, *, name: str) -> NATS:
    """Connect with retries and exponential backoff; ``BrokerUnavailable`` names the address if all fail."""
    kw = connect_kwargs(cfg, name=name)
    made: list[NATS] = []

    async def on_error(exc: Exception) -> None:
        log.warning("nats %s: %s", name, exc)
        if made:  # a permissions violation fails the call that caused it at once (topics/refusals.py)
            refusals.note(made[0], exc)

    delay = 0.25
    for attempt in range(1, cfg.connect_retries + 1):
        try:
            # bounded: nats-py can retry a failing TLS handshake forever inside one connect()
            nc = _Client()
            await within(nc.connect(**kw, error_cb=on_error, allow_reconnect=True), 3 * cfg.connect_timeout_s + 1)
            nc.options["max_reconnect_attempts"] = -1  # once connected, reconnect forever: roles degrade, not die
            made.append(nc)
            return nc
        except Exception as exc:  # nats-py raises NoServersError, OSError, TimeoutError...
            if attempt == cfg.connect_retries:
                raise BrokerUnavailable("nats", cfg.url, f"{type(exc).__name__}: {exc}") from exc
            log.warning("nats %s unreachable (attempt %d/%d): %s", cfg.url, attempt, cfg.connect_retries, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
    raise AssertionError("unreachable")


async def publish_msg(nc: NATS, subject: str, msg: Any) -> None:
    """Publish a schema message with the current trace context in its headers."""
    await nc.publish(subject, codec.encode(msg), headers=nats_headers())


async def request_msg(nc: NATS, subject: str, msg: Any, *, timeout: float, expect: type | None = None) -> Any:
    try:
        reply = await nc.request(subject, codec.encode(msg), timeout=timeout, headers=nats_headers())
    except nats.errors.TimeoutError as exc:
        raise TimeoutExpired(f"request on {subject} timed out after {timeout} s") from exc
    return codec.decode(reply.data, expect=expect)


def decode_msg(msg: Msg, expect: type | None = None) -> Any:
    """Decode a NATS message's payload (raises ``CodecError`` for bad input)."""
    return codec.decode(msg.data, expect=expect)


def msg_context(msg: Msg) -> Any:
    return context_from_nats(msg.headers)


class PolicyStore:
    """The latest PolicyVersion in a JetStream KV bucket, with compare-and-set publication and a watch."""

    def __init__(self, nc: NATS, names: Names, *, history: int = 16, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.names = names
        self.history = history
        self.timeout_s = timeout_s
        self._kv: Any = None

    async def start(self) -> None:
        """Open the bucket, creating it if needed. Idempotent."""
        if self._kv is not None:
            return
        js = self.nc.jetstream(timeout=self.timeout_s)
        stream = f"KV_{self.names.policy_bucket}"  # a user that may not open it: PermissionDenied at once
        api = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", "$JS.API.INFO"]
        try:
            self._kv = await refusals.guarded(self.nc, api, js.key_value(self.names.policy_bucket))
        except BucketNotFoundError:
            self._kv = await refusals.guarded(self.nc, api, js.create_key_value(
                KeyValueConfig(bucket=self.names.policy_bucket, history=self.history)
            ))

    @property
    def kv(self) -> Any:
        if self._kv is None:
            raise RuntimeError("PolicyStore.start() was not called")
        return self._kv

    async def latest(self) -> tuple[PolicyVersion | None, int]:
        """The latest version and its bucket revision (``(None, 0)`` before the first publication). A value that
        does not decode raises its ``CodecError`` (``latest_good`` reads past it)."""
        try:
            entry = await self.kv.get(self.names.LATEST_KEY)
        except KeyNotFoundError:
            return None, 0
        if entry.value is None:
            return None, entry.revision or 0
        return codec.decode(entry.value, expect=PolicyVersion), entry.revision

    async def latest_good(self, on_bad: OnBadMessage | None = None) -> tuple[PolicyVersion | None, int]:
        """The newest *decodable* version in the key's history and the key's current revision: what a reader
        acts on when somebody wrote garbage over ``latest``. The bad value (the newest, if it is bad) is handed to
        ``on_bad(source, value, error)`` first."""
        try:
            entry = await self.kv.get(self.names.LATEST_KEY)
        except KeyNotFoundError:
            return None, 0
        revision = entry.revision or 0
        try:
            return (codec.decode(entry.value, expect=PolicyVersion) if entry.value else None), revision
        except CodecError as exc:
            log.error("policy store: undecodable latest at revision %s: %s", revision, exc)
            if on_bad is not None:
                await on_bad(self.latest_source, bytes(entry.value), exc)
        try:
            history = await self.kv.history(self.names.LATEST_KEY)
        except Exception:  # noqa: BLE001 - no history to read past it: the reader starts with nothing
            return None, revision
        for old in reversed(history):
            if old.value is None or old.revision == revision:
                continue
            try:
                return codec.decode(old.value, expect=PolicyVersion), revision
            except CodecError:
                continue
        return None, revision

    async def publish(self, pv: PolicyVersion, *, expected_revision: int) -> int:
        """Write ``pv`` if the bucket is still at ``expected_revision``; announce it; return the new revision.

        The current trace context is stored in ``pv.trace_context`` (unless set), so a generator's swap to this
        version can link its span to the trainer's publication even when it learns of it from the KV watch."""
        if not pv.trace_context:
            pv.trace_context = nats_headers()
        data = codec.encode(pv)
        try:
            if expected_revision == 0:
                rev = await self._write(self.names.LATEST_KEY, self.kv.create(self.names.LATEST_KEY, data))
            else:
                rev = await self._write(self.names.LATEST_KEY,
                                        self.kv.update(self.names.LATEST_KEY, data, last=expected_revision))
        except KeyWrongLastSequenceError as exc:
            raise StaleWriter(self.names.LATEST_KEY, expected_revision) from exc
        await publish_msg(self.nc, self.names.policy_subject, pv)
        return rev

    async def entry(self, key: str) -> tuple[bytes | None, int]:
        """A key's raw value and revision (``(None, 0)`` when it does not exist, ``(None, rev)`` when deleted)."""
        try:
            e = await self.kv.get(key)
        except KeyNotFoundError:
            return None, 0
        return (bytes(e.value) if e.value is not None else None), e.revision or 0

    async def put(self, key: str, value: bytes) -> int:
        """Write an auxiliary key of the bucket (e.g. fencing records)."""
        return await self._write(key, self.kv.put(key, value))

    async def _write(self, key: str, write: Awaitable[int]) -> int:
        """``write`` (a KV write of ``key``); ``PermissionDenied`` at once if this user may not write it."""
        return await refusals.guarded(self.nc, [f"$KV.{self.names.policy_bucket}.{key}"], write)

    async def get(self, key: str) -> bytes | None:
        try:
            return (await self.kv.get(key)).value
        except KeyNotFoundError:
            return None

    def source(self, key: str) -> str:
        """How a value of ``key`` is named as a dead letter's ``source``: ``kv:<bucket>/<key>``."""
        return f"kv:{self.names.policy_bucket}/{key}"

    @property
    def latest_source(self) -> str:
        """How a value of the latest-version key is named as a dead letter's ``source``."""
        return self.source(self.names.LATEST_KEY)

    async def progress(self) -> TrainerProgress | None:
        """The trainer's latest progress, or None (none written yet, or a value that does not decode)."""
        data = await self.get(self.names.PROGRESS_KEY)
        if data is None:
            return None
        try:
            return codec.decode(data, expect=TrainerProgress)
        except CodecError as exc:
            log.warning("policy store: undecodable progress: %s", exc)
            return None

    async def put_progress(self, progress: TrainerProgress) -> int:
        """Write the trainer's progress (plain put: only the trainer writes it, and the newest wins)."""
        return await self._write(self.names.PROGRESS_KEY, self.kv.put(self.names.PROGRESS_KEY, codec.encode(progress)))

    async def watch(self, on_bad: OnBadMessage | None = None) -> AsyncIterator[PolicyVersion]:
        """Yield the current version (if any), then every newer one as it is written. Runs until cancelled.

        A value that fails to decode is logged and skipped (it cannot be acted on); ``on_bad(source, value, error)``
        (e.g. a role's dead-letter writer) is awaited for it first, with ``latest_source`` as the source.
        """
        async for pv in self._watch(self.names.LATEST_KEY, PolicyVersion, on_bad):
            yield pv

    async def watch_progress(self, on_bad: OnBadMessage | None = None) -> AsyncIterator[TrainerProgress]:
        """``watch`` for the trainer's progress key."""
        async for p in self._watch(self.names.PROGRESS_KEY, TrainerProgress, on_bad):
            yield p

    async def _watch(self, key: str, schema: type, on_bad: OnBadMessage | None) -> AsyncIterator[Any]:
        watcher = await self.kv.watch(key)
        try:
            async for entry in watcher:
                if entry is None or entry.value is None or entry.operation is not None:
                    continue  # the "initial values done" marker, or a delete/purge
                try:
                    value = codec.decode(entry.value, expect=schema)
                except CodecError as exc:
                    log.error("policy store: undecodable %s at revision %s: %s", key, entry.revision, exc)
                    if on_bad is not None:
                        await on_bad(self.source(key), bytes(entry.value), exc)
                    continue
                yield value
        finally:
            with contextlib.suppress(Exception):  # the connection may be closed already
                await watcher.stop()
