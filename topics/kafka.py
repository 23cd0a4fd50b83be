"""Kafka clients with streamforge's lifecycle: ``Producer``, ``Consumer``, ``DeadLetters``.

* Same lifecycle everywhere: ``start()``/``stop()`` idempotent, ``async with``; ``stop()`` drains (a producer
  flushes what it has accepted before closing).
* Values are schema messages encoded by ``topics.codec``; the W3C trace context of the sending span travels in
  the record headers and comes back as ``Received.context``.
* Delivery is at-least-once: ``send`` returns only after the broker acknowledged the record; consumers never
  auto-commit: callers commit explicitly the offsets they finished (``commit({tp: next_offset})``).
* Works on Tansu (the embedded broker) and on Apache Kafka: no idempotent producer, no transactions, and
  ``highwater()`` rather than ``end_offsets()`` (Tansu gets the latter wrong).
* A broker that comes up late is retried with exponential backoff (``kafka.connect_retries``); then
  ``BrokerUnavailable`` (retriable) names the address. A broker that refuses the SASL login (wrong password, unknown
  user, mechanism not enabled) raises ``AuthenticationFailed`` (not retriable) at the first attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.conn import create_conn
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context
from opentelemetry import context as otel_context

from topics import codec
from topics.config import KafkaConfig
from topics.errors import AuthenticationFailed, BrokerError, BrokerUnavailable, CodecError, ConfigError
from topics.names import Names
from topics.schemas import DeadLetter
from topics.tracing import context_from_kafka, kafka_headers

log = logging.getLogger("streamforge.kafka")

__all__ = ["Consumer", "DeadLetters", "Producer", "Received", "TopicPartition", "check_login", "client_kwargs",
           "start_with_retries"]


def client_kwargs(cfg: KafkaConfig, *, client_id: str = "") -> dict[str, Any]:
    """aiokafka keyword arguments shared by producers, consumers and admin clients (security included)."""
    if not cfg.bootstrap:
        raise BrokerUnavailable("kafka", "<unset>", "kafka.bootstrap is empty (set STREAMFORGE_KAFKA_BOOTSTRAP)")
    kw: dict[str, Any] = {
        "bootstrap_servers": cfg.bootstrap,
        "client_id": client_id or cfg.client_id,
        "request_timeout_ms": cfg.request_timeout_ms,
        "security_protocol": cfg.security_protocol,
    }
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        kw["ssl_context"] = create_ssl_context(
            cafile=cfg.ssl_cafile or None, certfile=cfg.ssl_certfile or None, keyfile=cfg.ssl_keyfile or None
        )
    if cfg.security_protocol.startswith("SASL"):
        kw["sasl_mechanism"] = cfg.sasl_mechanism or "PLAIN"
        kw["sasl_plain_username"] = cfg.sasl_username
        kw["sasl_plain_password"] = os.environ.get(cfg.sasl_password_env, "")
    return kw


_SASL_REFUSALS = (SaslAuthenticationFailed, UnsupportedSaslMechanismError, IllegalSaslStateError)


def sasl_refusal(exc: BaseException, mechanism: str) -> str | None:
    """Why the broker refused a SASL login, read from what one connection attempt raised; None if ``exc`` says
    nothing about the login (the broker is down, slow, or dropped the connection).

    The broker says so with an error code (SaslAuthenticationFailed, UnsupportedSaslMechanism, IllegalSaslState);
    aiokafka's own SCRAM and PLAIN clients fail with KeyError, ValueError or AssertionError on a reply they do not
    expect, such as a SCRAM server-final message that carries ``e=<error>`` where they read ``v=<signature>``."""
    if isinstance(exc, _SASL_REFUSALS):
        return str(exc)
    if isinstance(exc, KeyError) and mechanism.startswith("SCRAM-") and exc.args == ("v",):
        return "the broker's final SCRAM message carried an error (e=...) instead of its signature (v=...)"
    if isinstance(exc, (KeyError, ValueError, AssertionError)):
        return f"unexpected reply to the SASL exchange ({type(exc).__name__}: {exc})"
    return None


async def check_login(cfg: KafkaConfig) -> str:
    """Log in once to a bootstrap broker with ``cfg``'s security settings; raise ``AuthenticationFailed`` if it
    refuses the login. Returns a note on any other failure (for an unreachable-broker message), else "".

    The bootstrap brokers are tried in order until one answers: the first that completes or refuses the login
    decides; one that cannot be reached is skipped (as aiokafka's bootstrap skips it).

    Needed because aiokafka's bootstrap logs a refused SASL login and raises a bare "Unable to bootstrap", which
    reads like a broker that is not up yet and would be retried for a minute; one bare connection tells them apart."""
    kw = client_kwargs(cfg)
    mechanism = kw.get("sasl_mechanism", "")
    note = ""
    for address in (a.strip() for a in cfg.bootstrap.split(",") if a.strip()):
        host, _, port = address.rpartition(":")
        try:
            conn = await create_conn(
                host, int(port), client_id=kw["client_id"], request_timeout_ms=cfg.request_timeout_ms,
                ssl_context=kw.get("ssl_context"), security_protocol=cfg.security_protocol, sasl_mechanism=mechanism,
                sasl_plain_username=kw.get("sasl_plain_username"), sasl_plain_password=kw.get("sasl_plain_password"),
            )
        except Exception as exc:
            refusal = sasl_refusal(exc, mechanism)
            if refusal is not None:
                raise AuthenticationFailed("kafka", address, mechanism=mechanism, user=cfg.sasl_username,
                                           detail=refusal) from exc
            if isinstance(exc, KafkaConnectionError):  # raised only once connected: the broker hung up on us
                note = (f"{address} accepted the connection and closed it during the "
                        f"{mechanism or 'protocol'} handshake")
            continue
        conn.close()
        return ""
    return note


async def start_with_retries(client: Any, cfg: KafkaConfig, what: str,
                             stop: Callable[[], Awaitable[Any]] | None = None) -> None:
    """``client.start()``, retried with exponential backoff while the broker is unreachable; ``stop`` (default
    ``client.stop``) releases the client when giving up. With SASL, each failure is checked with ``check_login``,
    so a refused login raises ``AuthenticationFailed`` at once instead of being retried as an unreachable broker."""
    stop = stop or client.stop
    sasl = cfg.security_protocol.startswith("SASL")
    delay = cfg.retry_backoff_s
    for attempt in range(1, cfg.connect_retries + 1):
        try:
            await client.start()
            return
        except Exception as exc:
            if not sasl and not isinstance(exc, KafkaConnectionError):
                raise
            try:
                note = await check_login(cfg) if sasl else ""
            except AuthenticationFailed:
                with contextlib.suppress(Exception):
                    await stop()
                raise
            if not isinstance(exc, KafkaConnectionError):
                raise
            if attempt == cfg.connect_retries:
                with contextlib.suppress(Exception):
                    await stop()
                raise BrokerUnavailable("kafka", cfg.bootstrap, f"{what}: {exc}" + (f" ({note})" if note else "")
                                        ) from exc
            log.warning("kafka %s: %s unreachable (attempt %d/%d), retrying in %.1f s",
                        what, cfg.bootstrap, attempt, cfg.connect_retries, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)


class Producer:
    """Encodes schema messages, adds trace headers, and awaits the broker's acknowledgement of each send."""

    def __init__(self, cfg: KafkaConfig, *, client_id: str = "", max_batch_bytes: int = 0) -> None:
        """``max_batch_bytes`` (> 0) sizes the producer's per-partition record batch (aiokafka's 16 KiB by
        default): the producer has one request in flight per broker carrying one record batch per partition, so a
        writer of large records to few partitions (the buffer's Batches) needs room for several per batch."""
        self.cfg = cfg
        self._producer = AIOKafkaProducer(
            **client_kwargs(cfg, client_id=client_id),
            acks="all" if cfg.acks == "all" else int(cfg.acks),
            compression_type=None if cfg.compression == "none" else cfg.compression,
            linger_ms=cfg.linger_ms,
            enable_idempotence=cfg.idempotent,
            max_request_size=cfg.max_message_bytes + 64 * 1024,
            **({"max_batch_size": max_batch_bytes} if max_batch_bytes > 0 else {}),
        )
        self._started = False
        self._stopped = False

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        try:
            await start_with_retries(self._producer, self.cfg, "producer")
        except KafkaError as exc:
            if not self.cfg.idempotent:
                raise
            with contextlib.suppress(Exception):
                await self._producer.stop()
            raise ConfigError("kafka.idempotent", f"the broker refused an idempotent producer ({exc!r}); "
                                                  "Tansu, the embedded broker, has no idempotence") from exc

    async def stop(self) -> None:
        """Flush every accepted record, then close. Idempotent."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        await self._producer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def send(self, topic: str, msg: Any, *, key: str | None = None,
                   headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
                   ctx: otel_context.Context | None = None) -> Any:
        """Encode ``msg``, send it, and return the broker's RecordMetadata once acknowledged."""
        value = codec.encode(msg, max_bytes=self.cfg.max_message_bytes)
        return await self.send_raw(topic, value, key=key, headers=headers, partition=partition, ctx=ctx)

    async def send_raw(self, topic: str, value: bytes, *, key: str | bytes | None = None,
                       headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
                       ctx: otel_context.Context | None = None) -> Any:
        fut = await self.enqueue_raw(topic, value, key=key, headers=headers, partition=partition, ctx=ctx)
        return await fut

    async def enqueue(self, topic: str, msg: Any, *, key: str | None = None,
                      headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
                      ctx: otel_context.Context | None = None) -> asyncio.Future:
        """Hand ``msg`` to the producer's batcher and return a future of its acknowledgement (for pipelining)."""
        value = codec.encode(msg, max_bytes=self.cfg.max_message_bytes)
        return await self.enqueue_raw(topic, value, key=key, headers=headers, partition=partition, ctx=ctx)

    async def enqueue_raw(self, topic: str, value: bytes, *, key: str | bytes | None = None,
                          headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
                          ctx: otel_context.Context | None = None) -> asyncio.Future:
        if not self._started or self._stopped:
            raise BrokerError("producer is not running (call start() first)")
        kbytes = key.encode() if isinstance(key, str) else key
        try:
            return await self._producer.send(
                topic, value, key=kbytes, partition=partition, headers=kafka_headers(headers or (), ctx)
            )
        except KafkaError as exc:
            raise BrokerError(f"send to {topic} failed: {exc}", retriable=exc.retriable) from exc

    async def flush(self) -> None:
        await self._producer.flush()

    async def partitions_for(self, topic: str) -> set[int]:
        return await self._producer.partitions_for(topic)


@dataclass(slots=True)
class Received:
    """One consumed record: the decoded message, or the error that made it undecodable."""

    topic: str
    partition: int
    offset: int
    key: str | None
    raw: bytes
    value: Any = None
    error: CodecError | None = None
    headers: dict[str, bytes] = field(default_factory=dict)
    timestamp_ms: int = 0

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    @property
    def context(self) -> otel_context.Context:
        return context_from_kafka(self.headers)


def _decode_key(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return key.hex()


class Consumer:
    """A consumer-group member (``group_id``) or a manual reader (``partitions``); never auto-commits.

    ``getmany`` decodes every record; a record that fails to decode comes back with ``error`` set (and
    ``value=None``) so the caller can dead-letter it and move on: hostile input never crashes the reader.
    """

    def __init__(self, cfg: KafkaConfig, topics: Iterable[str], *, group_id: str | None,
                 expect: type | None = None, client_id: str = "",
                 partitions: list[TopicPartition] | None = None,
                 listener: ConsumerRebalanceListener | None = None,
                 auto_offset_reset: str = "earliest", fetch_min_bytes: int = 1) -> None:
        """``fetch_min_bytes``: the broker holds a fetch until that much is there (or ``kafka.fetch_max_wait_ms``
        runs out): fewer, larger fetches for a consumer that reads a stream in bulk."""
        self.cfg = cfg
        self.topics = list(topics)
        self.group_id = group_id
        self.expect = expect
        self._partitions = partitions
        self._listener = listener
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(cfg, client_id=client_id),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            max_partition_fetch_bytes=cfg.max_message_bytes + 64 * 1024,
            fetch_max_bytes=max(cfg.max_message_bytes + 64 * 1024, 52428800),
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_interval_ms=cfg.max_poll_interval_ms,
            fetch_max_wait_ms=cfg.fetch_max_wait_ms,
            fetch_min_bytes=fetch_min_bytes,
        )
        self._started = False
        self._stopped = False

    @property
    def raw(self) -> AIOKafkaConsumer:
        """The underlying aiokafka consumer (seek, position, committed)."""
        return self._consumer

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await start_with_retries(self._consumer, self.cfg, "consumer")
        if self._partitions is not None:
            self._consumer.assign(self._partitions)
        elif self.topics:
            self._consumer.subscribe(self.topics, listener=self._listener)

    async def stop(self) -> None:
        if not self._started or self._stopped:
            return
        self._stopped = True
        await self._consumer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _decode(self, rec: Any) -> Received:
        out = Received(
            topic=rec.topic, partition=rec.partition, offset=rec.offset, key=_decode_key(rec.key),
            raw=rec.value if rec.value is not None else b"", headers={k: v for k, v in (rec.headers or ())},
            timestamp_ms=rec.timestamp or 0,
        )
        try:
            out.value = codec.decode(out.raw, max_bytes=self.cfg.max_message_bytes, expect=self.expect)
        except CodecError as exc:
            out.error = exc
        return out

    async def getmany(self, timeout_ms: int = 1000, max_records: int | None = None) -> list[Received]:
        """Fetch what is available (waiting up to ``timeout_ms``), decoded, in offset order per partition."""
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        return [self._decode(rec) for records in batches.values() for rec in records]

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit ``{tp: next offset to read}``. Raises ``BrokerError`` (retriable after a rebalance)."""
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except KafkaError as exc:
            raise BrokerError(f"commit failed: {exc}", retriable=True) from exc

    async def committed(self, tp: TopicPartition, *, attempts: int = 5) -> int | None:
        """The group's committed offset of ``tp`` (None if none). Retried: Tansu sometimes answers an
        OffsetFetch with a frame aiokafka cannot parse, which drops the connection (a new one then works)."""
        delay = 0.1
        for attempt in range(1, attempts + 1):
            try:
                return await self._consumer.committed(tp)
            except KafkaError as exc:
                if attempt == attempts:
                    raise BrokerError(f"offset fetch for {tp} failed: {exc}", retriable=True) from exc
                log.warning("offset fetch for %s failed (%s); retrying", tp, exc)
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The first offset still in the log of each of ``tps`` (where ``auto_offset_reset="earliest"`` starts).
        Raises ``BrokerError`` (retriable)."""
        try:
            return dict(await self._consumer.beginning_offsets(tps))
        except KafkaError as exc:
            raise BrokerError(f"log start of {sorted(map(str, tps))} failed: {exc}", retriable=True) from exc

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    def pause(self, *tps: TopicPartition) -> None:
        self._consumer.pause(*(tps or self._consumer.assignment()))

    def resume(self, *tps: TopicPartition) -> None:
        self._consumer.resume(*(tps or self._consumer.assignment()))

    def highwater(self, tp: TopicPartition) -> int | None:
        return self._consumer.highwater(tp)

    async def position(self, tp: TopicPartition) -> int:
        return await self._consumer.position(tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._consumer.seek(tp, offset)

    async def lag(self) -> dict[TopicPartition, int]:
        """Records behind the high-water mark per assigned partition (known after the first fetch)."""
        out = {}
        for tp in self._consumer.assignment():
            hw = self._consumer.highwater(tp)
            if hw is not None:
                out[tp] = max(0, hw - await self._consumer.position(tp))
        return out


class DeadLetters:
    """Publishes whatever could not be handled to the run's dead-letter topic, with its reason."""

    def __init__(self, producer: Producer, names: Names, role: str) -> None:
        self.producer = producer
        self.topic = names.dead_letter
        self.role = role
        self.count = 0

    async def send(self, received: Received, *, reason: str = "", detail: str = "",
                   wait: bool = True) -> asyncio.Future | None:
        """Dead-letter a consumed record. ``wait=False`` returns the acknowledgement's future instead of awaiting
        it (pipelining a flood of bad records); the caller must await it before committing the record's offset."""
        err = received.error
        return await self._publish(DeadLetter(
            source=received.topic, reason=reason or (err.reason if err else "unhandled"),
            detail=detail or (str(err) if err else ""), partition=received.partition, offset=received.offset,
            key=(received.key or "").encode(), value=received.raw, role=self.role,
        ), key=received.topic, wait=wait)

    async def send_bytes(self, source: str, value: bytes, *, reason: str, detail: str = "",
                         key: bytes = b"", wait: bool = True) -> asyncio.Future | None:
        """Dead-letter raw bytes from anywhere (a NATS subject, a KV key); ``wait`` as in ``send``."""
        return await self._publish(DeadLetter(source=source, reason=reason, detail=detail, value=value, key=key,
                                              role=self.role), key=source, wait=wait)

    async def send_message(self, source: str, msg: Any, *, reason: str, detail: str = "") -> None:
        """Dead-letter a decoded message (e.g. an Episode whose reward failed), re-encoded as it was."""
        try:
            value = codec.encode(msg, max_bytes=self.producer.cfg.max_message_bytes)
        except CodecError as exc:
            value, detail = b"", f"{detail} (could not re-encode: {exc})"
        await self.send_bytes(source, value, reason=reason, detail=detail)

    async def send_undecodable(self, source: str, value: bytes, exc: CodecError) -> None:
        """Dead-letter a NATS message or KV value that did not decode, with the error's reason: an
        ``OnBadMessage`` (topics.nats). Does not wait for the acknowledgement: NATS is at-most-once anyway, and a
        flood of bad values must not stall the subscription's callback."""
        await self.send_bytes(source, value, reason=exc.reason, detail=str(exc), wait=False)

    async def _publish(self, letter: DeadLetter, *, key: str, wait: bool = True) -> asyncio.Future | None:
        limit = self.producer.cfg.max_message_bytes - 4096
        if len(letter.value) > limit:  # keep the head of an oversized payload; say so
            letter.detail = f"{letter.detail} [value truncated from {len(letter.value)} bytes]"
            letter.value = letter.value[:limit]
        log.warning("dead-letter from %s: %s %s", letter.source, letter.reason, letter.detail[:200])
        self.count += 1
        if not wait:
            fut = await self.producer.enqueue(self.topic, letter, key=key)
            fut.add_done_callback(_log_failed_letter)
            return fut
        await self.producer.send(self.topic, letter, key=key)
        return None


def _log_failed_letter(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:  # also marks the exception as retrieved
        log.error("a dead letter was not delivered: %s", fut.exception())


def now_ms() -> int:
    return int(time.time() * 1000)
