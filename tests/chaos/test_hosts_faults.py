"""Faults between hosts: one demo run spread over three network namespaces (``tests/helpers/netns.py``,
``tests/helpers/hostrun.py``): brokers, feeder and buffer on ``brokers``, the trainer on ``trainer``, the vLLM
generator on ``generator``. The tests share the run (one vLLM start-up for all, which costs more than the
faults) and run in this order, each on the run as the previous one left it:

1. the generator host's cable is pulled for 15 s mid-run, then plugged back: the generator waits and resumes;
2. the trainer host loses NATS (a blackhole route to its address) while it publishes a version: the version's
   write to the KV store is retried until NATS is back, its round completes, the generator catches up;
3. the trainer host is killed whole (SIGKILL to every process in its namespace); the restarted trainer resumes from
   its checkpoint;
4. a ``tbf`` limit on the trainer host's egress: weight pushes slow down, no round waits past the ack deadline, and
   the run has learnt (reward up from its start);
5. every role drains on SIGTERM and the audit of the stopped run reconciles.

After each: the audit finds nothing lost and nothing trained twice (of the live run: its ``reconciles`` needs the
stopped run of test 5), and every wait is bounded (``HostRun.wait_for``).
Skipped where network namespaces cannot be made (not root).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time

import pytest

from tests.helpers.hostrun import HOSTS, HostRun
from tests.helpers.netns import Hosts, can_create

pytestmark = pytest.mark.vllm

ROLES = ("feeder", "buffer", "trainer", "generator")
ACK_DEADLINE_S = 30.0  # weightsync.ack_deadline_s (the default)
RATE = "4mbit"  # the trainer host's egress in test 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    why = can_create()
    if why:
        pytest.skip(why)
    hosts = Hosts(HOSTS).create()
    hr = HostRun(hosts, tmp_path_factory.mktemp("hosts") / "run")
    try:
        t0 = time.monotonic()
        hr.start_brokers()
        hr.build_model()
        hr.create_topics()
        hr.start_roles()
        hr.wait_for("the first trainer steps", lambda: hr.step() >= 3 and hr.generator_version() >= 1, 300,
                    alive=ROLES)
        print(f"hosts up and training in {time.monotonic() - t0:.0f} s")
        yield hr
    finally:
        hr.stop()
        hosts.close()


def assert_audit_clean(hr: HostRun) -> dict:
    """The audit of the live run: nothing lost, nothing trained twice. (Its ``reconciles`` needs a stopped run: the
    batches it reads after the episodes may hold episodes produced in between.)"""
    audit = hr.audit()
    assert audit["lost"] == 0 and audit["trained_twice"] == 0 and audit["in_two_batches"] == 0, audit
    assert audit["produced"] > 0 and audit["trained"] > 0, audit
    return audit


def assert_ledger_once(hr: HostRun) -> None:
    ledger = hr.ledger()
    steps = [row["step"] for row in ledger]
    assert steps == list(range(1, len(steps) + 1)), steps[-20:]
    batches = [b for row in ledger for b in row["batch_ids"]]
    assert len(batches) == len(set(batches))


@pytest.mark.timeout(240)
def test_generator_host_cut_off_for_15_s_waits_and_resumes(run: HostRun) -> None:
    run.hosts.cut("generator")
    cut_at = time.monotonic()
    try:
        time.sleep(15)
        assert run.procs["generator"].poll() is None, run.log_tail("generator")
    finally:
        run.hosts.mend("generator")
    print(f"generator host cut off for {time.monotonic() - cut_at:.1f} s")
    episodes, version, step = run.generator_episodes(), run.version(), run.step()
    run.wait_for("new episodes from the generator", lambda: run.generator_episodes() > episodes, 90, alive=ROLES)
    run.wait_for("training goes on", lambda: run.step() >= step + 3, 90, alive=ROLES)
    run.wait_for("the generator takes a version published after the cut",
                 lambda: run.generator_version() > version, 90, alive=ROLES)
    assert_ledger_once(run)
    assert_audit_clean(run)


@pytest.mark.timeout(240)
def test_trainer_host_loses_nats_during_publication(run: HostRun) -> None:
    """NATS unreachable from the trainer host (a blackhole route to its address) until a version's publication has
    met the outage: its write to the KV store timed out (``nats.request_timeout_s``, 5 s) and is being retried
    (``weightsync/policy_kv.py``); 3 s more, then NATS is back. That round must complete, the generator catch up."""
    retrying = re.compile(r"version (\d+): the policy store is unreachable")
    before = len(retrying.findall(run.log_text("trainer")))
    run.hosts.blackhole("trainer", run.nats_ip)
    try:
        run.wait_for("a publication meets the outage and is retried",
                     lambda: len(retrying.findall(run.log_text("trainer"))) > before, 60, alive=ROLES)
        during = int(retrying.findall(run.log_text("trainer"))[before])
        time.sleep(3)
        assert during not in {v["version"] for v in run.versions()}  # its round has not completed
    finally:
        run.hosts.unblackhole("trainer", run.nats_ip)
    run.wait_for(f"the round of version {during} completes",
                 lambda: during in {v["version"] for v in run.versions()}, 60, alive=ROLES)
    retries = len(retrying.findall(run.log_text("trainer"))) - before
    print(f"version {during}: its KV write was retried {retries} times during the outage, then its round completed")
    run.wait_for("the generator catches up with a version published after the outage",
                 lambda: run.generator_version() > during, 120, alive=ROLES)
    assert_ledger_once(run)
    assert_audit_clean(run)


@pytest.mark.timeout(240)
def test_trainer_host_killed_whole_restarts_from_checkpoint(run: HostRun) -> None:
    step = run.step()
    killed = run.hosts.kill("trainer")
    assert killed and run.hosts.pids("trainer") == []
    assert run.procs["trainer"].wait(10) == -9
    run.start("trainer", "trainer", "trainer")
    run.wait_for("the restarted trainer trains past the kill", lambda: run.step() >= step + 3, 120, alive=ROLES)
    assert "resum" in run.log_text("trainer").lower()
    version = run.version()
    run.wait_for("the generator takes the restarted trainer's versions",
                 lambda: run.generator_version() >= version, 120, alive=ROLES)
    assert_ledger_once(run)
    assert_audit_clean(run)


def _acked_since(hr: HostRun, t: float) -> list[dict]:
    """The rounds published after ``t`` (epoch s) that generator-0 acked, from the trainer's provenance."""
    return [v for v in hr.versions() if v["published_at"] > t and v["acks"].get("generator-0", {}).get("ok")]


