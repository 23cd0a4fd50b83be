"""The embedded brokers start without an error in the log: a client waits for a broker's port before it connects
(aiokafka logs each refused connection at ERROR), and says once at INFO that it is waiting."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from streamforge.brokers import EmbeddedBrokers, _host_ports, wait_listening


def test_bootstrap_lists_parse_into_host_port_pairs() -> None:
    assert _host_ports("127.0.0.1:9093,kafka-1:9094", 9092) == [("127.0.0.1", 9093), ("kafka-1", 9094)]
    assert _host_ports("kafka", 9092) == [("kafka", 9092)]
    assert _host_ports("[::1]:9092", 1) == [("::1", 9092)]


async def test_a_port_that_opens_late_is_waited_for_with_one_info_line(caplog) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]  # bound, not listening yet: connections are refused
    caplog.set_level(logging.DEBUG)
    loop = asyncio.get_running_loop()
    loop.call_later(0.4, sock.listen)
    t0 = loop.time()
    await wait_listening([("127.0.0.1", port)], deadline=time.monotonic() + 10, what="Kafka")
    waited = loop.time() - t0
    sock.close()
    assert waited >= 0.35
    waiting = [r for r in caplog.records if "waiting for the Kafka broker" in r.getMessage()]
    assert len(waiting) == 1 and waiting[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_embedded_brokers_start_with_no_error_logged(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    brokers = EmbeddedBrokers(tmp_path / "brokers")
    await brokers.start()
    try:
        errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
    finally:
        brokers.stop()
