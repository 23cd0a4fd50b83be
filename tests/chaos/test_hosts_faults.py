"""Faults between hosts: one demo run spread over three network namespaces (``tests/helpers/netns.py``,
``tests/helpers/hostrun.py``): brokers, feeder and buffer on ``brokers``, the trainer on ``trainer``, the vLLM
generator on ``generator``. The four tests share the run (one vLLM start-up for all, which costs more than the
faults) and run in this order, each on the run as the previous one left it:

1. the generator host's cable is pulled for 15 s mid-run, then plugged back: the generator waits and resumes;
2. the trainer host loses NATS (a blackhole route to its address) while it publishes versions: the publications
   complete or are retried, the generator catches up;
3. the trainer host is killed whole (SIGKILL to every process in its namespace); the restarted trainer resumes from
   its checkpoint;
4. a ``tbf`` limit on the trainer host's egress: weight pushes slow down, no round waits past the ack deadline, and
   the run has learnt (reward up from its start).

After each: the audit finds nothing lost and nothing trained twice, and every wait is bounded (``HostRun.wait_for``).
Skipped where network namespaces cannot be made (not root).
"""

from __future__ import annotations

import statistics
import time

import pytest

from streamforge.plots import read_metrics
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
    version = run.version()
    run.hosts.blackhole("trainer", run.nats_ip)
    try:
        step = run.step()
        run.wait_for("the trainer trains on (and publishes) while NATS is unreachable",
                     lambda: run.step() >= step + 2, 60, alive=ROLES)
        time.sleep(3)
    finally:
        run.hosts.unblackhole("trainer", run.nats_ip)
    behind = run.version()
    assert behind > version
    run.wait_for("the generator catches up with a version published after the outage",
                 lambda: run.generator_version() > behind, 120, alive=ROLES)
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


def _rows(hr: HostRun) -> list[dict]:
    return read_metrics(hr.run_dir / "metrics-trainer.jsonl")


def _values(rows: list[dict], key: str) -> list[float]:
    """``weightsync/round_s``: from a push's start until the generator acked it; ``weightsync/push_s``: the sending
    alone, which ends once the kernel has taken the bytes (a slow link shows in the round)."""
    return [r[key] for r in rows if key in r]


@pytest.mark.timeout(240)
def test_bandwidth_limit_slows_pushes_within_the_ack_deadline(run: HostRun) -> None:
    def rounds_since(mark: int) -> int:
        return len(_values(_rows(run)[mark:], "weightsync/round_s"))

    before = len(_rows(run))
    run.wait_for("rounds without a limit", lambda: rounds_since(before) >= 5, 60, alive=ROLES)
    run.hosts.limit("trainer", RATE)
    try:
        mark = len(_rows(run))
        run.wait_for(f"rounds at {RATE}", lambda: rounds_since(mark) >= 6, 150, alive=ROLES)
    finally:
        run.hosts.unlimit("trainer")
    rows = _rows(run)
    free = {k: _values(rows[before:mark], f"weightsync/{k}") for k in ("round_s", "push_s")}
    limited = {k: _values(rows[mark:], f"weightsync/{k}")[1:] for k in ("round_s", "push_s")}  # the first may
    # have started before the limit
    med = {k: (statistics.median(free[k]), statistics.median(limited[k])) for k in free}
    slowdown = med["round_s"][1] / med["round_s"][0]
    print(f"weight-sync round (push until ack) median {med['round_s'][0]:.3f} s free, {med['round_s'][1]:.3f} s at "
          f"{RATE} ({slowdown:.1f}x), max {max(limited['round_s']):.2f} s; push_s median {med['push_s'][0]:.3f} s "
          f"free, {med['push_s'][1]:.3f} s at {RATE}")
    assert slowdown > 2, (free, limited)
    assert max(limited["round_s"]) < ACK_DEADLINE_S
    assert "no ack within" not in run.log_text("trainer")
    steps = run.steps()
    first = statistics.mean(r["reward_mean"] for r in steps[:5])
    last = statistics.mean(r["reward_mean"] for r in steps[-5:])
    assert last > first, (first, last)
    assert_ledger_once(run)
    assert_audit_clean(run)

