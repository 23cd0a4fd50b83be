"""Kafka SASL against the embedded broker: Tansu's ``--authentication`` cannot authenticate aiokafka 0.14.

Measured on the bundled binary (``tansu 0.6.0``, build ``v0.6.0-510f3e2``); source lines are of tansu-io/tansu at
that commit. No user can log in, whatever the mechanism, so there is no produce/consume test under SASL here:

* PLAIN is not compiled in. rsasl is built with ``features = ["config_builder", "provider", "oauthbearer",
  "scram-sha-2"]`` (``Cargo.toml:141``), so the SaslHandshake for PLAIN fails in ``start_suggested``
  (``tansu-auth/src/handshake.rs:63-65``); Tansu logs ``error=Auth(Sasl(NoSharedMechanism))`` and drops the
  connection without an answer, and aiokafka reports ``Connection at 127.0.0.1:PORT closed``. (Even compiled, the
  PLAIN branch of ``Callback::check``, ``tansu-auth/src/lib.rs:182``, never compares the password.)
* SCRAM-SHA-256/512 handshakes succeed, but no credential is ever found: ``memory://`` and ``s3://``, the only
  storage engines in this build, are both DynoStore, whose ``upsert_user_scram_credential`` returns ``Ok(())``
  without storing anything and whose ``user_scram_credential`` always returns ``Ok(None)``
  (``tansu-storage/src/dynostore.rs:2703-2718``); only the SQL engines, not compiled in, keep them. The server
  answers the client's final message with ``e=unknown-user``, which aiokafka's SCRAM client cannot parse
  (``aiokafka/conn.py:733`` reads ``params["v"]``): ``KeyError('v')``. streamforge turns that into
  ``AuthenticationFailed``.
* Users are provisioned with ``tansu user create --broker tcp://HOST:PORT [--mechanism scram256|scram512] NAME
  PASSWORD``, an AlterUserScramCredentials request from a client without SASL (``tansu-cli/src/cli/user.rs``).
  Against an ``--authentication`` broker it fails with ``Client(Io(Custom { kind: UnexpectedEof, error: "early
  eof" }))``: before a login only ApiVersions, SaslHandshake and SaslAuthenticate pass
  (``tansu-service/src/frame.rs:263-270,326``, ``NotAuthenticated``). Against an open broker it exits 0 and the
  credential is dropped (above), also over ``s3://`` across a restart with ``--authentication``.
* Not a security boundary either: ``Authentication::is_authenticated`` accepts any finished exchange, validated or
  not (``tansu-auth/src/lib.rs:106-109``), so a SCRAM client that ignores ``e=unknown-user`` is admitted. Seen
  here: aiokafka with its server-final check patched out produced a record as the unknown user ``nobody``. Fixed
  upstream after this build (tansu-io/tansu 0cc3ac9, "require a validated identity to treat SASL as
  authenticated").

These tests pin that behaviour (so a Tansu upgrade shows up here; then write the produce/consume test) and check
what streamforge does about it: a refused login raises ``AuthenticationFailed`` (typed, not retriable) at the first
attempt, where aiokafka alone raised ``KeyError`` or, for a broker that answers with an error code as Apache Kafka
does, "Unable to bootstrap", which streamforge used to retry for a minute as an unreachable broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from streamforge.brokers import EmbeddedBrokers, tansu_binary
from topics.admin import ensure_topics
from topics.config import KafkaConfig, TopicsConfig
from topics.errors import AuthenticationFailed, BrokerUnavailable
from topics.kafka import Consumer, Producer
from topics.names import Names

pytestmark = pytest.mark.timeout(90)

PASSWORD_ENV = "SF_TEST_KAFKA_SASL_PASSWORD"
SECRET = "pw-not-in-errors"


async def wait_port(port: int, timeout_s: float = 10.0) -> None:
    """Readiness by TCP only: an authenticating Tansu answers no metadata request before a login."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def tansu(brokers: EmbeddedBrokers, *extra: str):
    """Run ``brokers``' Tansu command (its port and store) with ``extra`` arguments; yield its bootstrap address.
    Stopped without blocking the loop: a client socket still open at SIGTERM holds Tansu's exit for 5 s."""
    argv, env = brokers.tansu_command(*extra)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL, env={**os.environ, **env})
    try:
        await wait_port(brokers.kafka_port)
        yield brokers.kafka_bootstrap
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


def sasl_config(bootstrap: str, mechanism: str, **kw: object) -> KafkaConfig:
    return KafkaConfig(bootstrap=bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
                       sasl_username="alice", sasl_password_env=PASSWORD_ENV, **kw)


