"""Weight sync into a real vLLM CPU engine over real brokers and a real gloo pair group.

One engine for the whole test (start-up dominates): the trainer-side torchtitan model is perturbed and pushed over
gloo while requests are being generated in "keep" mode; the push is staged in the worker's shadow model while they
run, so tokens generated then must still match the old weights; the requests complete, their tokens carry the
version that produced them, and afterwards the engine's logprobs equal the trainer model's (fp32, 1e-4). Then the
same weights go again through the file transport: the engine's logprobs do not move. Last, a third version goes over
gloo after that reload of the live model: staged and committed, it matches the trainer again.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from topics.nats import connect
from weightsync import vllm_args
from weightsync.config import WeightSyncConfig
from weightsync.files import read_version
from weightsync.publisher import WeightPublisher
from weightsync.receiver import WeightReceiver

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPTS = [[1, 14, 15, 4, 6, 45, 50], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38], [1, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    from consumers.model import token_logprobs

    with torch.no_grad():
        lp, _ = token_logprobs(model, torch.tensor([ids]))
    return lp[0, 1:]


async def _engine_prompt_logprobs(engine, ids: list[int], tag: str) -> torch.Tensor:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = None
    async for out in engine.llm.generate({"prompt_token_ids": ids}, params, f"lp-{tag}"):
        pass
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


async def _teardown(follow, nc_g, nc_t, engine) -> None:
    """The receiver's loop cancelled, both NATS connections closed, the engine stopped."""
    if follow is not None:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
    await nc_g.close()
    await nc_t.close()
    await engine.stop()


