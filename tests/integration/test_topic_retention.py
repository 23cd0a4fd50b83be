"""``topics.retention_ms`` and ``topics.retention_bytes`` reach the topics a run creates (on Tansu, which keeps
the configs without enforcing them, and on Apache Kafka, which enforces them: run with STREAMFORGE_KAFKA_BOOTSTRAP)."""

from __future__ import annotations

import uuid

import pytest

from streamforge.config import load_config
from topics.admin import ensure_topics, topic_configs

pytestmark = pytest.mark.timeout(120)


async def test_retention_per_topic_is_set_at_creation(brokers) -> None:
    config = load_config(None, [f"--run.prefix=r{uuid.uuid4().hex[:10]}", f"--kafka.bootstrap={brokers.kafka_bootstrap}",
                                "--topics.retention_ms.batches=-1", "--topics.retention_ms.episodes=86400000",
                                "--topics.retention_bytes.episodes=1073741824"], environ={})
    await ensure_topics(config.kafka, config.names, config.topics)
    batches = await topic_configs(config.kafka, config.names.batches)
    episodes = await topic_configs(config.kafka, config.names.episodes)
    assert batches["retention.ms"] == "-1"
    assert episodes["retention.ms"] == "86400000" and episodes["retention.bytes"] == "1073741824"
    prompts = await topic_configs(config.kafka, config.names.prompts)
    assert prompts.get("retention.ms") != "-1"  # not named: the broker's default
