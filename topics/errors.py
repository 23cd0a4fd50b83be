"""Typed errors shared by every role.

Callers decide from data, not strings: every error carries a ``retriable`` flag
(try the same thing again later) and the fields that explain it.
"""

from __future__ import annotations


class StreamforgeError(Exception):
    """Base of every streamforge error. ``retriable`` says whether retrying may succeed."""

    retriable: bool = False

    def __init__(self, message: str, *, retriable: bool | None = None) -> None:
        super().__init__(message)
        if retriable is not None:
            self.retriable = retriable


# --- the wire -------------------------------------------------------------


class CodecError(StreamforgeError):
    """A message could not be encoded or decoded. Never retriable: the bytes will not change."""

    retriable = False
    reason = "malformed"


class MalformedMessage(CodecError):
    """Bytes that are not a valid message: not msgpack, truncated, wrong field types or shapes."""

    reason = "malformed"


class UnknownSchema(CodecError):
    """The message names a schema, or a version of it, that this build does not know."""

    reason = "unknown_schema"

    def __init__(self, schema: object, version: object) -> None:
        super().__init__(f"unknown schema {schema!r} version {version!r}")
        self.schema = schema
        self.version = version


class MessageTooLarge(CodecError):
    """The message is larger than the configured maximum."""

    reason = "oversized"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class InvalidMessage(CodecError):
    """A well-formed message whose content breaks a rule (NaN reward, mismatched lengths)."""

    reason = "invalid"


# --- brokers and configuration ---------------------------------------------


class BrokerUnavailable(StreamforgeError):
    """A broker could not be reached (yet). Retriable: brokers come up late."""

    retriable = True

    def __init__(self, kind: str, address: str, detail: str = "") -> None:
        msg = f"{kind} broker at {address} is unreachable"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.kind = kind
        self.address = address


class BrokerError(StreamforgeError):
    """A broker answered with an error."""


class AuthenticationFailed(BrokerError):
    """The broker refused this client's login: its credentials or its SASL mechanism. Not retriable: the same login
    is refused again. Names the address, the mechanism and the user, never the secret."""

    retriable = False

    def __init__(self, kind: str, address: str, *, mechanism: str, user: str, detail: str) -> None:
        super().__init__(f"{kind} broker at {address} refused the {mechanism} login of user {user!r}: {detail}")
        self.kind = kind
        self.address = address
        self.mechanism = mechanism
        self.user = user


class PermissionDenied(BrokerError):
    """The broker refused this client's user a publish or a subscription (``operation``: ``publish`` or
    ``subscribe``) to ``subject``: its NATS permissions (``streamforge nats-permissions``) do not allow it. Not
    retriable: the same user is refused again."""

    retriable = False

    def __init__(self, operation: str, subject: str) -> None:
        super().__init__(f"nats refused this user's {operation} to {subject!r} (its permissions do not allow it; "
                         "see `streamforge nats-permissions`)")
        self.operation = operation
        self.subject = subject


class StaleWriter(StreamforgeError):
    """A compare-and-set write lost: somebody else wrote a newer value first."""

    retriable = False

    def __init__(self, key: str, expected_revision: int | None) -> None:
        super().__init__(f"stale write to {key!r} (expected revision {expected_revision})")
        self.key = key
        self.expected_revision = expected_revision


class ConfigError(StreamforgeError):
    """Bad configuration; names the offending key."""

    retriable = False

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key {key!r}: {message}")
        self.key = key


class RoleCrashed(StreamforgeError):
    """A supervised loop of a role ended unexpectedly."""

    retriable = False

    def __init__(self, role: str, loop: str, cause: BaseException | None) -> None:
        detail = f"{type(cause).__name__}: {cause}" if cause else "returned"
        super().__init__(f"role {role!r}: loop {loop!r} stopped unexpectedly ({detail})")
        self.role = role
        self.loop = loop
        self.cause = cause


class TimeoutExpired(StreamforgeError):
    """A bounded wait ran out (collective, request, drain)."""

    retriable = True


def check_choices(cfg: object, section: str) -> None:
    """Raise ``ConfigError`` naming ``section.field`` for any ``Literal[...]``-typed field of the config dataclass
    ``cfg`` whose value is not one of its choices. OmegaConf checks them when a config is loaded; this covers a
    dataclass built in code."""
    for name, choices in _literal_fields(type(cfg)).items():
        value = getattr(cfg, name)
        if value not in choices:
            raise ConfigError(f"{section}.{name}", f"{value!r} is not one of {', '.join(map(repr, choices))}")


_LITERALS: dict[type, dict[str, tuple[object, ...]]] = {}


def _literal_fields(cls: type) -> dict[str, tuple[object, ...]]:
    cached = _LITERALS.get(cls)
    if cached is None:
        import dataclasses
        import typing

        hints = typing.get_type_hints(cls)
        cached = {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
                  if typing.get_origin(hints[f.name]) is typing.Literal}
        _LITERALS[cls] = cached
    return cached