def _perturbed(tiny_dir, seed: int):
    """The tiny model as a trainer would hold it after some steps: every parameter moved by 0.05 x N(0, 1)."""
    from consumers.model import load_policy

    policy = load_policy(tiny_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return policy


async def _publish_to_g0(cfg: WeightSyncConfig, run_config, nc_t, engine, policy, version: int) -> None:
    """A publisher that waits to know generator g0, pushes ``policy`` as ``version`` and waits for the engine."""
    from consumers.model import hf_named_tensors

    async with WeightPublisher(cfg, nc=nc_t, names=run_config.names, run_dir=run_config.run_dir) as pub:
        async with asyncio.timeout(cfg.heartbeat_s * 5):
            while "g0" not in pub.members():
                await asyncio.sleep(0.05)
        await pub.publish(version=version, step=version, named_tensors=lambda: hf_named_tensors(policy),
                          batch_ids=[f"b{version}"])
        await _wait_version(engine, version)
        assert pub.members()["g0"]["acked_version"] == version


async def _wait_version(engine, version: int, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while engine.version < version:
            await asyncio.sleep(0.02)


async def test_gloo_swap_under_load_then_file_path(run_config, tiny_dir):
    from consumers.model import hf_named_tensors, load_policy
    from producers.engine import Engine, Sampling

    names = run_config.names
    gloo = WeightSyncConfig(transport="gloo", timeout_s=20, ack_deadline_s=30)
    policy = load_policy(tiny_dir)
    v0 = load_policy(tiny_dir)  # the weights the engine starts with
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))

    engine = Engine(str(tiny_dir), max_model_len=256, extra_args=vllm_args(gloo))
    await engine.start()
    nc_t = await connect(run_config.nats, name="trainer")
    nc_g = await connect(run_config.nats, name="generator")
    follow = None
    try:
        receiver = WeightReceiver(gloo, engine=engine, nc=nc_g, names=names, generator_id="g0")
        await receiver.start()
        follow = asyncio.create_task(receiver.loop())
        pub = WeightPublisher(gloo, nc=nc_t, names=names, run_dir=run_config.run_dir)
        await pub.start()

        # the trainer started after the generator's first heartbeat: it knows g0 from the next one (a round
        # targets the members known when it starts). Waited for before any request starts, so the requests
        # below are still in flight when version 1 arrives, however fast the machine samples.
        async with asyncio.timeout(gloo.heartbeat_s * 5):
            while "g0" not in pub.members():
                await asyncio.sleep(0.05)

        # requests in flight while version 1 arrives
        sampling = Sampling(max_tokens=200, temperature=1.0, seed=3)
        gens = [asyncio.create_task(engine.generate(PROMPTS[i % 3], 4, sampling, request_id=f"r{i}"))
                for i in range(6)]
        async with asyncio.timeout(60):
            while engine.tokens_out < 24:
                await asyncio.sleep(0.005)
        pv = await pub.publish(version=1, step=1, named_tensors=lambda: hf_named_tensors(policy), batch_ids=["b1"])
        assert pv.transport == "gloo" and pv.address == pub.address
        assert pub.counters["fenced"] == 0 and pub.members()["g0"]["acked_version"] == 1
        assert engine.version == 1
        results = await asyncio.wait_for(asyncio.gather(*gens), 120)
        completions = [c for r in results for c in r]
        prompt_of = {id(c): PROMPTS[i % 3] for i, r in enumerate(results) for c in r}
        assert all(c.finish_reason in ("stop", "length") for c in completions)
        for c in completions:
            assert c.versions == sorted(c.versions) and set(c.versions) <= {0, 1}
        assert any(c.versions and c.versions[0] == 0 for c in completions)
        mixed = [c for c in completions if 0 in c.versions and 1 in c.versions]
        assert mixed, "no completion spanned the swap"
        # every token's behaviour logprob belongs to the version stamped on it
        for i, c in enumerate(mixed[:4]):
            prompt = prompt_of[id(c)]
            ids = prompt + c.token_ids
            n = len(prompt) - 1
            old = _trainer_logprobs(v0.model, ids)[n:]
            new = _trainer_logprobs(policy.model, ids)[n:]
            got = torch.tensor(c.logprobs)
            expect = torch.where(torch.tensor(c.versions) == 0, old, new)
            assert (got - expect).abs().max().item() < 1e-4, i

        # after the swap the engine is the trainer's model
        gloo_lps = []
        for j, ids in enumerate(PROMPTS):
            lp = await _engine_prompt_logprobs(engine, ids, f"g{j}")
            ref = _trainer_logprobs(policy.model, ids)
            assert (lp - ref).abs().max().item() < 1e-4
            assert (lp - _trainer_logprobs(v0.model, ids)).abs().max().item() > 1e-2  # the swap changed something
            gloo_lps.append(lp)
        assert receiver.pauses_ms and receiver.counters["load_failures"] == 0
        await pub.stop()

        # the file transport: same weights as version 2, identical on disk and in the engine
        file_cfg = WeightSyncConfig(transport="file", shared_dir=str(run_config.run_dir / "shared"), ack_deadline_s=30)
        async with WeightPublisher(file_cfg, nc=nc_t, names=names, run_dir=run_config.run_dir) as fpub:
            assert fpub.latest_version == 1
            # a freshly started trainer learns its generators from their heartbeats
            async with asyncio.timeout(gloo.heartbeat_s * 5):
                while "g0" not in fpub.members():
                    await asyncio.sleep(0.05)
            pv2 = await fpub.publish(version=2, step=2, named_tensors=lambda: hf_named_tensors(policy),
                                     batch_ids=["b2"])
            await _wait_version(engine, 2)
            assert fpub.members()["g0"]["acked_version"] == 2
        on_disk = read_version(pv2.path)
        for name, t in hf_named_tensors(policy):
            assert torch.equal(on_disk[name], t)
        for j, ids in enumerate(PROMPTS):
            lp = await _engine_prompt_logprobs(engine, ids, f"f{j}")
            assert (lp - gloo_lps[j]).abs().max().item() <= 1e-6

        # a gloo push again, after the file reload touched the live model: it is staged in the shadow model made
        # for version 1 and committed; the engine is the trainer's model again
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        async with WeightPublisher(gloo, nc=nc_t, names=names, run_dir=run_config.run_dir) as pub3:
            await pub3.publish(version=3, step=3, named_tensors=lambda: hf_named_tensors(policy), batch_ids=["b3"])
            await _wait_version(engine, 3)
        for j, ids in enumerate(PROMPTS):
            lp = await _engine_prompt_logprobs(engine, ids, f"h{j}")
            assert (lp - _trainer_logprobs(policy.model, ids)).abs().max().item() < 1e-4
        stats = (await engine.llm.collective_rpc("weightsync_stats"))[0]
        assert stats["version"] == 3 and stats["stage_s"] > 0 and stats["load_s"] == 0  # staged, not reloaded
        assert stats["reused_buffers"] > 0  # version 3 landed in version 1's buffers, which nothing held
        assert receiver.counters["load_failures"] == 0
        await receiver.stop()
    finally:
        await _teardown(follow, nc_g, nc_t, engine)


