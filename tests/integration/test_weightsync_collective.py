"""Pair groups over real torch.distributed between two processes: exact pushes and bounded failures.

The gloo tests run everywhere. The NCCL tests (GPU to GPU pushes, a peer killed mid-push) need two CUDA devices,
since NCCL refuses two ranks on one GPU; they are skipped otherwise and have not run in CI yet.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from topics.errors import TimeoutExpired
from weightsync.collective import (
    NCCL_BACKENDS,
    Rendezvous,
    TransferFailed,
    generator_pair,
    nccl_usable,
    recv_push,
    send_push,
    trainer_pair,
)
from weightsync.wire import pack, unshared

pytestmark = pytest.mark.timeout(120)


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(64, 128, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(352, 128, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(128, generator=g))]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _generator(address: str, session: str, mode: str, out: mp.Queue) -> None:
    try:
        group = generator_pair(address, session, timeout_s=60)
        if mode == "die":
            out.put("connected")
            time.sleep(60)  # killed by the parent while the trainer sends
        spare: list[torch.Tensor] = []
        for _ in range(2):
            snap = recv_push(group, reuse=spare)  # the second push lands in the first one's buffers
            reused = [a is b for a, b in zip(snap.buffers, spare)]
            out.put((snap.version, [(n, str(t.dtype), tuple(t.shape), _raw(t)) for n, t in snap.tensors()], reused))
            spare = unshared(snap.buffers)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(f"error: {type(exc).__name__}: {exc}")


def _spawn(address: str, session: str, mode: str):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_generator, args=(address, session, mode, out), daemon=True)
    proc.start()
    return proc, out


def test_pushes_arrive_bit_exact_in_order():
    rdzv = Rendezvous(timeout_s=60)
    proc, out = _spawn(rdzv.address, "g1/1", "ok")
    try:
        group = trainer_pair(rdzv, "g1/1", timeout_s=60)
        for v in (1, 2):
            send_push(group, pack(_named(v), version=v, step=v, bucket_bytes=40_000))
        for v in (1, 2):
            version, tensors, reused = out.get(timeout=30)
            assert version == v
            assert reused == ([] if v == 1 else [True, True, True])  # three buckets of 40 kB, all reused
            for (n, a), (m, dtype, shape, raw) in zip(_named(v), tensors, strict=True):
                assert (n, str(a.dtype), tuple(a.shape)) == (m, dtype, shape)
                assert _raw(a) == raw
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_a_peer_killed_mid_push_fails_the_send_fast():
    rdzv = Rendezvous(timeout_s=60)
    proc, out = _spawn(rdzv.address, "g2/1", "die")
    try:
        group = trainer_pair(rdzv, "g2/1", timeout_s=60)  # generous: the child imports torch on a busy machine
        assert out.get(timeout=30) == "connected"
        big = [("w", torch.zeros(64 * 1024 * 1024 // 4))]  # 64 MiB: larger than the socket buffers
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((TransferFailed, TimeoutExpired)):
            send_push(group, pack(big, version=1, step=1, bucket_bytes=8 << 20))
        assert time.monotonic() - t0 < 5  # a closed peer fails the send at once (the group timeout bounds the rest)
    finally:
        proc.join(10)


def test_a_generator_that_never_comes_is_a_bounded_rendezvous_failure():
    rdzv = Rendezvous(timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed):
        trainer_pair(rdzv, "nobody/1", timeout_s=2)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TransferFailed):
        generator_pair(f"127.0.0.1:{_free_port()}", "x/1", timeout_s=2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


two_gpus = pytest.mark.skipif(not (nccl_usable() and torch.cuda.device_count() >= 2),
                              reason="NCCL pair groups need two CUDA devices (NCCL refuses two ranks on one GPU)")


def _nccl_generator(address: str, session: str, mode: str, backend: str, out: mp.Queue) -> None:
    try:
        torch.cuda.set_device(1)
        group = generator_pair(address, session, timeout_s=60, backend=backend)
        if mode == "die":
            recv_push(group, device="cuda:1")  # the communicator is up once a first push went through
            out.put("connected")
            time.sleep(60)  # killed by the parent while the trainer sends
        for _ in range(2):
            snap = recv_push(group, device="cuda:1")
            out.put((snap.version, sorted({str(b.device) for b in snap.buffers}),
                     [(n, str(t.dtype), tuple(t.shape), _raw(t.cpu())) for n, t in snap.tensors()]))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(f"error: {type(exc).__name__}: {exc}")


def _spawn_nccl(address: str, session: str, mode: str, backend: str):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_nccl_generator, args=(address, session, mode, backend, out), daemon=True)
    proc.start()
    return proc, out


# "nccl" is vLLM's PyNcclCommunicator (weightsync/pynccl.py), "torch-nccl" torch's ProcessGroupNCCL
nccl_backends = pytest.mark.parametrize("backend", NCCL_BACKENDS)


@pytest.mark.gpu
@two_gpus
@nccl_backends
def test_nccl_pushes_go_from_gpu_to_gpu_bit_exact(backend):
    torch.cuda.set_device(0)
    rdzv = Rendezvous(timeout_s=60)
    proc, out = _spawn_nccl(rdzv.address, "n1/1", "ok", backend)
    try:
        group = trainer_pair(rdzv, "n1/1", timeout_s=60, backend=backend)
        for v in (1, 2):
            snap = pack([(n, t.cuda(0)) for n, t in _named(v)], version=v, step=v, bucket_bytes=40_000,
                        device="cuda:0")
            assert all(b.device == torch.device("cuda", 0) for b in snap.buffers)
            send_push(group, snap)
        for v in (1, 2):
            got = out.get(timeout=60)
            assert not isinstance(got, str), got
            version, devices, tensors = got
            assert version == v and devices == ["cuda:1"]  # received straight into the generator's GPU
            for (n, a), (m, dtype, shape, raw) in zip(_named(v), tensors, strict=True):
                assert (n, str(a.dtype), tuple(a.shape)) == (m, dtype, shape)
                assert _raw(a) == raw
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.gpu
@two_gpus
@nccl_backends
def test_nccl_peer_killed_mid_push_is_bounded_by_the_timeout(backend):
    torch.cuda.set_device(0)
    rdzv = Rendezvous(timeout_s=60)
    proc, out = _spawn_nccl(rdzv.address, "n2/1", "die", backend)
    try:
        group = trainer_pair(rdzv, "n2/1", timeout_s=10, backend=backend)
        send_push(group, pack(_named(0), version=0, step=0, bucket_bytes=40_000, device="cuda:0"))
        assert out.get(timeout=60) == "connected"
        os.kill(proc.pid, signal.SIGKILL)
        big = [("w", torch.zeros(64 * 1024 * 1024 // 4, device="cuda:0"))]
        t0 = time.monotonic()
        with pytest.raises((TransferFailed, TimeoutExpired)):
            for v in range(1, 4):
                send_push(group, pack(big, version=v, step=v, bucket_bytes=8 << 20, device="cuda:0"))
        assert time.monotonic() - t0 < 30  # the group timeout (10 s) bounds it; this process lives on
    finally:
        proc.join(10)
