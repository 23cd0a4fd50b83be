"""The README's topic and subject table (``topics.names.CATALOG``) says who produces and consumes each NATS
subject and KV key, and who consumes each Kafka topic; this test reads the code (``ast``) and checks it says true.

Each role's modules are listed in ``ROLE_OF``; a call that consumes or produces a channel is recognised by its
function's name and a ``names.<attr>`` (or key constant) among its arguments."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from topics.names import CATALOG

ROOT = Path(__file__).resolve().parents[2]

ROLE_OF = {
    "producers/generator.py": "generator", "producers/intake.py": "generator", "producers/refunds.py": "generator",
    "producers/pipeline.py": "generator", "weightsync/receiver.py": "generator", "producers/feeder.py": "feeder",
    "buffer/service.py": "buffer", "buffer/recovery.py": "buffer", "weightsync/fencing.py": "buffer",
    "consumers/trainer.py": "trainer", "consumers/source.py": "trainer", "weightsync/publisher.py": "trainer",
    "weightsync/policy_kv.py": "trainer",
    "streamforge/audit.py": "audit", "streamforge/status.py": "status", "streamforge/tail.py": "tail",
    "services/env_replica.py": "env", "services/reward_replica.py": "reward", "runtime/remote_reward.py": "generator",
    "streamforge/replicas.py": "up", "producers/evaluator.py": "evaluator",
}
SERVICE_KEY, SERVICE_SUBJECT = "kv:<service>.<replica_id>", "svc.<service>.<replica_id>"
KAFKA_READERS = {"Consumer", "RecordSource", "read_topic", "DropRefunds"}  # GroupOffsets reads offsets only
SUBJECT_ATTRS = {"policy_subject": "policy.version", "membership_subject": "generators.membership",
                 "ack_subject": "generators.ack"}
TOPIC_ATTRS = {"prompts": "prompts", "episodes": "episodes", "batches": "batches", "sft": "sft", "drops": "drops",
               "unanswered": "unanswered", "dead_letter": "dead-letter"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | \
           {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def code_channels() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(consumers, producers)``: channel -> roles, from every module of ``ROLE_OF``."""
    consumers: dict[str, set[str]] = defaultdict(set)
    producers: dict[str, set[str]] = defaultdict(set)
    for rel, role in ROLE_OF.items():
        for call in (n for n in ast.walk(ast.parse((ROOT / rel).read_text())) if isinstance(n, ast.Call)):
            fn, used = _name(call.func), set().union(*(_attrs(a) for a in [*call.args, *call.keywords]), set())
            if fn == "subscribe":
                for attr in used & set(SUBJECT_ATTRS):
                    consumers[SUBJECT_ATTRS[attr]].add(role)
            if fn in ("publish_msg", "request_msg"):
                for attr in used & set(SUBJECT_ATTRS):
                    producers[SUBJECT_ATTRS[attr]].add(role)
            if fn == "publish" and any(k.arg == "expected_revision" for k in call.keywords):
                producers["kv:latest"].add(role)  # PolicyStore.publish: the KV key and its announcement
                producers["policy.version"].add(role)
            if fn in ("watch", "latest_good", "latest"):
                consumers["kv:latest"].add(role)
            if fn in ("watch_progress", "progress"):
                consumers["kv:progress"].add(role)
            if fn == "put_progress":
                producers["kv:progress"].add(role)
            if fn == "FenceView" or (fn == "get" and "FENCED_KEY" in used):
                consumers["kv:fenced"].add(role)
            if fn == "put" and "FENCED_KEY" in used:
                producers["kv:fenced"].add(role)
            if fn in ("ServiceDirectory", "read_services"):  # runtime/services.py: watches the services bucket
                consumers[SERVICE_KEY].add(role)
            if fn == "ServiceRegistration":  # beats in the bucket; with a handler, takes requests on its subject
                producers[SERVICE_KEY].add(role)
                if any(k.arg == "handler" for k in call.keywords):
                    consumers[SERVICE_SUBJECT].add(role)
            if fn in ("call_one", "fanout"):
                producers[SERVICE_SUBJECT].add(role)
            if fn in KAFKA_READERS:
                for attr in used & set(TOPIC_ATTRS):
                    consumers[TOPIC_ATTRS[attr]].add(role)
    return consumers, producers


def table_roles(text: str) -> set[str]:
    """The roles a table cell names: the first word of each comma-separated item (``none`` for none)."""
    if text.startswith("none"):
        return set()
    return {item.strip().strip("`").split()[0].strip("`") for item in text.split(", ")}


def catalog_key(channel) -> str:
    if channel.kind == "kv":
        return "kv:" + channel.key.strip("`")
    return channel.suffix


def test_every_subject_and_kv_key_row_names_its_real_producers_and_consumers() -> None:
    consumers, producers = code_channels()
    for c in CATALOG:
        key = catalog_key(c)
        if c.kind == "kafka":
            continue
        assert table_roles(c.consumers) == consumers.get(key, set()), (key, c.consumers, consumers.get(key))
        assert table_roles(c.producers) == producers.get(key, set()), (key, c.producers, producers.get(key))


def test_every_kafka_topic_row_names_its_real_readers() -> None:
    consumers, _ = code_channels()
    for c in CATALOG:
        if c.kind != "kafka":
            continue
        said = table_roles(c.consumers) - {"streamforge"}
        assert said == consumers.get(c.suffix, set()), (c.suffix, c.consumers, consumers.get(c.suffix))


def test_the_table_covers_every_channel_the_code_uses() -> None:
    consumers, producers = code_channels()
    keys = {catalog_key(c) for c in CATALOG}
    assert set(consumers) | set(producers) <= keys