async def test_a_bfloat16_engine_takes_float32_pushes(run_config, tiny_dir):
    """``generator.dtype: bfloat16``: the engine keeps bf16 weights and the trainer's fp32 push is cast into them;
    afterwards its logprobs are the trainer's model's within bf16's precision, and far from the old weights'. The
    same weights pushed in bf16 (``weightsync.push_dtype``) then leave its logprobs where they were."""
    from consumers.model import load_policy
    from producers.engine import Engine

    gloo = WeightSyncConfig(transport="gloo", timeout_s=20, ack_deadline_s=30)
    policy = _perturbed(tiny_dir, 11)
    v0 = load_policy(tiny_dir)
    engine = Engine(str(tiny_dir), max_model_len=256, dtype="bfloat16", extra_args=vllm_args(gloo))
    await engine.start()
    nc_t = await connect(run_config.nats, name="trainer")
    nc_g = await connect(run_config.nats, name="generator")
    follow = None
    try:
        receiver = WeightReceiver(gloo, engine=engine, nc=nc_g, names=run_config.names, generator_id="g0")
        await receiver.start()
        follow = asyncio.create_task(receiver.loop())
        before = [await _engine_prompt_logprobs(engine, ids, f"b{j}") for j, ids in enumerate(PROMPTS)]
        for lp, ids in zip(before, PROMPTS):  # bf16 weights: near the fp32 model, not equal to it
            assert (lp - _trainer_logprobs(v0.model, ids)).abs().max().item() < 0.1
        await _publish_to_g0(gloo, run_config, nc_t, engine, policy, 1)
        for j, ids in enumerate(PROMPTS):
            lp = await _engine_prompt_logprobs(engine, ids, f"a{j}")
            new, old = _trainer_logprobs(policy.model, ids), _trainer_logprobs(v0.model, ids)
            assert (lp - new).abs().max().item() < 0.1
            assert (lp - new).abs().mean().item() < (lp - old).abs().mean().item() / 3  # it took the push
        # the same weights pushed in bf16 (weightsync.push_dtype, "auto" for this engine): half the bytes, and the
        # engine ends with the very weights its own cast of the float32 push made
        cast = [await _engine_prompt_logprobs(engine, ids, f"c{j}") for j, ids in enumerate(PROMPTS)]
        half = WeightSyncConfig(transport="gloo", timeout_s=20, ack_deadline_s=30, push_dtype="bfloat16")
        await _publish_to_g0(half, run_config, nc_t, engine, policy, 2)
        for j, (lp, ids) in enumerate(zip(cast, PROMPTS)):
            assert torch.allclose(await _engine_prompt_logprobs(engine, ids, f"h{j}"), lp, rtol=0, atol=1e-5)
        assert receiver.counters["load_failures"] == 0
        await receiver.stop()
    finally:
        await _teardown(follow, nc_g, nc_t, engine)


async def test_the_in_process_executor_generates_and_takes_pushes(run_config, tiny_dir):
    """``generator.vllm_executor: uni``: vLLM's engine core runs the model itself,
    with no worker process beside it, although vLLM's CPU platform would replace the executor with its
    multiprocess one; it generates, takes a gloo push staged while a request runs, and then scores like the
    trainer's model (fp32, 1e-4)."""
    import psutil

    from producers.engine import Engine, Sampling

    gloo = WeightSyncConfig(transport="gloo", timeout_s=20, ack_deadline_s=30)
    policy = _perturbed(tiny_dir, 5)
    engine = Engine(str(tiny_dir), max_model_len=256, executor="uni", extra_args=vllm_args(gloo))
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # an earlier test's leftovers are not ours
    await engine.start()
    nc_t = await connect(run_config.nats, name="trainer")
    nc_g = await connect(run_config.nats, name="generator")
    follow = None
    try:
        assert engine.llm.vllm_config.parallel_config.distributed_executor_backend == "uni"
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
        names = [" ".join(p.cmdline()) + p.name() for p in procs if p.is_running()]
        assert any("EngineCore" in n for n in names), names  # the engine core is still its own process
        assert not any("Worker" in n for n in names), names  # but runs the model itself
        receiver = WeightReceiver(gloo, engine=engine, nc=nc_g, names=run_config.names, generator_id="g0")
        await receiver.start()
        follow = asyncio.create_task(receiver.loop())
        running = asyncio.create_task(engine.generate(PROMPTS[0], 4, Sampling(max_tokens=64, seed=1)))
        await _publish_to_g0(gloo, run_config, nc_t, engine, policy, 1)
        done = await asyncio.wait_for(running, 60)
        assert len(done) == 4 and all(c.token_ids and set(c.versions) <= {0, 1} for c in done)
        for j, ids in enumerate(PROMPTS):
            lp = await _engine_prompt_logprobs(engine, ids, f"u{j}")
            assert (lp - _trainer_logprobs(policy.model, ids)).abs().max().item() < 1e-4
        assert receiver.counters["load_failures"] == 0
        await receiver.stop()
    finally:
        await _teardown(follow, nc_g, nc_t, engine)
