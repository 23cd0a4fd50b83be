"""Security options against real servers: NATS token, user/password and TLS (certificates made here).

Kafka TLS cannot be exercised against the embedded broker (``tansu 0.6.0``, build ``v0.6.0-510f3e2``; source lines
of tansu-io/tansu at that commit); the pins below show it on the binary:

* ``--cert`` with ``--key`` exits 2: "the argument '--cert <CERT>' cannot be used with '--key <KEY>'". Both flags
  are in one clap group, ``#[arg(group = "tls", long)]`` (``tansu-cli/src/cli/broker.rs:98,102``), and a group
  takes one member; yet a server config is built only when both are given (``broker.rs:265-267``).
* ``--cert`` alone or ``--key`` alone starts the broker, serving plain Kafka: a PLAINTEXT client works, and a TLS
  client's handshake hangs until the client's own timeout (Tansu reads the ClientHello as the size of a Kafka
  frame and waits for the rest; when the client gives up it logs ``err=Custom { kind: UnexpectedEof, error:
  "early eof" }``). Even with a server config the broker never uses it: ``let _acceptor = ...`` is built and
  dropped (``tansu-broker/src/broker.rs:285``), every connection is served as plain TCP.
* The listener URL's scheme is ignored: only its host and port are bound (``TcpListener::bind``, ``broker.rs:219``),
  so ``tls://``, ``ssl://`` or ``https://`` listeners serve plain Kafka too.

Kafka SASL on Tansu is in ``tests/integration/test_kafka_sasl.py`` (it cannot log in either). The Kafka SASL/TLS
options are unit-tested in ``tests/unit/test_client_security.py`` and exercised against real clusters through
``deploy/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from streamforge.brokers import free_port, nats_server_binary, tansu_binary
from topics.config import KafkaConfig, NatsConfig
from topics.errors import BrokerUnavailable
from topics.kafka import Producer
from topics.nats import connect

sys.path.insert(0, str(Path(__file__).parent))
from certs import make_certs

pytestmark = pytest.mark.timeout(90)


async def wait_for_port(port: int, *, tries: int, delay_s: float) -> None:
    """Until something accepts a TCP connection on 127.0.0.1:``port`` (at most ``tries`` attempts)."""
    for _ in range(tries):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(delay_s)


@contextlib.asynccontextmanager
async def nats_server(tmp_path: Path, *args: str, scheme: str = "nats", ready_url: str | None = None):
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
                             str(tmp_path / f"js{port}"), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        await wait_for_port(port, tries=100, delay_s=0.05)  # readiness by protocol needs the credentials under test
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


@contextlib.asynccontextmanager
async def tansu_with(*args: str, scheme: str = "tcp"):
    """A memory-store Tansu with extra ``args`` on a free port under a ``scheme://`` listener; yields the address."""
    port = free_port()
    url = f"{scheme}://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url, *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await wait_for_port(port, tries=200, delay_s=0.02)
        yield f"127.0.0.1:{port}"
    finally:  # not proc.wait() in a blocking call: a client socket still open at SIGTERM holds Tansu for 5 s
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def test_tansu_refuses_cert_together_with_key(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    proc = await asyncio.create_subprocess_exec(tansu_binary(), "broker", "--cert", str(certs["cert"]), "--key",
                                                str(certs["key"]), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
    assert proc.returncode == 2 and "'--cert <CERT>' cannot be used with '--key <KEY>'" in out, out


@pytest.mark.parametrize(("flag", "scheme"), [("cert", "tcp"), ("key", "tcp"), (None, "tls"), (None, "ssl")])
async def test_tansu_serves_plain_kafka_whatever_its_tls_options(tmp_path: Path, flag: str | None,
                                                                 scheme: str) -> None:
    certs = make_certs(tmp_path / "certs")
    args = (f"--{flag}", str(certs[flag])) if flag else ()
    async with tansu_with(*args, scheme=scheme) as bootstrap:
        async with Producer(KafkaConfig(bootstrap=bootstrap, connect_retries=1)) as producer:
            await producer.send_raw("tls-pin", b"in the clear")
        tls = KafkaConfig(bootstrap=bootstrap, security_protocol="SSL", ssl_cafile=str(certs["ca"]),
                          request_timeout_ms=1000, connect_retries=1)
        with pytest.raises(BrokerUnavailable):  # the TLS handshake gets no answer
            await Producer(tls).start()
