"""Kafka client security options map onto aiokafka; secrets come from the environment and stay out of errors."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from topics.config import KafkaConfig
from topics.errors import BrokerUnavailable, ConfigError
from topics.kafka import client_kwargs
from topics.nats import connect_kwargs
from topics.config import NatsConfig


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