async def user_create(bootstrap: str, mechanism: str) -> tuple[int, str]:
    """``tansu user create`` for alice; its exit status and stderr."""
    proc = await asyncio.create_subprocess_exec(
        tansu_binary(), "user", "create", "--broker", f"tcp://{bootstrap}", "--mechanism",
        mechanism.lower().replace("-sha-", ""), "alice", SECRET,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, err.decode()


@pytest.fixture
def password(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    return SECRET


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_scram_login_is_refused_at_once_with_a_typed_error(tmp_path: Path, password: str,
                                                                  mechanism: str) -> None:
    async with tansu(EmbeddedBrokers(tmp_path), "--authentication") as bootstrap:
        cfg = sasl_config(bootstrap, mechanism)  # kafka.connect_retries 10: a retried failure would take ~50 s
        clients = {
            "producer": lambda: Producer(cfg).start(),
            "consumer": lambda: Consumer(cfg, ["sf.prompts"], group_id="sf.sasl").start(),
            "admin": lambda: ensure_topics(cfg, Names("sasl"), TopicsConfig()),
        }
        for what, start in clients.items():
            t0 = time.monotonic()
            with pytest.raises(AuthenticationFailed) as err:
                await start()
            assert time.monotonic() - t0 < 5, f"{what}: the refused login was retried"
            assert not err.value.retriable and err.value.mechanism == mechanism and err.value.user == "alice"
            assert "e=" in str(err.value) and bootstrap in str(err.value)
            assert password not in str(err.value) and password not in repr(err.value.__cause__)


async def test_tansu_user_create_needs_an_open_broker(tmp_path: Path) -> None:
    async with tansu(EmbeddedBrokers(tmp_path), "--authentication") as bootstrap:
        rc, err = await user_create(bootstrap, "SCRAM-SHA-512")
    assert rc != 0 and "early eof" in err
    async with tansu(EmbeddedBrokers(tmp_path)) as bootstrap:
        rc, err = await user_create(bootstrap, "SCRAM-SHA-512")
    assert rc == 0, err


async def test_users_created_on_a_durable_broker_cannot_log_in_after_a_restart(tmp_path: Path,
                                                                              password: str) -> None:
    """The way Tansu provisions users: create them on an open broker over a durable store, restart it with
    ``--authentication``. Its DynoStore drops the credentials, so the login is refused as an unknown user."""
    brokers = EmbeddedBrokers(tmp_path / "brokers", durable=True)
    await brokers.start()
    try:
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            rc, err = await user_create(brokers.kafka_bootstrap, mechanism)
            assert rc == 0, err
        brokers.stop_one("tansu")
        async with tansu(brokers, "--authentication") as bootstrap:
            for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                with pytest.raises(AuthenticationFailed, match="e="):
                    await Producer(sasl_config(bootstrap, mechanism)).start()
    finally:
        brokers.stop()


async def test_plain_is_not_offered(tmp_path: Path, password: str) -> None:
    """Tansu drops the connection at the PLAIN handshake (NoSharedMechanism) without an error code, so it looks
    like a broker going away: retried, then ``BrokerUnavailable`` saying where the connection was closed."""
    async with tansu(EmbeddedBrokers(tmp_path), "--authentication") as bootstrap:
        with pytest.raises(BrokerUnavailable, match="closed it during the PLAIN handshake") as err:
            await Producer(sasl_config(bootstrap, "PLAIN", connect_retries=2, retry_backoff_s=0.05)).start()
    assert password not in str(err.value)


async def test_a_client_without_sasl_is_shut_out(tmp_path: Path) -> None:
    async with tansu(EmbeddedBrokers(tmp_path), "--authentication") as bootstrap:
        with pytest.raises(BrokerUnavailable):
            await Producer(KafkaConfig(bootstrap=bootstrap, connect_retries=1)).start()


async def test_sasl_against_a_broker_without_authentication_is_refused_at_once(tmp_path: Path,
                                                                                password: str) -> None:
    """An open Tansu answers the SaslHandshake with UnsupportedSaslMechanism, an error code, as Apache Kafka answers a
    wrong password; aiokafka's bootstrap hides it behind "Unable to bootstrap", streamforge recovers it."""
    async with tansu(EmbeddedBrokers(tmp_path)) as bootstrap:
        t0 = time.monotonic()
        with pytest.raises(AuthenticationFailed, match="UnsupportedSaslMechanism"):
            await Producer(sasl_config(bootstrap, "SCRAM-SHA-256")).start()
        assert time.monotonic() - t0 < 5


async def test_the_bundled_tansu_is_the_build_these_findings_are_for() -> None:
    proc = await asyncio.create_subprocess_exec(tansu_binary(), "--version", stdout=asyncio.subprocess.PIPE)
    out = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
    assert out.split() == ["tansu", "0.6.0"], f"a different Tansu ({out.strip()}): re-check SASL and TLS on it"
