"""The generator's inference engine: vLLM's ``AsyncLLM`` with per-token policy versions and a swap hook.

``Engine(model_path, ...)`` owns one ``AsyncLLM`` (``dtype``, float32 by default; eager; on CPU its KV cache is
``VLLM_CPU_KVCACHE_SPACE`` GiB, set from ``kv_cache_gib`` before the engine starts; ``max_num_seqs`` and
``max_num_batched_tokens`` bound a scheduler step, 0 = vLLM's offline ``LLM`` defaults; ``poll_s`` is how long its
engine core and worker poll their shared-memory queues before they sleep, ``producers/vllm_poll.py``, None = vLLM's
own 1 s). ``block_size`` is the KV cache's block in tokens (0 = vLLM's own, on CPU 128; its prefix cache reuses
full blocks only). ``executor`` is vLLM's ``distributed_executor_backend`` (None: vLLM's choice, on CPU its multiprocess
executor; ``"uni"``: the model runs in the engine core's own process, see ``_async_llm``). ``extra_args`` are
more engine keyword arguments, e.g. ``weightsync.vllm_args(ws_cfg)`` (``worker_extension_cls``,
``weight_transfer_config``).

``generate(prompt_token_ids, n, sampling)`` runs one request with ``n`` samples (one GRPO group) and returns every
response token with the policy version of the weights that sampled it, so a weight swap in the middle of a
sequence shows as a change of version inside one completion. The versions are vLLM's own weight-version labels:
the engine core stamps each step's outputs with its current label, and a finished completion carries them as
spans (``CompletionOutput.weight_versions``). So the stream need not deliver every token as it comes: each sample
streams its first token (for ``first_token_s``) and then its final output only (``stream_interval``), which spares
the main process a Python round per token and sample. vLLM does not detokenize (``detokenize=False``: no
incremental text, no decoded string per logprob); a sample's text is decoded once when it finishes, and the
logprobs come in vLLM's flat lists (``flat_logprobs``).

``swap(version, load, mode="keep")`` is the weight hot-swap hook: pause (``"keep"`` freezes running requests in
place, ``"wait"`` lets them finish first; KV and prefix caches are cleared), ``await load(llm)``, set ``version``
and vLLM's label, ``resume_generation()``; returns the pause in milliseconds (``last_swap_ms`` has it by phase).
Swaps are serialised by a lock; the engine resumes even if ``load`` raises (the error propagates, the version is
unchanged). ``relabel(version)`` adopts a version without loading anything (the same weights, renamed); assigning
``version`` alone does not change the labels of the tokens generated next.

Behaviour logprobs: ``logprobs_mode`` ``"processed_logprobs"`` (default) gives log-probabilities of the
distribution actually sampled from (after temperature/top-k/top-p), so with ``temperature=1`` and no truncation
they equal the model's raw log-softmax; a trainer using another temperature divides its logits by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from producers import vllm_fork, vllm_poll, vllm_swap
from topics.errors import ConfigError

log = logging.getLogger("streamforge.engine")


@dataclass(kw_only=True, slots=True)
class Sampling:
    """Sampling parameters of one request (one GRPO group)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    """One sample of a request: response tokens with their behaviour logprobs and policy versions."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    first_token_s: float = 0.0  # seconds from submission to the first token
    generate_s: float = 0.0  # seconds from submission to the last token


def check_block_size(block_size: int, key: str) -> None:
    """Fail before the engine starts, naming ``key``, where this platform's attention cannot take the block."""
    from vllm.platforms import current_platform

    if block_size and current_platform.is_cpu() and block_size % 32:
        raise ConfigError(key, f"{block_size}: vLLM's CPU attention takes multiples of 32 tokens")


