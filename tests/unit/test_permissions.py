"""``streamforge nats-permissions`` allows each role exactly the NATS channels its code uses: the channels are read
from the code (``test_channels.code_channels``), and every one a role produces or consumes must be allowed to it,
while no role may publish to a subject or KV key, or subscribe to a subject, that its code does not use."""

from __future__ import annotations

from test_channels import SERVICE_KEY, SERVICE_SUBJECT, code_channels

from streamforge.config import load_config
from streamforge.permissions import ROLES, ServiceScope, nats_authorization, permissions, service_scope
from topics.names import Names

NAMES = Names("u")
SCOPE = ServiceScope(envs=("count",), rewards=("judge",))
NATS_CHANNELS = {"policy.version", "generators.membership", "generators.ack", "kv:latest", "kv:progress", "kv:fenced",
                 SERVICE_KEY, SERVICE_SUBJECT}
SERVICE_OF = {"env": "count", "reward": "judge", "generator": "judge", "status": "judge"}  # whose key, whose subject


def allows(patterns: list[str], subject: str) -> bool:
    """Whether one of nats-server's subject ``patterns`` (``*`` a token, ``>`` the rest) matches ``subject``."""
    for pattern in patterns:
        p, s = pattern.split("."), subject.split(".")
        if p[-1] == ">" and len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s)):
            return True
        if len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s)):
            return True
    return False


def writes(channel: str, role: str) -> list[str]:
    """The subjects a producer of ``channel`` publishes to (the policy keys' and the replicas' as the code does)."""
    bucket, services = NAMES.policy_bucket, NAMES.services_bucket
    service = SERVICE_OF.get(role, "judge")
    return {"policy.version": [NAMES.policy_subject], "generators.membership": [NAMES.membership_subject],
            "generators.ack": [NAMES.ack_subject], "kv:latest": [f"$KV.{bucket}.latest", NAMES.policy_subject],
            "kv:progress": [f"$KV.{bucket}.progress"], "kv:fenced": [f"$KV.{bucket}.fenced"],
            SERVICE_KEY: [f"$KV.{services}.{service}.r-1", f"$JS.API.STREAM.INFO.KV_{services}",
                          f"$JS.API.STREAM.CREATE.KV_{services}"],
            SERVICE_SUBJECT: [NAMES.service_subject(service, "r-1")]}[channel]


def reads(channel: str, role: str) -> tuple[list[str], list[str]]:
    """``(publish, subscribe)`` subjects a consumer of ``channel`` uses: a KV read is JetStream API requests."""
    if channel.startswith("kv:"):
        stream = f"KV_{NAMES.services_bucket if channel == SERVICE_KEY else NAMES.policy_bucket}"
        return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}",
                f"$JS.API.CONSUMER.INFO.{stream}.c1", f"$JS.FC.{stream}.c1.x"], ["_INBOX.abc.def"]
    if channel == SERVICE_SUBJECT:
        return [], [NAMES.service_subject(SERVICE_OF.get(role, "judge"), "r-1")]
    return [], [{"policy.version": NAMES.policy_subject, "generators.membership": NAMES.membership_subject,
                 "generators.ack": NAMES.ack_subject}[channel]]


def test_every_channel_a_role_uses_is_allowed_and_no_other_is() -> None:
    consumers, producers = code_channels()
    perms = permissions(NAMES, SCOPE)
    kafka = {"prompts", "episodes", "batches", "sft", "drops", "unanswered", "dead-letter"}
    channels = (set(consumers) | set(producers)) - kafka
    assert channels == NATS_CHANNELS, "a NATS channel this test does not know: say what it takes"
    for role in ROLES:
        pub, sub = perms[role]["publish"], perms[role]["subscribe"]
        for channel in channels:
            if role in producers.get(channel, ()):
                assert all(allows(pub, s) for s in writes(channel, role)), (role, "publish", channel)
            elif channel not in ("generators.membership",) or role != "trainer":  # the trainer answers joins
                assert not allows(pub, writes(channel, role)[0]), (role, "may publish", channel)
            if role in consumers.get(channel, ()):
                p, s = reads(channel, role)
                assert all(allows(pub, x) for x in p) and all(allows(sub, x) for x in s), (role, "read", channel)
            elif not channel.startswith("kv:"):  # reading a bucket is per bucket, not per key
                assert not any(allows(sub, x) for x in reads(channel, role)[1]), (role, "may subscribe", channel)


def test_only_the_reward_replica_answers_requests_and_only_its_own_services_are_allowed() -> None:
    perms = permissions(NAMES, SCOPE)
    assert [r for r in ROLES if perms[r].get("allow_responses")] == ["reward"]
    assert not allows(perms["reward"]["publish"], "_INBOX.abc.def")  # answers only requests it received
    key = f"$KV.{NAMES.services_bucket}"
    assert allows(perms["env"]["publish"], f"{key}.count.r-1") and not allows(perms["env"]["publish"], f"{key}.judge.r")
    assert not allows(perms["reward"]["publish"], f"{key}.count.r-1")
    assert not allows(perms["generator"]["publish"], NAMES.service_subject("other", "r-1"))
    assert not allows(perms["status"]["publish"], f"$JS.API.STREAM.CREATE.KV_{NAMES.services_bucket}")
    # a config that names no service: any service of the prefix, still only under its own kind's rules
    anyone = permissions(NAMES)
    assert allows(anyone["env"]["publish"], f"{key}.whatever.r-1")
    assert allows(anyone["generator"]["publish"], NAMES.service_subject("whatever", "r-1"))
    assert not allows(anyone["generator"]["publish"], f"{key}.whatever.r-1")


def test_the_scope_comes_from_the_run_config_and_shows_in_the_header() -> None:
    cfg = load_config(None, ["--run.prefix=u", "--env.name=count", "--up.envs=0", "--reward.name=judge",
                             "--generator.rewards=[toy,remote:judge,remote:other]"], environ={})
    assert service_scope(cfg) == ServiceScope(envs=("count",), rewards=("judge", "other"))
    assert service_scope(load_config(None, [], environ={})) == ServiceScope()
    text = nats_authorization(NAMES, scope=SCOPE)
    assert "services count (env), judge (reward)" in text.splitlines()[0]
    assert text.count("{user: ") == len(ROLES) and text.count("allow_responses: true") == 1
