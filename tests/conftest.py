"""Shared fixtures: real brokers on free ports (Tansu + nats-server), and a per-test RunConfig pointing at them.

Set ``STREAMFORGE_KAFKA_BOOTSTRAP`` and ``STREAMFORGE_NATS_URL`` to run the integration suite against external
brokers instead (e.g. a real Apache Kafka cluster, or a separate ``streamforge brokers``); then nothing is started
here. Whether the Kafka broker is Tansu is probed (``BrokerAddresses.tansu``): the tests that pin Tansu's limits, or
need what it lacks, look at that, not at who started it.
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

FOLDER_MARKS = {"integration": ("integration",), "chaos": ("integration", "chaos", "slow")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers from the folder (``tests/integration``: integration; ``tests/chaos``: integration, chaos, slow), and
    ``gpu`` tests skipped cleanly where CUDA is not available."""
    cuda: bool | None = None
    for item in items:
        parts = Path(str(item.fspath)).parts
        folder = parts[parts.index("tests") + 1] if "tests" in parts[:-1] else ""
        for mark in FOLDER_MARKS.get(folder, ()):
            item.add_marker(mark)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA (a GPU test)"))


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class BrokerAddresses:
    kafka_bootstrap: str
    nats_url: str
    embedded: EmbeddedBrokers | None = None
    tansu: bool = True  # the Kafka broker is Tansu (then no idempotence, wrong end_offsets)

    @property
    def external(self) -> bool:
        return self.embedded is None


async def refuses_idempotence(bootstrap: str) -> bool:
    """Whether the broker is Tansu, told by what sets it apart for the tests: it answers aiokafka's InitProducerId
    with UnknownError, where Apache Kafka grants an idempotent producer."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import UnknownError

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    try:
        await producer.start()
        return False
    except UnknownError:
        return True
    finally:
        await producer.stop()


@pytest.fixture(scope="session")
async def brokers(tmp_path_factory: pytest.TempPathFactory):
    """Real Kafka-protocol and NATS brokers for the whole session (external ones if the env names them)."""
    kafka = os.environ.get("STREAMFORGE_KAFKA_BOOTSTRAP")
    nats_url = os.environ.get("STREAMFORGE_NATS_URL")
    if kafka and nats_url:
        yield BrokerAddresses(kafka, nats_url, tansu=await refuses_idempotence(kafka))
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



@pytest.fixture
def one_thread():
    """The tiny model gains nothing from a second thread, and OpenMP spinning on a busy 2-core box costs 10x."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
