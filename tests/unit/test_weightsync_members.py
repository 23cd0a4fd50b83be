"""Membership, acks and fencing (weightsync/members.py) and the weightsync config."""

from __future__ import annotations

import pytest

from topics.errors import ConfigError
from topics.schemas import Membership, VersionAck
from weightsync import vllm_args
from weightsync.config import WeightSyncConfig
from weightsync.members import Registry, drop_for_fence, parse_fenced


def _m(gid, event, version=-1, pid=1, at=100.0):
    return Membership(generator_id=gid, event=event, version=version, pid=pid, created_at=at)


def test_join_heartbeat_leave_and_expiry():
    reg = Registry(member_timeout_s=10)
    m = reg.on_membership(_m("g1", "join", version=3), now=0.0)
    assert m.session == "g1/1/100.000000" and m.acked_version == 3
    reg.on_membership(_m("g2", "join"), now=0.0)
    reg.on_membership(_m("g1", "heartbeat", version=4), now=8.0)
    assert reg.members["g1"].acked_version == 4
    gone = reg.expire(now=12.0)
    assert [g.generator_id for g in gone] == ["g2"] and set(reg.members) == {"g1"}
    assert reg.on_membership(_m("g1", "leave"), now=13.0) is None
    assert reg.members == {}


def test_a_new_join_gets_a_new_session():
    reg = Registry()
    a = reg.on_membership(_m("g1", "join", pid=1, at=1.0), now=0.0).session
    b = reg.on_membership(_m("g1", "join", pid=2, at=2.0), now=1.0).session
    assert a != b


def test_fencing_keeps_last_acked_version_and_unfences_on_catch_up():
    reg = Registry()
    reg.on_membership(_m("g1", "join"), now=0.0)
    reg.on_ack(VersionAck(generator_id="g1", version=2), now=1.0)
    reg.latest_version = 3
    f = reg.fence("g1", 3, now=5.0)
    assert (f.last_acked_version, f.missed_version) == (2, 3)
    assert parse_fenced(reg.fenced_json()) == {"g1": 2}
    # a failed ack does not unfence, an ack of an older version does not either
    assert not reg.on_ack(VersionAck(generator_id="g1", version=3, ok=False))
    reg.latest_version = 4
    assert not reg.on_ack(VersionAck(generator_id="g1", version=3))
    assert reg.fence("g1", 4).missed_version == 3  # the first missed version stays
    assert reg.on_ack(VersionAck(generator_id="g1", version=4))
    assert reg.fenced == {} and parse_fenced(reg.fenced_json()) == {}
    # the record survives a trainer restart
    reg.fence("g1", 5)
    other = Registry()
    other.load_fenced(reg.fenced_json())
    assert parse_fenced(other.fenced_json()) == {"g1": 4}
    # a member dropped for silence is fenced at the last version it acked before it was dropped
    assert other.fence("g9", 7, last_acked=5).last_acked_version == 5


def test_config_validation_and_vllm_args():
    with pytest.raises(ConfigError, match="weightsync.transport"):
        WeightSyncConfig(transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="weightsync.member_timeout_s"):
        WeightSyncConfig(heartbeat_s=5, member_timeout_s=4)
    assert WeightSyncConfig().resolved_transport(cuda=False) == "gloo"
    assert WeightSyncConfig().resolved_transport(cuda=True) == "nccl"
    assert WeightSyncConfig(transport="file").resolved_transport(cuda=True) == "file"
    with pytest.raises(ConfigError, match="weightsync.push_dtype"):
        WeightSyncConfig(push_dtype="float8")
    # push_dtype "auto": the engines' dtype over a pair group, the trainer's own over files (the evaluator reads them)
    assert WeightSyncConfig().for_engine("bfloat16", cuda=False).push_dtype == "bfloat16"
    assert WeightSyncConfig(transport="nccl").for_engine("float32").push_dtype == "float32"
    assert WeightSyncConfig(transport="file").for_engine("bfloat16").push_dtype == "keep"
    assert WeightSyncConfig(push_dtype="keep").for_engine("bfloat16", cuda=False).push_dtype == "keep"
    args = vllm_args(WeightSyncConfig(transport="gloo"))
    assert args["weight_transfer_config"] == {"backend": "gloo"}
    assert args["worker_extension_cls"] == "weightsync.worker.WeightSyncWorkerExtension"
    assert "weight_transfer_config" not in vllm_args(WeightSyncConfig(transport="file"))