class Engine:
    """One vLLM ``AsyncLLM``. ``start()``/``stop()`` are idempotent; ``.llm`` is the engine, ``.version`` the policy."""

    def __init__(self, model_path: str, *, version: int = 0, max_model_len: int = 256, seed: int = 0,
                 kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.5, enforce_eager: bool = True,
                 logprobs_mode: str = "processed_logprobs", dtype: str = "float32", max_num_seqs: int = 0,
                 max_num_batched_tokens: int = 0, poll_s: float | None = vllm_poll.DEFAULT_POLL_S,
                 executor: str | None = None, start_method: str = "auto", block_size: int = 0,
                 extra_args: dict[str, Any] | None = None) -> None:
        self.model_path = str(model_path)
        self._version = version
        self._version_listeners: list[Callable[[int], None]] = []
        self.max_model_len = max_model_len
        self.seed = seed
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.logprobs_mode = logprobs_mode
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.poll_s = poll_s
        self.executor = executor
        self.block_size = block_size
        self.start_method = start_method
        self.extra_args = dict(extra_args or {})
        self.llm: Any = None
        self._swap_lock = asyncio.Lock()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._stopped = False
        self.swaps = 0
        self.tokens_out = 0
        # prompt tokens vLLM's prefix cache served, summed over finished requests as vLLM reports them: for n > 1
        # vLLM merges the samples' outputs and keeps one sample's count, so a group counts once, not n times
        self.prompt_tokens_cached = 0
        self.last_swap_ms: dict[str, float] = {}  # phases of the last swap: pause, load, resume
        self._fused_swap = True  # swap_rpc in one engine-core call until the engine core says it cannot

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine (16-25 s on CPU: this blocks the event loop, so start it before anything else)."""
        if self.llm is not None or self._stopped:
            return
        from vllm import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{max(1, round(self.kv_cache_gib))}")
        vllm_poll.set_poll_s(self.poll_s)  # read by our vLLM plugin in the engine core and worker processes
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            max_model_len=self.max_model_len,
            seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            logprobs_mode=self.logprobs_mode,
            disable_log_stats=True,
            max_num_seqs=self.max_num_seqs or None,
            max_num_batched_tokens=self.max_num_batched_tokens or None,
            block_size=self.block_size or None,
            **({"distributed_executor_backend": self.executor} if self.executor else {}),
            **self.extra_args,
        )
        t0 = time.monotonic()
        # unset batch limits take vLLM's offline (``LLM`` class) defaults for the platform, not the smaller
        # server ones: a generator is a throughput client (on CPU 256 sequences, not 128, and 4096 tokens a step)
        self.llm = _async_llm(args, UsageContext.LLM_CLASS, self.start_method)
        await self.llm.update_weight_version(str(self.version))
        log.info("vLLM engine for %s ready in %.1f s (executor %s)", self.model_path, time.monotonic() - t0,
                 self.llm.vllm_config.parallel_config.distributed_executor_backend)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    # -- generation -----------------------------------------------------------------------------
    def _params(self, n: int, sampling: Sampling) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(0, sampling.top_k),
            seed=sampling.seed,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=list(sampling.stop_token_ids) or None,
            flat_logprobs=True,  # a few flat lists per request, not a dict and a Logprob per token
            output_kind=RequestOutputKind.DELTA,
            stream_interval=_FIRST_AND_FINAL,
            # no incremental detokenization (nor a decoded string per logprob): the text is decoded once, at the end
            detokenize=False,
        )

    async def generate(self, prompt_token_ids: Sequence[int], n: int, sampling: Sampling,
                       *, request_id: str = "") -> list[Completion]:
        """Sample ``n`` completions of one prompt; returns them ordered by index.

        Waits on vLLM's output stream (each sample's first token, then its final output); token versions come
        from the finished outputs' weight-version spans. Raises ``RuntimeError`` if the engine is not started;
        cancelling aborts the request in vLLM.
        """
        if self.llm is None:
            raise RuntimeError("Engine.start() was not called")
        request_id = request_id or f"{self._prefix}-{next(self._ids)}"
        out = [Completion(index=i) for i in range(n)]
        t0 = time.monotonic()
        prompt = {"prompt_token_ids": [int(t) for t in prompt_token_ids]}
        async for ro in self.llm.generate(prompt, self._params(n, sampling), request_id):
            now = time.monotonic() - t0
            for co in ro.outputs:
                c = out[co.index]
                new = list(co.token_ids)
                if new:
                    if not c.token_ids:
                        c.first_token_s = now
                    c.generate_s = now
                    c.token_ids.extend(new)
                    c.logprobs.extend(_sampled_logprobs(co.logprobs, new))
                    self.tokens_out += len(new)
                if co.finish_reason is not None:
                    c.finish_reason = str(co.finish_reason)
                    c.versions = _token_versions(co.weight_versions, len(c.token_ids), self.version)
                    c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if ro.finished:
                self.prompt_tokens_cached += ro.num_cached_tokens or 0
        return out

    # -- weight swap ----------------------------------------------------------------------------
    async def swap(self, version: int, load: Callable[[Any], Awaitable[None]], *, mode: str = "keep") -> float:
        """Pause generation, ``await load(llm)``, adopt ``version``, resume; returns the pause in ms.

        ``mode="keep"`` freezes in-flight requests (their later tokens carry the new version); ``"wait"`` lets
        them finish on the old weights first. Always resumes, even when ``load`` raises. ``last_swap_ms`` holds
        the phases of the last swap: ``pause`` (until the scheduler is idle), ``load``, ``resume``.

        The pause is ``AsyncLLM.pause_generation`` without its two extras: the multimodal cache is cleared before
        pausing (nothing needs the engine paused for it) and its fixed 20 ms settle sleep is skipped. That sleep
        only lets outputs of the old weights reach their streams before it returns; here every token is labelled
        by the engine core with the label of the step that sampled it, and the new label is set while the
        scheduler is paused, so when an output reaches its stream does not matter.
        """
        if self.llm is None:
            raise RuntimeError("Engine.start() was not called")
        async with self._swap_lock:
            await self.llm.renderer.clear_mm_cache_async()
            t0 = time.perf_counter()
            # clear_cache: no request may reuse KV computed by the old weights (frozen ones are recomputed)
            await self.llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=True)
            t1 = t2 = time.perf_counter()
            try:
                await load(self.llm)
                # the label inside the pause: tokens of a step before it are the old weights', after it the new
                await self.llm.update_weight_version(str(version))
                t2 = time.perf_counter()
                self._adopt(version)
                self.swaps += 1
            finally:
                await self.llm.resume_generation()
                t3 = time.perf_counter()
                self.last_swap_ms = {"pause": (t1 - t0) * 1000, "load": (t2 - t1) * 1000,
                                     "resume": (t3 - t2) * 1000}
            return (t3 - t0) * 1000.0

    async def swap_rpc(self, version: int, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                       *, mode: str = "keep") -> tuple[float, Any]:
        """``swap`` whose load is the worker RPC ``method(*args, **kwargs)``: returns (pause in ms, its result).

        One call into the engine core when our plugin gave it ``streamforge_swap`` (producers/vllm_swap.py): the
        pause, the RPC, the new label and the resume all happen there, and ``last_swap_ms`` holds the engine core's
        timings. Otherwise (and from then on) ``swap`` with the RPC as its load.
        """
        if self.llm is None:
            raise RuntimeError("Engine.start() was not called")
        if self._fused_swap:
            async with self._swap_lock:
                await self.llm.renderer.clear_mm_cache_async()
                try:
                    out = await self.llm.engine_core.call_utility_async(
                        vllm_swap.METHOD, str(version), mode, method, list(args), dict(kwargs or {}))
                except Exception as exc:  # vLLM reports a failed utility call as a bare Exception
                    if f"attribute '{vllm_swap.METHOD}'" not in str(exc):
                        raise
                    log.info("vLLM's engine core lacks %s (plugin not loaded): a swap takes four calls",
                             vllm_swap.METHOD)
                    self._fused_swap = False
                else:
                    self._adopt(version)
                    self.swaps += 1
                    self.last_swap_ms = {k: float(out[f"{k}_ms"]) for k in ("pause", "load", "resume")}
                    return sum(self.last_swap_ms.values()), out["result"]
        result: list[Any] = []

        async def load(llm: Any) -> None:
            result.extend(await llm.collective_rpc(method, args=tuple(args), kwargs=kwargs))

        pause = await self.swap(version, load, mode=mode)
        return pause, result[0] if result else None

    @property
    def version(self) -> int:
        """The policy version of the weights generating now (``swap`` and ``relabel`` change it)."""
        return self._version

    def on_version(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call ``callback(version)`` each time the engine adopts a version (a swap or a relabel), right after;
        returns the function that stops it."""
        self._version_listeners.append(callback)
        return lambda: self._version_listeners.remove(callback) if callback in self._version_listeners else None

    def _adopt(self, version: int) -> None:
        self._version = version
        for callback in self._version_listeners:
            callback(version)

    async def relabel(self, version: int) -> None:
        """Adopt ``version`` for the weights loaded now (nothing is loaded): later tokens carry it."""
        if self.llm is None:
            raise RuntimeError("Engine.start() was not called")
        await self.llm.update_weight_version(str(version))
        self._adopt(version)