@pytest.mark.timeout(240)
def test_bandwidth_limit_slows_pushes_within_the_ack_deadline(run: HostRun) -> None:
    t0 = time.time()
    run.wait_for("rounds without a limit", lambda: len(_acked_since(run, t0)) >= 6, 60, alive=ROLES)
    free = _acked_since(run, t0)
    late = run.log_text("trainer").count("no ack within")
    run.hosts.limit("trainer", RATE)
    t1 = time.time()
    try:
        run.wait_for(f"rounds at {RATE}", lambda: len(_acked_since(run, t1)) >= 5, 150, alive=ROLES)
    finally:
        run.hosts.unlimit("trainer")
    limited = _acked_since(run, t1)
    med = {}
    for key, pick in (("transfer_ms", lambda v: v["acks"]["generator-0"]["transfer_ms"] / 1000),
                      ("round_s", lambda v: v["round_s"])):
        med[key] = (statistics.median(map(pick, free)), statistics.median(map(pick, limited)))
    slowdown = med["transfer_ms"][1] / med["transfer_ms"][0]
    print(f"weight push ({limited[0]['bytes'] / 1e6:.2f} MB) transfer median {med['transfer_ms'][0]:.3f} s free, "
          f"{med['transfer_ms'][1]:.3f} s at {RATE} ({slowdown:.1f}x); round (push to ack) median "
          f"{med['round_s'][0]:.3f} s free, {med['round_s'][1]:.3f} s limited, max "
          f"{max(v['round_s'] for v in limited):.2f} s; {len(free)} and {len(limited)} rounds")
    assert slowdown > 2, (free, limited)
    assert max(v["round_s"] for v in limited) < ACK_DEADLINE_S
    assert run.log_text("trainer").count("no ack within") == late  # no generator fenced for a late ack
    steps = run.steps()
    first = statistics.mean(r["reward_mean"] for r in steps[:10])  # the run has learnt through the faults
    last = statistics.mean(r["reward_mean"] for r in steps[-20:])
    assert last > first, (first, last)
    assert_ledger_once(run)
    assert_audit_clean(run)



@pytest.mark.timeout(180)
def test_the_run_stops_cleanly_and_reconciles(run: HostRun) -> None:
    """After the four faults: every role drains on SIGTERM (generator and feeder first, so nothing new is made),
    and the audit of the stopped run reconciles: every episode produced was batched, dropped for a reason, or is
    pending in the log for a restarted buffer."""
    for group in (("generator", "feeder"), ("buffer", "trainer")):
        for name in group:
            os.killpg(run.procs[name].pid, signal.SIGTERM)
        for name in group:
            assert run.procs[name].wait(60) == 0, run.log_tail(name)
    audit = assert_audit_clean(run)
    assert audit["reconciles"] and audit["unknown_decided"] == 0 and audit["trained_unknown_batches"] == 0, audit
    print(f"audit: {audit['produced']} produced, {audit['trained']} trained, {audit['dropped']} dropped, "
          f"{audit['pending']} pending")