def test_buffer_drop_rule_for_fenced_generators():
    fenced = {"g1": 4}
    assert drop_for_fence(fenced, "g1", 5)  # sampled with a version it never acknowledged
    assert not drop_for_fence(fenced, "g1", 4)
    assert not drop_for_fence(fenced, "g2", 9)  # not fenced


def test_a_join_without_a_handshake_is_dropped_and_an_ack_confirms():
    reg = Registry(member_timeout_s=100)
    reg.on_membership(_m("real", "join"), now=0.0)
    reg.on_membership(_m("fake", "join"), now=0.0)
    reg.on_ack(VersionAck(generator_id="real", version=0), now=1.0)  # an ok ack proves a working transfer
    assert reg.members["real"].confirmed and not reg.members["fake"].confirmed
    assert reg.expire_unconfirmed(5.0, now=3.0) == []  # still within the handshake timeout
    gone = reg.expire_unconfirmed(5.0, now=6.0)
    assert [m.generator_id for m in gone] == ["fake"] and set(reg.members) == {"real"}
    assert reg.on_membership(_m("fake", "heartbeat"), now=6.5) is None  # its heartbeats do not bring it back
    assert set(reg.members) == {"real"}
    reg.on_membership(_m("fake", "join"), now=6.6)  # a new join does, with a new handshake window
    assert "fake" in reg.members and not reg.members["fake"].confirmed
    for i in range(reg.max_failed + 10):  # the memory of failed handshakes is bounded
        reg.on_membership(_m(f"f{i}", "join"), now=10.0)
    reg.expire_unconfirmed(5.0, now=20.0)
    assert len(reg.failed_handshakes) == reg.max_failed
    reg.on_membership(_m("real", "join", pid=2), now=7.0)  # a new join needs a new handshake
    assert not reg.members["real"].confirmed


def test_fences_of_gone_generators_that_never_acked_expire():
    reg = Registry()
    reg.on_membership(_m("kept", "join"), now=0.0)
    reg.fence("kept", 3, now=0.0)  # still a member
    reg.fence("acked-once", 3, now=0.0, last_acked=2)  # gone, but it did ack: its old episodes stay fenced
    reg.fence("never", 3, now=0.0, last_acked=-1)
    assert reg.expire_fences(60.0, now=30.0) == []
    assert reg.expire_fences(60.0, now=61.0) == ["never"]
    assert set(reg.fenced) == {"kept", "acked-once"}


def test_member_ids_are_bounded():
    from topics.names import MAX_MEMBER_ID, valid_member_id

    assert valid_member_id("generator-0") and valid_member_id("host-1:42@pod.ns") and valid_member_id("a" * 128)
    assert MAX_MEMBER_ID == 128 and not valid_member_id("a" * 129)
    for bad in ("", "-lead", "has space", "semi;colon", "x" * 30_000, "ünïcode"):
        assert not valid_member_id(bad), bad
    with pytest.raises(ConfigError, match="generator.generator_id"):
        from producers.config import GeneratorConfig

        GeneratorConfig(generator_id="x" * 200)


def test_the_trainer_role_pushes_in_the_generators_dtype():
    """``streamforge/roles.py`` resolves ``weightsync.push_dtype: auto`` with the run's ``generator.dtype``."""
    from streamforge.config import load_config
    from streamforge.roles import build_role

    cfg = load_config(None, ["--generator.dtype=bfloat16", "--weightsync.transport=gloo"], environ={})
    assert build_role("trainer", cfg).weightsync.push_dtype == "bfloat16"
    cfg = load_config(None, ["--generator.dtype=bfloat16", "--weightsync.transport=file"], environ={})
    assert build_role("trainer", cfg).weightsync.push_dtype == "keep"
    assert cfg.weightsync.push_dtype == "auto"  # the run config itself is left as loaded
