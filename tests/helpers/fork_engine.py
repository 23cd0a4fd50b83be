"""Run as a process of its own: start an ``Engine`` on a model, generate, swap once; print one JSON line.

``python -m helpers.fork_engine MODEL_DIR METHOD`` with METHOD ``owned`` (this process declares itself a
generator's own, ``producers/vllm_fork.own_process``, and the engine takes ``auto``) or ``spawn``. The line has
how each of the engine's processes started (a spawned one was exec'd with ``MARK``, set after this process
started, in its initial environment; a forked one keeps this process's), their CPU affinity and threads, the
sampled tokens, and whether the swap took one call.
"""

from __future__ import annotations

import asyncio
import os
import sys

import orjson

MARK = "FORK_ENGINE_STARTED"


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as fh:
            for child in fh.read().split():
                out += [int(child), *descendants(int(child))]
    return out


def describe(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        environ = fh.read().split(b"\0")
    with open(f"/proc/{pid}/comm") as fh:
        comm = fh.read().strip()
    return {"comm": comm, "spawned": f"{MARK}=1".encode() in environ, "cores": sorted(os.sched_getaffinity(pid)),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


async def main(model_dir: str, method: str) -> None:
    from producers import vllm_fork
    from producers.engine import Engine, Sampling

    os.environ[MARK] = "1"
    if method == "owned":
        vllm_fork.own_process()
    engine = Engine(model_dir, max_model_len=64, seed=0, start_method="auto" if method == "owned" else "spawn")
    await engine.start()
    try:
        procs = [describe(pid) for pid in descendants(os.getpid())]
        done = await engine.generate([5, 6, 7, 8], 4, Sampling(max_tokens=8, temperature=1.0, seed=3))
        await engine.swap_rpc(1, "check_health")
        print(orjson.dumps({"procs": procs, "tokens": [c.token_ids for c in done], "fused": engine._fused_swap,
                            "version": engine.version}).decode(), flush=True)
    finally:
        await engine.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