# a sample's stream delivers its first token, then nothing until it finishes (vLLM's ``stream_interval``)
_FIRST_AND_FINAL = 1 << 30


def _token_versions(spans: Any, num_tokens: int, fallback: int) -> list[int]:
    """Per-token policy versions from vLLM's weight-version spans of a finished sample (``fallback`` if none)."""
    if not spans:
        return [fallback] * num_tokens
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise RuntimeError(f"vLLM's weight-version spans cover {len(versions)} of {num_tokens} tokens")
    return versions


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The logprob of each sampled token from vLLM's flat lists (``FlatLogprobs``) or per-position
    ``{token_id: Logprob}`` dicts."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (SamplingParams.logprobs must be set)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprob entries for {len(token_ids)} tokens")
    if getattr(logprobs, "token_ids", None) == token_ids:  # FlatLogprobs holding the sampled token's entry only
        return [float(x) for x in logprobs.logprobs]
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]


def _async_llm(args: Any, usage_context: Any, start_method: str = "auto") -> Any:
    """``AsyncLLM.from_engine_args``, except that its processes are forked where ``start_method`` says so
    (``producers/vllm_fork.py``) and that an ``"uni"`` executor stays one: vLLM's CPU platform replaces it with its
    multiprocess executor unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the config is built, and that variable
    must not be 0 when ``AsyncLLM`` starts its engine-core process. With ``"uni"`` the engine core runs the model
    itself: no worker process and no shared-memory queues between the two to poll."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    fork = vllm_fork.wants_fork(start_method, args.distributed_executor_backend)
    if fork:
        vllm_fork.prepare()
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    if args.distributed_executor_backend == "uni":
        os.environ[key] = "0"
    try:
        vllm_config = args.create_engine_config(usage_context)
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    with vllm_fork.forking() if fork else contextlib.nullcontext(), _no_compile(args.enforce_eager):
        return AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                        log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                        usage_context=usage_context)


@contextlib.contextmanager
def _no_compile(eager: bool) -> Any:
    """With ``enforce_eager``, the engine's processes started meanwhile run vLLM's ``torch.compile``'d helpers
    (the sampled tokens' ranks over the vocabulary, on CPU) eagerly too: compiling them took 3-4 s of every CPU
    generator's start and first generation (bench/RESULTS.md, 2026-12-05 evening), for an elementwise pass over
    the logits. Spawned processes read the environment when torch loads; forked ones inherit the flag dynamo reads
    at each call."""
    if not eager:
        yield
        return
    import torch._dynamo

    saved = {k: os.environ.get(k) for k in ("TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE")}
    disabled = torch._dynamo.config.disable
    os.environ.update(dict.fromkeys(saved, "1"))
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        torch._dynamo.config.disable = disabled
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
