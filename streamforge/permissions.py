"""``streamforge nats-permissions``: per-role NATS users for a run, so each role can do what it must and no more.

A generator's credentials cannot write the policy store's ``latest`` (nor ``progress`` or ``fenced``): only the
trainer's can. Each role's allow-lists name the run's own subjects (``topics/names.py``) and the JetStream API
subjects its KV reads and watches use on the run's buckets (stream ``KV_<bucket>``); the reply inboxes
(``_INBOX.>``) every request needs. The service replicas (``env``, ``reward``) may open or create the services
bucket and write beats under their services' keys; a reward replica takes requests on its services' subjects and
answers only the requests it received (``allow_responses``), so it can publish nothing else of the run. The
generator reads and watches the services bucket (creating it if it starts first) and sends requests to reward
replicas; ``status`` only reads it. When the run config names its services (``env.name``, ``reward.name``,
``remote:<name>`` in ``generator.rewards``) those rules name them (``ServiceScope``), else they cover every service
of the run prefix. ``nats_authorization`` renders the rules as nats-server's ``authorization`` block (users whose
passwords come from the environment variables it names); ``deploy/nats/`` holds one rendered for the deploy
examples, and ``tests/integration/test_nats_permissions.py`` runs every role's NATS calls against a real
nats-server started with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from topics.names import Names

ROLES = ("trainer", "generator", "buffer", "status", "env", "reward", "evaluator")
REMOTE_PREFIX = "remote:"  # a generator's reward served by a reward service (runtime/remote_reward.py)


@dataclass(frozen=True, slots=True)
class ServiceScope:
    """The services a run names: environments (``envs``) and reward services (``rewards``). Neither named: the
    rules cover any service of the run prefix."""

    envs: tuple[str, ...] = ()
    rewards: tuple[str, ...] = ()

    @property
    def named(self) -> bool:
        return bool(self.envs or self.rewards)

    def services(self, kind: str) -> list[str]:
        """The service names of ``kind`` (``env`` or ``reward``) as subject tokens; ``*`` for any."""
        if not self.named:
            return ["*"]
        return list(self.envs if kind == "env" else self.rewards)


def service_scope(config: Any) -> ServiceScope:
    """The services run config ``config`` names: ``env.name``; ``reward.name`` and every ``remote:<name>`` reward."""
    rewards = {spec.removeprefix(REMOTE_PREFIX) for spec in config.generator.rewards if spec.startswith(REMOTE_PREFIX)}
    if config.reward.name:
        rewards.add(config.reward.name)
    return ServiceScope(envs=(config.env.name,) if config.env.name else (), rewards=tuple(sorted(rewards)))


def _kv_read(stream: str) -> list[str]:
    """What reading and watching the KV bucket of ``stream`` takes (JetStream's API and flow control)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}", "$JS.API.INFO", f"$JS.FC.{stream}.>"]


def _services_watch(stream: str) -> list[str]:
    """What ``ServiceDirectory`` takes to open and watch the services bucket (an ordered consumer over every key;
    it reads no key directly): stream info, the consumer's creation and info, flow control."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.FC.{stream}.>"]


def _services_open(stream: str) -> list[str]:
    """What ``open_bucket`` takes to open the services bucket, or create it when it does not exist yet."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", "$JS.API.INFO"]


def _unique(subjects: list[str]) -> list[str]:
    return list(dict.fromkeys(subjects))


def permissions(names: Names, scope: ServiceScope | None = None) -> dict[str, dict[str, Any]]:
    """``{role: {"publish": [...], "subscribe": [...]}}`` for the run ``names`` (and ``"allow_responses": True``
    where the role answers requests it receives and nothing else); ``scope``: the services it names."""
    scope = scope or ServiceScope()
    bucket, stream = names.policy_bucket, f"KV_{names.policy_bucket}"
    services = f"KV_{names.services_bucket}"
    read = _kv_read(stream)
    inbox = ["_INBOX.>"]
    beats = {kind: [f"$KV.{names.services_bucket}.{s}.*" for s in scope.services(kind)] for kind in ("env", "reward")}
    reward_subjects = [names.service_subject(s, "*") for s in scope.services("reward")]
    out: dict[str, dict[str, Any]] = {
        "trainer": {
            "publish": [names.policy_subject, f"$KV.{bucket}.{names.LATEST_KEY}", f"$KV.{bucket}.{names.PROGRESS_KEY}",
                        f"$KV.{bucket}.fenced", f"$JS.API.STREAM.CREATE.{stream}", *read, *inbox],
            "subscribe": [names.membership_subject, names.ack_subject, *inbox],
        },
        "generator": {"publish": [names.membership_subject, names.ack_subject, *read, *_services_watch(services),
                                  f"$JS.API.STREAM.CREATE.{services}", *reward_subjects],
                      "subscribe": inbox},
        "buffer": {"publish": read, "subscribe": inbox},
        "evaluator": {"publish": read, "subscribe": inbox},  # the policy bucket (no remote: rewards)
        "status": {"publish": [*read, *_services_watch(services)],
                   "subscribe": [names.membership_subject, names.ack_subject, *inbox]},
        "env": {"publish": [*_services_open(services), *beats["env"]], "subscribe": inbox},
        "reward": {"publish": [*_services_open(services), *beats["reward"]], "subscribe": [*reward_subjects, *inbox],
                   "allow_responses": True},
    }
    for perms in out.values():
        perms["publish"], perms["subscribe"] = _unique(perms["publish"]), _unique(perms["subscribe"])
    return out


def nats_authorization(names: Names, *, scope: ServiceScope | None = None,
                       password_env: str = "STREAMFORGE_NATS_{ROLE}_PASSWORD") -> str:
    """nats-server's ``authorization`` block: one user per role, its password from ``$<password_env>``."""
    scope = scope or ServiceScope()
    named = (f"; services {', '.join(scope.envs) or 'none'} (env), {', '.join(scope.rewards) or 'none'} (reward)"
             if scope.named else "")
    lines = [f"# generated by `streamforge nats-permissions` for the run prefix {names.prefix!r}{named}",
             "authorization {", "  users = ["]
    for role, perms in permissions(names, scope).items():
        env = password_env.replace("{ROLE}", role.upper())
        pub = ", ".join(f'"{s}"' for s in perms["publish"])
        sub = ", ".join(f'"{s}"' for s in perms["subscribe"])
        lines.append(f'    {{user: "{role}", password: ${env}, permissions: {{')
        lines.append(f"      publish: {{allow: [{pub}]}}")
        lines.append(f"      subscribe: {{allow: [{sub}]}}")
        if perms.get("allow_responses"):
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def config_authorization(config: Any) -> str:
    """``nats_authorization`` for run config ``config``: its prefix and the services it names."""
    return nats_authorization(config.names, scope=service_scope(config))
