"""Kafka client security options map onto aiokafka; secrets come from the environment and stay out of errors."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from topics.config import KafkaConfig, NatsConfig
from topics.errors import BrokerUnavailable, ConfigError
from topics.kafka import client_kwargs
from topics.nats import connect_kwargs


def test_sasl_ssl_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from certs import make_certs

    certs = make_certs(tmp_path)
    monkeypatch.setenv("STREAMFORGE_KAFKA_PASSWORD", "kafka-secret")
    cfg = KafkaConfig(bootstrap="kafka:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                      sasl_username="trainer", ssl_cafile=str(certs["ca"]))
    kw = client_kwargs(cfg)
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["sasl_plain_username"] == "trainer" and kw["sasl_plain_password"] == "kafka-secret"
    assert isinstance(kw["ssl_context"], ssl.SSLContext)
    assert "kafka-secret" not in repr(cfg)  # the config holds the variable's name, never the secret


def test_bad_security_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match="kafka.security_protocol"):
        KafkaConfig(security_protocol="TLS")
    with pytest.raises(ConfigError, match="nats.url"):
        NatsConfig(url="http://nats:4222")


def test_empty_addresses_say_which_variable_to_set() -> None:
    with pytest.raises(BrokerUnavailable, match="STREAMFORGE_KAFKA_BOOTSTRAP"):
        client_kwargs(KafkaConfig())
    with pytest.raises(BrokerUnavailable, match="STREAMFORGE_NATS_URL"):
        connect_kwargs(NatsConfig(), name="x")


def test_nats_tls_url_gets_a_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMFORGE_NATS_TOKEN", "tok")
    kw = connect_kwargs(NatsConfig(url="tls://nats:4222"), name="x")
    assert isinstance(kw["tls"], ssl.SSLContext) and kw["token"] == "tok"


def test_sasl_refusals_are_told_from_unreachable_brokers() -> None:
    from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed, UnsupportedSaslMechanismError

    from topics.kafka import sasl_refusal

    assert "SaslAuthenticationFailed" in sasl_refusal(SaslAuthenticationFailed("bad"), "SCRAM-SHA-512")
    assert sasl_refusal(UnsupportedSaslMechanismError("PLAIN"), "PLAIN")
    # aiokafka's SCRAM client reads v=<signature>; a server that rejects the login answers e=<error>
    assert "e=" in sasl_refusal(KeyError("v"), "SCRAM-SHA-256")
    assert "AssertionError" in sasl_refusal(AssertionError("Server should either close"), "PLAIN")
    for unreachable in (KafkaConnectionError("closed"), ConnectionRefusedError(111, "refused"), TimeoutError()):
        assert sasl_refusal(unreachable, "PLAIN") is None


async def test_a_refused_login_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiokafka's bootstrap turns a refused SASL login into a bare KafkaConnectionError; the one-connection check
    (here a fake) recovers the refusal, and the client is stopped at the first attempt instead of retried."""
    from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed

    from topics import kafka
    from topics.errors import AuthenticationFailed

    class Client:
        starts = stops = 0

        async def start(self) -> None:
            self.starts += 1
            raise KafkaConnectionError("Unable to bootstrap from [('kafka', 9093)]")

        async def stop(self) -> None:
            self.stops += 1

    async def refusing_conn(*args: object, **kw: object) -> None:
        raise SaslAuthenticationFailed("SASL Authentication failed.")

    monkeypatch.setattr(kafka, "create_conn", refusing_conn)
    monkeypatch.setenv("SF_TEST_KAFKA_PASSWORD", "kafka-secret")
    cfg = KafkaConfig(bootstrap="kafka:9093", security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
                      sasl_username="trainer", sasl_password_env="SF_TEST_KAFKA_PASSWORD", connect_retries=5,
                      retry_backoff_s=0.01)
    client = Client()
    with pytest.raises(AuthenticationFailed) as err:
        await kafka.start_with_retries(client, cfg, "producer")
    assert (client.starts, client.stops) == (1, 1)
    assert not err.value.retriable and err.value.user == "trainer" and err.value.mechanism == "SCRAM-SHA-256"
    assert "kafka:9093" in str(err.value) and "kafka-secret" not in str(err.value)


async def test_the_login_check_tries_each_bootstrap_broker_until_one_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreachable first broker is skipped (as aiokafka's bootstrap skips it); the first that answers decides."""
    from aiokafka.errors import SaslAuthenticationFailed

    from topics import kafka
    from topics.errors import AuthenticationFailed

    tried: list[str] = []
    answers: dict[str, Exception | None] = {}

    class Conn:
        closed = False

        def close(self) -> None:
            Conn.closed = True

    async def fake_conn(host: str, port: int, **kw: object) -> Conn:
        tried.append(f"{host}:{port}")
        exc = answers[f"{host}:{port}"]
        if exc is not None:
            raise exc
        return Conn()

    monkeypatch.setattr(kafka, "create_conn", fake_conn)
    monkeypatch.setenv("SF_TEST_KAFKA_PASSWORD", "kafka-secret")
    cfg = KafkaConfig(bootstrap="k1:9093, k2:9093,k3:9093", security_protocol="SASL_PLAINTEXT",
                      sasl_mechanism="SCRAM-SHA-256", sasl_username="trainer",
                      sasl_password_env="SF_TEST_KAFKA_PASSWORD")
    answers.update({"k1:9093": ConnectionRefusedError(111, "refused"),
                    "k2:9093": SaslAuthenticationFailed("SASL Authentication failed."), "k3:9093": None})
    with pytest.raises(AuthenticationFailed) as err:
        await kafka.check_login(cfg)
    assert tried == ["k1:9093", "k2:9093"] and "k2:9093" in str(err.value)

    tried.clear()
    answers["k2:9093"] = None
    assert await kafka.check_login(cfg) == "" and tried == ["k1:9093", "k2:9093"] and Conn.closed

    tried.clear()
    answers.update({"k2:9093": ConnectionRefusedError(111, "refused"), "k3:9093": TimeoutError()})
    assert await kafka.check_login(cfg) == "" and tried == ["k1:9093", "k2:9093", "k3:9093"]
