"""Shared fixtures: real brokers on free ports (Tansu + nats-server), and a per-test RunConfig pointing at them.

Set ``STREAMFORGE_KAFKA_BOOTSTRAP`` and ``STREAMFORGE_NATS_URL`` to run the integration suite against external
brokers instead (e.g. a real Apache Kafka cluster); then nothing is started here.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamforge.brokers import EmbeddedBrokers
from streamforge.config import load_config
from topics.admin import ensure_topics

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class BrokerAddresses:
    kafka_bootstrap: str
    nats_url: str
    embedded: EmbeddedBrokers | None = None

    @property
    def external(self) -> bool:
        return self.embedded is None


@pytest.fixture(scope="session")
async def brokers(tmp_path_factory: pytest.TempPathFactory):
    """Real Kafka-protocol and NATS brokers for the whole session (external ones if the env names them)."""
    kafka = os.environ.get("STREAMFORGE_KAFKA_BOOTSTRAP")
    nats_url = os.environ.get("STREAMFORGE_NATS_URL")
    if kafka and nats_url:
        yield BrokerAddresses(kafka, nats_url)
        return
    embedded = EmbeddedBrokers(tmp_path_factory.mktemp("brokers"))
    await embedded.start()
    try:
        yield BrokerAddresses(embedded.kafka_bootstrap, embedded.nats_url, embedded)
    finally:
        embedded.stop()


def make_run_config(brokers: BrokerAddresses, run_dir: Path, overrides: list[str] = ()):  # type: ignore[assignment]
    """A RunConfig for one test: a unique prefix (so tests never see each other's topics) and its own run dir."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    return load_config(
        None,
        [
            f"--run.prefix={prefix}",
            f"--run.run_dir={run_dir}",
            f"--kafka.bootstrap={brokers.kafka_bootstrap}",
            f"--nats.url={brokers.nats_url}",
            *overrides,
        ],
        environ={},
    )


@pytest.fixture
async def run_config(brokers: BrokerAddresses, tmp_path: Path):
    """A RunConfig pointing at the session brokers, with every topic of its run created."""
    cfg = make_run_config(brokers, tmp_path / "run")
    await ensure_topics(cfg.kafka, cfg.names, cfg.topics)
    return cfg
