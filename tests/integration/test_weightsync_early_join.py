"""A generator that starts after its trainer joins the trainer's pair group before the first version exists.

Real vLLM engine, real NATS, real gloo pair. The publisher is up first and has published nothing; the receiver's
loop joins it at once (``WeightReceiver._warm_join``): the pair group comes up and the worker builds its staging
copy while nothing is pushed. The first version then goes down the pair that is already there (no second join), is
staged and committed, and the engine scores like the trainer's model. Before it, the staging copy rehearsed two
stages of the model's own checkpoint (``weightsync.staged_rehearsals``) without touching the live model. A trainer
that has already published answers a later joiner with its version, which that joiner loads at once.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from topics.nats import connect
from weightsync import vllm_args
from weightsync.config import WeightSyncConfig
from weightsync.publisher import WeightPublisher
from weightsync.receiver import WeightReceiver

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPT = [1, 14, 15, 4, 6, 45, 50]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def _until(pred, timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await pred():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


def _dump_tasks() -> None:
    """What every task of the loop waits on, and the loop's default executor (printed into the test's output)."""
    loop = asyncio.get_running_loop()
    for task in asyncio.all_tasks(loop):
        print(f"--- task {task.get_name()}: {task.get_coro()}")
        task.print_stack()
    pool = getattr(loop, "_default_executor", None)
    if pool is not None:
        print(f"default executor: {len(pool._threads)} threads, {pool._work_queue.qsize()} queued")


async def _ends_on_cancel(task: asyncio.Task, timeout: float) -> bool:
    """Cancel ``task`` and wait for it to end, at most ``timeout`` s; past that print every task's stack."""
    task.cancel()
    if (await asyncio.wait([task], timeout=timeout))[0]:
        return True
    _dump_tasks()
    return False


async def _prompt_logprobs(engine, tag: str) -> torch.Tensor:
    from vllm import SamplingParams

    out = None
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    async for out in engine.llm.generate({"prompt_token_ids": PROMPT}, params, f"lp-{tag}"):
        pass
    return torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])


def _trainer_logprobs(model) -> torch.Tensor:
    from consumers.model import token_logprobs

    with torch.no_grad():
        lp, _ = token_logprobs(model, torch.tensor([PROMPT]))
    return lp[0, 1:]


async def test_the_pair_and_the_staging_copy_are_ready_before_the_first_version(run_config, tiny_dir):
    from consumers.model import hf_named_tensors, load_policy
    from producers.engine import Engine

    gloo = WeightSyncConfig(transport="gloo", timeout_s=20, ack_deadline_s=30, staged_rehearsals=2)
    policy, v0 = load_policy(tiny_dir), load_policy(tiny_dir)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine = Engine(str(tiny_dir), max_model_len=256, extra_args=vllm_args(gloo))
    follow = pub = nc_t = nc_g = None
    try:
        # a hang fails here, naming the line it waited on and what every task waited on, instead of running into
        # pytest's timeout, which leaves the engine's processes behind for the next test
        async with asyncio.timeout(200):
            nc_t = await connect(run_config.nats, name="trainer")
            nc_g = await connect(run_config.nats, name="generator")
            pub = WeightPublisher(gloo, nc=nc_t, names=run_config.names, run_dir=run_config.run_dir)
            await pub.start()
            assert pub.latest_version == -1  # nothing published: only a join can open the pair now
            await engine.start()
            receiver = WeightReceiver(gloo, engine=engine, nc=nc_g, names=run_config.names, generator_id="g0")
            await receiver.start()
            follow = asyncio.create_task(receiver.loop())

            before = await _prompt_logprobs(engine, "v0")
            assert (before - _trainer_logprobs(v0.model)).abs().max().item() < 1e-4

            async def ready() -> bool:
                stats = (await engine.llm.collective_rpc("weightsync_stats"))[0]
                return stats["connected"] == 1.0 and stats["shadow"] == 1.0 and stats["rehearsed"] == 2.0

            await _until(ready, 30, "the pair group up, the staging copy built, two stages rehearsed")
            # the rehearsals staged the checkpoint into the copy only: the live model is untouched
            assert torch.equal(await _prompt_logprobs(engine, "rehearsed"), before)
            assert pub.members()["g0"]["confirmed"]  # the trainer's side of the pair is up too
            assert receiver.counters["joins"] == 1 and engine.version == 0

            await pub.publish(version=1, step=1, named_tensors=lambda: hf_named_tensors(policy), batch_ids=["b1"])

            async def loaded() -> bool:
                return engine.version == 1

            await _until(loaded, 30, "version 1 loaded")
            assert pub.members()["g0"]["acked_version"] == 1
            assert receiver.counters["joins"] == 1  # the first push went down the pair opened before it
            assert receiver.counters["load_failures"] == 0 and receiver.counters["join_timeouts"] == 0
            stats = (await engine.llm.collective_rpc("weightsync_stats"))[0]
            assert stats["version"] == 1 and stats["stage_s"] > 0 and stats["load_s"] == 0  # staged, committed
            assert (await _prompt_logprobs(engine, "v1") - _trainer_logprobs(policy.model)).abs().max().item() < 1e-4

            # a generator that (re)starts beside a trainer that has published is answered with that version
            await receiver.stop()
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            await engine.relabel(0)  # as a fresh engine would report itself
            late = WeightReceiver(gloo, engine=engine, nc=nc_g, names=run_config.names, generator_id="g0")
            await late.start()
            follow = asyncio.create_task(late.loop())
            await _until(loaded, 30, "version 1 loaded again after the join")
            assert late.counters["joins"] == 1 and late.counters["load_failures"] == 0
            await late.stop()
    except TimeoutError:
        _dump_tasks()
        raise
    finally:
        # bounded too: the clean-up once waited on a receiver loop that had lost its cancel (topics/deadlines.py)
        ended = follow is None or await _ends_on_cancel(follow, 30)
        if pub is not None:
            await pub.stop()
        for nc in (nc_g, nc_t):
            if nc is not None:
                await nc.close()
        await engine.stop()
    assert ended, "the receiver's loop did not end within 30 s of its cancel (every task's stack is printed above)"
