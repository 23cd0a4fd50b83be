"""Every Kafka topic, NATS subject and KV bucket name, in one place.

All names carry the run's prefix so several runs can share brokers: topic ``{prefix}.episodes``, subject
``{prefix}.policy.version``, KV bucket ``{prefix}_policy`` (bucket names allow no dots). The README's topic
table is generated from ``CATALOG`` and a test keeps the two equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def valid_prefix(prefix: str) -> bool:
    return bool(_PREFIX_RE.match(prefix))


MAX_MEMBER_ID = 128  # bounds every generator id, so the fencing record stays far below NATS's payload limit
_MEMBER_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._:@-]{{0,{MAX_MEMBER_ID - 1}}}$")


def valid_member_id(member_id: str) -> bool:
    """A generator id: 1 to ``MAX_MEMBER_ID`` characters of letters, digits and ``. _ : @ -``, starting with a
    letter or digit (a hostname and pid, a pod name)."""
    return bool(_MEMBER_RE.match(member_id))


@dataclass(frozen=True, slots=True)
class Channel:
    """One row of the topic table."""

    kind: str  # "kafka" | "nats" | "kv"
    suffix: str
    producers: str
    consumers: str
    key: str
    schema: str
    config_key: str


CATALOG: tuple[Channel, ...] = (
    Channel("kafka", "prompts", "feeder", "generator (group `{prefix}.generators`), audit", "prompt_id",
            "Prompt", "topics.prompts_partitions"),
    Channel("kafka", "episodes", "generator", "buffer (group `{prefix}.buffers`), audit", "group_id",
            "Episode", "topics.episodes_partitions"),
    Channel("kafka", "batches", "buffer", "trainer (group `{prefix}.trainers`), audit", "batch_id",
            "Batch", "topics.batches_partitions"),
    Channel("kafka", "sft", "feeder (SFT mode)", "trainer (SFT mode)", "example_id",
            "SFTExample", "topics.sft_partitions"),
    Channel("kafka", "drops", "buffer", "audit, generator (quota refunds)", "group_id", "DropRecord",
            "topics.drops_partitions"),
    Channel("kafka", "unanswered", "generator (a prompt whose every episode was dead-lettered, before its offset "
            "is committed)", "audit", "prompt_id", "UnansweredPrompt", "topics.unanswered_partitions"),
    Channel("kafka", "dead-letter", "every role", "audit, `streamforge tail`", "source topic",
            "DeadLetter", "topics.dead_letter_partitions"),
    Channel("nats", "policy.version", "trainer", "none (roles watch the KV bucket's `latest`; for observers outside "
            "streamforge)", "-", "PolicyVersion", "nats.url"),
    Channel("nats", "generators.membership", "generator (join is a request: the trainer replies with the "
            "PolicyVersion it pushes)", "trainer, status", "-", "Membership", "weightsync.heartbeat_s"),
    Channel("nats", "generators.ack", "generator", "trainer, status", "-", "VersionAck", "weightsync.ack_deadline_s"),
    Channel("kv", "policy", "trainer (owns it: rewrites a value it did not write)",
            "generator, buffer, status, evaluator, trainer (a restart continues after it)", "`latest`", "PolicyVersion",
            "nats.kv_history"),
    Channel("kv", "policy", "trainer (after every step)", "buffer, generator, evaluator", "`progress`",
            "TrainerProgress", "buffer.max_batches_ahead"),
    Channel("kv", "policy", "trainer (weightsync fencing)", "buffer, generator, trainer (a restart keeps it)",
            "`fenced`",
            "JSON {generator_id: {last_acked_version, fenced_at, missed_version}}", "weightsync.ack_deadline_s"),
    Channel("kv", "services", "env, reward (each replica every `heartbeat_s` with a TTL of `health_timeout_s` "
            "rounded up; deleted when it stops)", "generator (env sessions and `remote:` rewards), status, up (waits "
            "for the replicas it started)", "`<service>.<replica_id>`", "ServiceBeat", "env.health_timeout_s"),
    Channel("nats", "svc.<service>.<replica_id>", "generator (`remote:<service>` rewards: a batch per request)",
            "reward", "-", "RewardRequest -> RewardReply or ServiceFault", "reward.name"),
)

# service and replica names: they are parts of NATS subjects and KV keys (no dots, no wildcards)
MAX_SERVICE_NAME = 64
_SERVICE_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_SERVICE_NAME - 1}}}$")
_REPLICA_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_MEMBER_ID - 1}}}$")


def valid_service_name(name: str) -> bool:
    """A service name (``env.name``, ``reward.name``): 1 to 64 letters, digits, ``_`` or ``-``."""
    return bool(_SERVICE_RE.match(name))


def valid_replica_id(replica_id: str) -> bool:
    """A replica id: 1 to ``MAX_MEMBER_ID`` letters, digits, ``_`` or ``-``, starting with a letter or digit."""
    return bool(_REPLICA_RE.match(replica_id))


def safe_replica_id(text: str) -> str:
    """``text`` (a hostname with dots, say) made a valid replica id: other characters become ``-``."""
    out = re.sub(r"[^A-Za-z0-9_-]", "-", text).lstrip("-_")[:MAX_MEMBER_ID]
    return out or "replica"


@dataclass(frozen=True, slots=True)
class Names:
    """The concrete names for one run prefix."""

    prefix: str = "sf"

    def __post_init__(self) -> None:
        if not valid_prefix(self.prefix):
            raise ValueError(f"run prefix {self.prefix!r} must match {_PREFIX_RE.pattern}")

    # Kafka topics
    @property
    def prompts(self) -> str:
        return f"{self.prefix}.prompts"

    @property
    def episodes(self) -> str:
        return f"{self.prefix}.episodes"

    @property
    def batches(self) -> str:
        return f"{self.prefix}.batches"

    @property
    def sft(self) -> str:
        return f"{self.prefix}.sft"

    @property
    def drops(self) -> str:
        return f"{self.prefix}.drops"

    @property
    def unanswered(self) -> str:
        """Prompts a generator answered with no Episode, and why (``UnansweredPrompt``)."""
        return f"{self.prefix}.unanswered"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}.dead-letter"

    # Kafka consumer groups
    @property
    def generators_group(self) -> str:
        return f"{self.prefix}.generators"

    @property
    def buffers_group(self) -> str:
        return f"{self.prefix}.buffers"

    @property
    def trainers_group(self) -> str:
        return f"{self.prefix}.trainers"

    # NATS subjects and KV
    @property
    def policy_subject(self) -> str:
        return f"{self.prefix}.policy.version"

    @property
    def membership_subject(self) -> str:
        return f"{self.prefix}.generators.membership"

    @property
    def ack_subject(self) -> str:
        return f"{self.prefix}.generators.ack"

    @property
    def policy_bucket(self) -> str:
        return f"{self.prefix}_policy"

    @property
    def services_bucket(self) -> str:
        """The KV bucket where every replica of every service beats (``runtime/services.py``)."""
        return f"{self.prefix}_services"

    def service_subject(self, service: str, replica_id: str) -> str:
        """Where one replica of ``service`` takes requests."""
        return f"{self.prefix}.svc.{service}.{replica_id}"

    LATEST_KEY = "latest"
    PROGRESS_KEY = "progress"

    def topics(self) -> list[str]:
        return [self.prompts, self.episodes, self.batches, self.sft, self.drops, self.unanswered, self.dead_letter]

    def consumer_groups(self) -> dict[str, str]:
        """Each topic read through a consumer group, and that group (whose uncommitted records are the lag)."""
        return {self.prompts: self.generators_group, self.episodes: self.buffers_group,
                self.batches: self.trainers_group}

    def resolve(self, channel: Channel) -> str:
        if channel.kind == "kv":
            return f"{self.prefix}_{channel.suffix}"
        return f"{self.prefix}.{channel.suffix}"


def topic_table_markdown(prefix: str = "{prefix}") -> str:
    """The README table of every topic, subject and bucket."""
    rows = ["| kind | name | producer | consumer | key | schema | config key |", "|---|---|---|---|---|---|---|"]
    for c in CATALOG:
        name = f"{prefix}_{c.suffix}" if c.kind == "kv" else f"{prefix}.{c.suffix}"
        kind = {"kafka": "Kafka topic", "nats": "NATS subject", "kv": "JetStream KV bucket"}[c.kind]
        rows.append(
            f"| {kind} | `{name}` | {c.producers} | {c.consumers.replace('{prefix}', prefix)} | {c.key} "
            f"| `{c.schema}` | `{c.config_key}` |"
        )
    return "\n".join(rows)
