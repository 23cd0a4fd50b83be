"""vLLM's prefix cache under ``generator.kv_block_size``, with the real vLLM CPU engine.

vLLM reuses only whole KV blocks, and its CPU block is 128 tokens by default: prompts shorter than that are
prefilled again for every sample. Proven here:
* with 32-token blocks a 40-token prompt's first block is served from the cache to the requests after the first,
  and to requests of one prompt that arrive together (as a group's samples do: vLLM fans ``n`` out into such
  requests); with vLLM's default block nothing is. The group is sent as separate requests because for ``n > 1``
  vLLM merges the samples' outputs and reports one sample's cached count, whichever arrived first;
* a weight swap clears that cache: greedy tokens and logprobs after loading other weights are those of an engine
  started on those weights, not ones computed over the old weights' cached prompt;
* a block the CPU attention cannot take fails before the engine starts, naming the key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from models.tiny_model import build_tiny_model
from producers.config import GeneratorConfig
from producers.engine import Engine, Sampling, check_block_size
from topics.errors import ConfigError

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PROMPT = [5 + (i * 7) % 23 for i in range(40)]  # 40 tokens: one whole 32-token block and 8 more
GREEDY = Sampling(max_tokens=6, temperature=0.0)


async def _greedy(engine: Engine) -> tuple[list[int], list[float]]:
    (out,) = await engine.generate(PROMPT, 1, GREEDY)
    return out.token_ids, out.logprobs


async def test_block_32_caches_a_prompt_and_a_swap_clears_it(tmp_path: Path) -> None:
    old = build_tiny_model(tmp_path / "old", seed=0)
    new = build_tiny_model(tmp_path / "new", seed=1)

    engine = Engine(str(old), max_model_len=128, seed=0, block_size=32)
    await engine.start()
    try:
        before = await _greedy(engine)
        assert engine.prompt_tokens_cached == 0  # a fresh cache
        assert await _greedy(engine) == before
        assert engine.prompt_tokens_cached == 32  # the next request finds the prompt's whole block
        other = [t + 1 for t in PROMPT]
        await asyncio.gather(*(engine.generate(other, 1, Sampling(max_tokens=4, seed=i)) for i in range(4)))
        assert engine.prompt_tokens_cached == 32 + 3 * 32  # requests that arrive together share the first's block

        async def load(llm) -> None:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new)})

        await engine.swap(1, load)
        after = await _greedy(engine)
        assert engine.prompt_tokens_cached == 128  # the swap emptied the cache: nothing of the old weights' KV
    finally:
        await engine.stop()

    reference = Engine(str(new), max_model_len=128, seed=0)  # vLLM's default block: nothing cached
    await reference.start()
    try:
        expected = await _greedy(reference)
        assert reference.prompt_tokens_cached == 0
    finally:
        await reference.stop()

    assert after[0] == expected[0]
    assert after[0] != before[0] or after[1] != pytest.approx(before[1], abs=1e-3)
    assert after[1] == pytest.approx(expected[1], abs=1e-3)


def test_block_size_checked_at_start_naming_the_key() -> None:
    for bad in (-32, 20):
        with pytest.raises(ConfigError, match="generator.kv_block_size"):
            GeneratorConfig(kv_block_size=bad)
    GeneratorConfig(kv_block_size=32)
    with pytest.raises(ConfigError, match="generator.kv_block_size.*multiples of 32"):
        check_block_size(48, "generator.kv_block_size")  # a multiple of 16 that vLLM's CPU attention refuses
    check_block_size(64, "generator.kv_block_size")
    check_block_size(0, "generator.kv_block_size")
