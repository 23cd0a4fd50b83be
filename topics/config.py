"""Configuration of the broker clients and of topic creation."""

from __future__ import annotations

from dataclasses import dataclass, field

from topics.errors import ConfigError

_SECURITY = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_COMPRESSION = ("none", "gzip", "lz4", "zstd", "snappy")


@dataclass(kw_only=True, slots=True)
class KafkaConfig:
    """How every role reaches Kafka (Tansu embedded, or a real cluster). Env: ``STREAMFORGE_KAFKA_BOOTSTRAP``."""

    bootstrap: str = ""  # host:port[,host:port]; empty = the embedded broker that `up` or a test provides
    client_id: str = "streamforge"
    acks: str = "all"  # "0" | "1" | "all"
    compression: str = "snappy"  # aiokafka's lz4 is LZ4HC (7 MB/s on a 108 KB batch); snappy 285 MB/s
    linger_ms: int = 5
    max_message_bytes: int = 16 * 1024 * 1024
    request_timeout_ms: int = 30_000
    session_timeout_ms: int = 6_000  # Tansu holds each group join for about half of this: keep it short
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 600_000
    # longest a fetch waits for new records. Tansu answers a fetch only when this runs out, even once records
    # arrived (measured: produce->consume 115 ms median at aiokafka's default 500, 9 ms at 50), and every record
    # crosses three topics on its way to a train step. Real Kafka answers at once; there 50 ms costs an idle
    # consumer 20 small requests a second.
    fetch_max_wait_ms: int = 50
    connect_retries: int = 10  # attempts to reach a broker that comes up late
    retry_backoff_s: float = 0.5  # first backoff; doubles up to 8 s
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str = ""
    sasl_password_env: str = "STREAMFORGE_KAFKA_PASSWORD"  # secrets come from the environment, never the file
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    idempotent: bool = False  # producer idempotence (needs acks "all"); real Kafka has it, Tansu does not

    def __post_init__(self) -> None:
        if self.idempotent and self.acks != "all":
            raise ConfigError("kafka.idempotent", "needs kafka.acks 'all'")
        if self.acks not in ("0", "1", "all"):
            raise ConfigError("kafka.acks", f"must be '0', '1' or 'all', not {self.acks!r}")
        if self.compression not in _COMPRESSION:
            raise ConfigError("kafka.compression", f"must be one of {_COMPRESSION}")
        if self.security_protocol not in _SECURITY:
            raise ConfigError("kafka.security_protocol", f"must be one of {_SECURITY}")
        if not 1 <= self.fetch_max_wait_ms <= 60_000:
            raise ConfigError("kafka.fetch_max_wait_ms", "must be between 1 and 60000")
        if self.max_message_bytes < 1024:
            raise ConfigError("kafka.max_message_bytes", "must be at least 1024")
        for part in filter(None, self.bootstrap.split(",")):
            host, _, port = part.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("kafka.bootstrap", f"{part!r} is not host:port")


@dataclass(kw_only=True, slots=True)
class NatsConfig:
    """How every role reaches NATS (JetStream enabled). Env: ``STREAMFORGE_NATS_URL``."""

    url: str = ""  # nats://host:port[,nats://...]; empty = the embedded server
    token_env: str = "STREAMFORGE_NATS_TOKEN"
    user: str = ""
    password_env: str = "STREAMFORGE_NATS_PASSWORD"
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    connect_timeout_s: float = 5.0
    connect_retries: int = 10
    request_timeout_s: float = 5.0
    kv_history: int = 16

    def __post_init__(self) -> None:
        for part in filter(None, self.url.split(",")):
            if not part.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ConfigError("nats.url", f"{part!r} must start with nats:// or tls://")
        if self.connect_timeout_s <= 0:
            raise ConfigError("nats.connect_timeout_s", "must be positive")


TOPIC_SUFFIXES = ("prompts", "episodes", "batches", "sft", "drops", "unanswered", "dead-letter")


@dataclass(kw_only=True, slots=True)
class TopicsConfig:
    """Topic creation: partitions and retention per topic. Never rely on broker auto-creation."""

    prompts_partitions: int = 4
    episodes_partitions: int = 4
    batches_partitions: int = 1
    sft_partitions: int = 1
    drops_partitions: int = 1
    unanswered_partitions: int = 1
    dead_letter_partitions: int = 1
    replication_factor: int = 1
    # per topic (prompts, episodes, batches, sft, drops, unanswered, dead-letter): Kafka's retention.ms of the topic when it is
    # created, -1 = forever; a topic not named keeps the broker's default (7 days on Apache Kafka)
    retention_ms: dict[str, int] = field(default_factory=dict)
    # per topic, likewise: retention.bytes (per partition on Apache Kafka), -1 = no size limit
    retention_bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("prompts_partitions", "episodes_partitions", "batches_partitions", "sft_partitions",
                     "drops_partitions", "unanswered_partitions", "dead_letter_partitions", "replication_factor"):
            if getattr(self, name) < 1:
                raise ConfigError(f"topics.{name}", "must be at least 1")
        for name in ("retention_ms", "retention_bytes"):
            for topic, value in getattr(self, name).items():
                if topic not in TOPIC_SUFFIXES:
                    raise ConfigError(f"topics.{name}.{topic}", f"is not a topic of the run {TOPIC_SUFFIXES}")
                if value != -1 and value < 1:
                    raise ConfigError(f"topics.{name}.{topic}", "must be -1 (no limit) or positive")

    def topic_configs(self, suffix: str) -> dict[str, str]:
        """The Kafka topic configs a topic is created with (``retention.ms``, ``retention.bytes``)."""
        out = {}
        if suffix in self.retention_ms:
            out["retention.ms"] = str(self.retention_ms[suffix])
        if suffix in self.retention_bytes:
            out["retention.bytes"] = str(self.retention_bytes[suffix])
        return out

    def partitions(self, suffix: str) -> int:
        return {"prompts": self.prompts_partitions, "episodes": self.episodes_partitions,
                "batches": self.batches_partitions, "sft": self.sft_partitions, "drops": self.drops_partitions,
                "unanswered": self.unanswered_partitions, "dead-letter": self.dead_letter_partitions}[suffix]
