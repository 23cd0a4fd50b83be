"""The trainer's view of the generators: membership, acknowledged versions and fencing (pure state, no I/O).

A generator is a *member* from its ``join`` until its ``leave`` or until it has been silent (no join, heartbeat or
ack) for ``member_timeout_s``. A member is *confirmed* once it completed the weight-transfer handshake (its pair
group came up; with the file transport, which has no handshake, its join); one that does not within
``handshake_timeout_s`` of its join (or, for one known from its heartbeats, of the first round it could join) is
dropped (``expire_unconfirmed``), and its heartbeats are ignored until it joins again. Every publication round expects an
ack of the new version from every member, waiting for an unconfirmed one only until its handshake time is up, so a
fake or half-dead joiner costs a round at most ``handshake_timeout_s``, never the ack deadline. A member that does
not ack by the deadline (or whose transfer failed, that went silent, or that was dropped from the round for its
handshake) is *fenced*. A fenced generator that is no longer a member and never acked anything leaves the record after
``fence_expiry_s`` (``expire_fences``): ids are bounded (``topics.names.valid_member_id``) and members capped, so
the record stays far below NATS's payload limit.

Fencing record (what the buffer reads): the JSON value of key ``fenced`` in the run's policy KV bucket,

    {"<generator_id>": {"last_acked_version": int, "fenced_at": float, "missed_version": int}, ...}

A fenced generator's episodes whose token versions are newer than ``last_acked_version`` were sampled by weights
the trainer never saw it adopt; the buffer drops them (reason ``fenced``) until the generator catches up. It is
unfenced (removed from the record) as soon as it acks a version at least as new as the latest published one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from topics.names import MAX_MEMBER_ID, valid_member_id
from topics.schemas import Membership, VersionAck

FENCED_KEY = "fenced"


@dataclass(slots=True)
class Member:
    generator_id: str
    session: str = ""  # pair-group name of the current join (collective transports)
    joined_at: float = 0.0
    last_seen: float = 0.0
    acked_version: int = -1
    acked_at: float = 0.0
    host: str = ""
    pid: int = 0
    confirmed: bool = False  # the handshake of the current join is done (see the module docstring)
    joined: bool = False  # it sent a join (not only heartbeats) since it became a member
    state: Any = None  # transport state owned by the publisher (pair group, sender thread)


@dataclass(slots=True)
class Fence:
    last_acked_version: int
    fenced_at: float
    missed_version: int

    def to_json(self) -> dict[str, Any]:
        return {"last_acked_version": self.last_acked_version, "fenced_at": self.fenced_at,
                "missed_version": self.missed_version}


@dataclass(slots=True)
class Registry:
    """Members, their acks and the fencing table, driven by membership and ack messages."""

    member_timeout_s: float = 10.0
    members: dict[str, Member] = field(default_factory=dict)
    fenced: dict[str, Fence] = field(default_factory=dict)
    latest_version: int = -1
    # ids dropped for an incomplete handshake: their heartbeats are ignored until they join again (bounded)
    failed_handshakes: dict[str, float] = field(default_factory=dict)
    max_failed: int = 256

    @staticmethod
    def session_of(msg: Membership) -> str:
        """The pair-group name for one join: unique per generator process and join."""
        return f"{msg.generator_id}/{msg.pid}/{msg.created_at:.6f}"

    def on_membership(self, msg: Membership, *, now: float | None = None) -> Member | None:
        """Apply a join, heartbeat or leave; returns the member (None after a leave)."""
        now = time.time() if now is None else now
        if msg.event == "leave":
            self.members.pop(msg.generator_id, None)
            return None
        m = self.members.get(msg.generator_id)
        if m is None:
            if msg.event != "join" and msg.generator_id in self.failed_handshakes:
                return None  # dropped for its handshake: only a new join makes it a member again
            m = self.members[msg.generator_id] = Member(msg.generator_id, joined_at=now)
        if msg.event == "join":
            m.joined = True
            self.failed_handshakes.pop(msg.generator_id, None)
            m.session = self.session_of(msg)
            m.joined_at = now
            m.host, m.pid = msg.host, msg.pid
            m.confirmed = False  # a new join, a new handshake
        m.acked_version = max(m.acked_version, msg.version)
        m.last_seen = now
        return m

    def on_ack(self, ack: VersionAck, *, now: float | None = None) -> bool:
        """Record an ack; returns True when it unfenced the generator."""
        now = time.time() if now is None else now
        m = self.members.get(ack.generator_id)
        if m is not None:
            m.last_seen = now
            if ack.ok:
                m.confirmed = True
            if ack.ok and ack.version > m.acked_version:
                m.acked_version, m.acked_at = ack.version, now
        if ack.ok and ack.generator_id in self.fenced and ack.version >= self.latest_version:
            del self.fenced[ack.generator_id]
            return True
        return False

    def expire(self, *, now: float | None = None) -> list[Member]:
        """Drop members silent for longer than ``member_timeout_s``; returns them."""
        now = time.time() if now is None else now
        gone = [m for m in self.members.values() if now - m.last_seen > self.member_timeout_s]
        for m in gone:
            del self.members[m.generator_id]
        return gone

    def expire_unconfirmed(self, timeout_s: float, *, now: float | None = None) -> list[Member]:
        """Drop members whose handshake did not complete within ``timeout_s`` of their join; returns them."""
        now = time.time() if now is None else now
        gone = [m for m in self.members.values() if not m.confirmed and now - m.joined_at > timeout_s]
        for m in gone:
            del self.members[m.generator_id]
            self.failed_handshakes[m.generator_id] = now
        while len(self.failed_handshakes) > self.max_failed:
            del self.failed_handshakes[next(iter(self.failed_handshakes))]
        return gone

    def expire_fences(self, expiry_s: float, *, now: float | None = None) -> list[str]:
        """Forget fenced generators that are not members and never acked a version, fenced ``expiry_s`` ago."""
        now = time.time() if now is None else now
        gone = [gid for gid, f in self.fenced.items()
                if gid not in self.members and f.last_acked_version < 0 and now - f.fenced_at > expiry_s]
        for gid in gone:
            del self.fenced[gid]
        return gone

    def acked(self, generator_id: str, version: int) -> bool:
        m = self.members.get(generator_id)
        return m is not None and m.acked_version >= version

    def fence(self, generator_id: str, missed_version: int, *, now: float | None = None,
              last_acked: int | None = None) -> Fence:
        now = time.time() if now is None else now
        m = self.members.get(generator_id)
        last = last_acked if last_acked is not None else (m.acked_version if m is not None else -1)
        prior = self.fenced.get(generator_id)
        if prior is not None:  # keep the first missed version; the last ack may have moved
            prior.last_acked_version = max(prior.last_acked_version, last)
            return prior
        f = self.fenced[generator_id] = Fence(last, now, missed_version)
        return f

    def refuse_membership(self, mem: Membership, *, max_members: int) -> str:
        """Why a membership message is refused, or '': an id that is not ``valid_member_id``, or a new member
        beyond ``max_members``."""
        if not valid_member_id(mem.generator_id):
            return (f"generator id {mem.generator_id[:40]!r}... ({len(mem.generator_id)} characters) is not 1 to "
                    f"{MAX_MEMBER_ID} letters, digits and . _ : @ -")
        if mem.event != "leave" and mem.generator_id not in self.members and len(self.members) >= max_members:
            return f"{mem.event} of {mem.generator_id!r}: already weightsync.max_members {max_members} members"
        return ""

    def refuse_ack(self, ack: VersionAck, *, published: int) -> str:
        """Why an ack is refused, or '': a version newer than ``published`` (never published), or not from a
        member."""
        if ack.version > published:
            return (f"ack from {ack.generator_id[:MAX_MEMBER_ID]!r} for version {ack.version}, never published "
                    f"(latest {published})")
        if ack.generator_id not in self.members:
            return f"ack from {ack.generator_id[:MAX_MEMBER_ID]!r}, which is not a member"
        return ""

    def fenced_json(self) -> bytes:
        return orjson.dumps({gid: f.to_json() for gid, f in sorted(self.fenced.items())})

    def load_fenced(self, data: bytes | None) -> None:
        self.fenced = {gid: Fence(int(v["last_acked_version"]), float(v["fenced_at"]), int(v["missed_version"]))
                       for gid, v in (orjson.loads(data) if data else {}).items()}


def parse_fenced(data: bytes | None) -> dict[str, int]:
    """The buffer's view of the fencing record: ``{generator_id: last_acked_version}``."""
    return {gid: int(v["last_acked_version"]) for gid, v in (orjson.loads(data) if data else {}).items()}


def drop_for_fence(fenced: dict[str, int], generator_id: str, max_version: int) -> bool:
    """The buffer's rule: drop (reason ``fenced``) an episode of a fenced generator sampled with any version newer
    than the last one the trainer saw that generator acknowledge."""
    last = fenced.get(generator_id)
    return last is not None and max_version > last
