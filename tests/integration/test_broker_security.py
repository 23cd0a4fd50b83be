"""Security options against real servers: NATS token, user/password and TLS (certificates made here).

Kafka TLS could not be exercised against the embedded broker: Tansu 0.6's CLI refuses ``--cert`` together with
``--key`` ("the argument '--cert <CERT>' cannot be used with '--key <KEY>'"), and with ``--cert`` alone a TLS
client gets "early eof". The Kafka SASL/TLS options are unit-tested in ``tests/unit/test_client_security.py`` and
exercised against real clusters through ``deploy/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from streamforge.brokers import free_port, nats_server_binary
from topics.config import NatsConfig
from topics.errors import BrokerUnavailable
from topics.nats import connect

sys.path.insert(0, str(Path(__file__).parent))
from certs import make_certs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@contextlib.asynccontextmanager
async def nats_server(tmp_path: Path, *args: str, scheme: str = "nats", ready_url: str | None = None):
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                             str(tmp_path / f"js{port}"), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # wait for the port (readiness by protocol needs the credentials under test)
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_nats_token_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-token-value"
    async with nats_server(tmp_path, "--auth", secret) as url:
        cfg = NatsConfig(url=url, connect_retries=1, connect_timeout_s=1)
        monkeypatch.delenv("STREAMFORGE_NATS_TOKEN", raising=False)
        with pytest.raises(BrokerUnavailable) as err:
            await connect(cfg, name="no-token")
        assert secret not in str(err.value)
        monkeypatch.setenv("STREAMFORGE_NATS_TOKEN", secret)
        nc = await connect(cfg, name="with-token")
        await nc.jetstream().account_info()
        await nc.close()


async def test_nats_user_and_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with nats_server(tmp_path, "--user", "trainer", "--pass", "pw-123") as url:
        cfg = NatsConfig(url=url, user="trainer", connect_retries=1, connect_timeout_s=1)
        monkeypatch.setenv("STREAMFORGE_NATS_PASSWORD", "wrong")
        with pytest.raises(BrokerUnavailable) as err:
            await connect(cfg, name="bad-password")
        assert "wrong" not in str(err.value)
        monkeypatch.setenv("STREAMFORGE_NATS_PASSWORD", "pw-123")
        nc = await connect(cfg, name="good-password")
        await nc.flush()
        await nc.close()


async def test_nats_tls_with_a_private_ca(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    async with nats_server(tmp_path, "--tls", "--tlscert", str(certs["cert"]), "--tlskey", str(certs["key"]),
                           scheme="tls") as url:
        nc = await connect(NatsConfig(url=url, tls_ca=str(certs["ca"]), connect_retries=1), name="tls")
        await nc.jetstream().account_info()
        await nc.close()
        with pytest.raises(BrokerUnavailable):  # the system trust store does not know our CA
            await connect(NatsConfig(url=url, connect_retries=1, connect_timeout_s=1), name="untrusted")


async def test_unreachable_kafka_names_the_address_after_retries() -> None:
    from topics.config import KafkaConfig
    from topics.kafka import Producer

    address = f"127.0.0.1:{free_port()}"
    producer = Producer(KafkaConfig(bootstrap=address, connect_retries=2, retry_backoff_s=0.05))
    with pytest.raises(BrokerUnavailable) as err:
        await producer.start()
    assert address in str(err.value) and err.value.retriable


async def test_brokers_that_come_up_late_are_waited_for(tmp_path: Path) -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"

    async def start_late() -> subprocess.Popen:
        await asyncio.sleep(1.0)
        return subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    starter = asyncio.create_task(start_late())
    nc = await connect(NatsConfig(url=url, connect_retries=8, connect_timeout_s=0.5), name="late")
    proc = await starter
    try:
        await nc.flush(timeout=5)
        assert nc.is_connected
        await nc.close()
    finally:
        proc.terminate()
        proc.wait(10)
