"""The parts of the vLLM-NCCL pair (weightsync/pynccl.py) that need no GPU: rendezvous over a real TCPStore,
bounded waits, abort on timeout, and the dispatch from the pair-group layer. The communicator itself is a plain
fake here; the real one runs in the two-GPU test of tests/integration/test_weightsync_collective.py."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from topics.errors import TimeoutExpired
from weightsync import collective
from weightsync.collective import Rendezvous, TransferFailed, _bcast, generator_pair, nccl_usable, trainer_pair
from weightsync.config import WeightSyncConfig
from weightsync.pynccl import UID_BYTES, UID_KEY, PyNcclPair, mint_unique_id, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_wait_until_returns_true_once_done_and_backs_off_to_5_ms():
    clock = FakeClock()
    polls = iter([False] * 12 + [True])
    assert wait_until(lambda: next(polls), timeout_s=10, clock=clock, sleep=clock.sleep)
    assert clock.sleeps[0] == pytest.approx(0.0002)
    assert max(clock.sleeps) == pytest.approx(0.005)
    assert clock.sleeps == sorted(clock.sleeps)


def test_wait_until_gives_up_at_the_timeout():
    clock = FakeClock()
    assert not wait_until(lambda: False, timeout_s=0.5, clock=clock, sleep=clock.sleep)
    assert 0.5 <= clock.now < 0.51


class FakeComm:
    def __init__(self, uid: bytes, rank: int, device) -> None:
        self.uid, self.rank, self.device = uid, rank, device
        self.destroyed = 0

    def destroy(self) -> None:
        self.destroyed += 1


def _stores(timeout_s: float = 5.0):
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
    client = TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                      use_libuv=True)
    return master, PrefixStore("pair/s1", master), PrefixStore("pair/s1", client)


def test_rendezvous_hands_rank_0s_unique_id_to_rank_1_through_the_store():
    master, store0, store1 = _stores()
    uid = bytes(range(UID_BYTES))
    got: dict[int, PyNcclPair] = {}
    t = threading.Thread(target=lambda: got.__setitem__(1, PyNcclPair.connect(
        store1, 1, timeout_s=5, device=torch.device("cpu"), build=FakeComm)))
    t.start()  # rank 1 waits in store.get until rank 0 has set the id
    time.sleep(0.2)
    got[0] = PyNcclPair.connect(store0, 0, timeout_s=5, device=torch.device("cpu"), mint=lambda: uid, build=FakeComm)
    t.join(10)
    assert got[0].comm.uid == got[1].comm.uid == uid
    assert (got[0].comm.rank, got[1].comm.rank) == (0, 1)
    assert bytes(store1.get(UID_KEY)) == uid
    del master


def test_rendezvous_without_rank_0_fails_within_the_store_timeout():
    master, _, store1 = _stores(timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="nccl rendezvous"):
        PyNcclPair.connect(store1, 1, timeout_s=1.0, device=torch.device("cpu"), build=FakeComm, peer="t")
    assert time.monotonic() - t0 < 5
    del master


def test_a_peer_that_never_joins_the_communicator_is_a_bounded_failure():
    master, store0, _ = _stores()
    never = threading.Event()

    def build(uid, rank, device):  # ncclCommInitRank waiting for a rank 1 that never comes
        never.wait(30)

    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="not up after 0.3 s"):
        PyNcclPair.connect(store0, 0, timeout_s=0.3, device=torch.device("cpu"), mint=lambda: b"x" * UID_BYTES,
                           build=build)
    assert time.monotonic() - t0 < 3
    never.set()
    del master


def test_communicator_errors_and_bad_ids_are_transfer_failures():
    master, store0, _ = _stores()

    def build(uid, rank, device):
        raise RuntimeError("NCCL error: unhandled system error")

    with pytest.raises(TransferFailed, match="unhandled system error"):
        PyNcclPair.connect(store0, 0, timeout_s=2, device=torch.device("cpu"), mint=lambda: b"x" * UID_BYTES,
                           build=build)
    with pytest.raises(TransferFailed, match="has 3 bytes"):
        PyNcclPair.connect(store0, 0, timeout_s=2, device=torch.device("cpu"), mint=lambda: b"abc", build=FakeComm)
    del master


class ScriptedPair(PyNcclPair):
    """A pair whose broadcasts finish (or never do, or fail) as the test says, with no CUDA stream."""

    def __init__(self, outcome: str, timeout_s: float = 0.2) -> None:
        super().__init__(FakeComm(b"", 0, None), 0, timeout_s=timeout_s, device=torch.device("cpu"), peer="g1")
        self.outcome = outcome
        self.sent: list[torch.Tensor] = []

    def _enqueue(self, tensor):
        if self.outcome == "error":
            raise RuntimeError("NCCL error: remote process exited")
        self.sent.append(tensor)
        return (lambda: True) if self.outcome == "ok" else (lambda: False)


def test_a_broadcast_that_never_finishes_times_out_and_aborts_the_pair_once():
    pair = ScriptedPair("hang", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutExpired, match="g1 timed out after 0.2 s"):
        pair.broadcast(torch.zeros(4))
    assert time.monotonic() - t0 < 2
    assert pair.aborted and pair.comm.destroyed == 1
    with pytest.raises(TransferFailed, match="aborted"):
        pair.broadcast(torch.zeros(4))
    pair.abort()
    assert pair.comm.destroyed == 1


def test_a_failing_broadcast_aborts_the_pair():
    pair = ScriptedPair("error")
    with pytest.raises(TransferFailed, match="remote process exited"):
        pair.broadcast(torch.zeros(4))
    assert pair.aborted and pair.comm.destroyed == 1


def test_the_pair_layer_sends_every_message_of_a_push_through_the_nccl_pair():
    pair = ScriptedPair("ok")
    t = torch.arange(5)
    _bcast(pair, t, "g1")
    assert pair.sent == [t]
    from weightsync.wire import pack

    snap = pack([("w", torch.ones(3, 4)), ("b", torch.zeros(7))], version=1, step=1, bucket_bytes=1 << 20)
    collective.send_push(pair, snap, peer="g1")
    assert len(pair.sent) == 1 + 1 + len([b for b in snap.buffers if b.numel()])  # preamble, then each bucket


@pytest.mark.skipif(nccl_usable(), reason="checks the refusal on a host without CUDA")
def test_without_cuda_both_nccl_backends_fail_with_a_clear_error():
    rdzv = Rendezvous(timeout_s=2)
    for backend in ("nccl", "torch-nccl"):
        with pytest.raises(TransferFailed, match=f"the {backend} backend needs a CUDA device"):
            trainer_pair(rdzv, f"s-{backend}", timeout_s=2, backend=backend)
        with pytest.raises(TransferFailed, match="needs a CUDA device"):
            generator_pair(rdzv.address, f"s-{backend}", timeout_s=2, backend=backend)
    with pytest.raises(TransferFailed, match="cannot load NCCL through vLLM"):
        mint_unique_id()


def test_transport_names():
    assert WeightSyncConfig(transport="torch-nccl").resolved_transport() == "torch-nccl"
    assert WeightSyncConfig().resolved_transport(cuda=True) == "nccl"
    assert collective.BACKENDS == ("gloo", "nccl", "torch-nccl")


def test_release_aborts_an_nccl_pair_and_leaves_other_groups_alone():
    from concurrent.futures import Future

    pair = ScriptedPair("ok")
    done: Future = Future()
    done.set_result(pair)
    collective.release(done)
    assert wait_until(lambda: pair.comm.destroyed == 1, timeout_s=5)  # aborted on a thread of its own
    assert pair.aborted
    pending, failed, gloo = Future(), Future(), Future()
    failed.set_exception(TransferFailed("g1", "rendezvous"))
    gloo.set_result(object())
    for fut in (None, pending, failed, gloo):
        collective.release(fut)  # nothing to abort, nothing raised
    assert not pending.done()
