"""Benchmark: a full weight push into a live vLLM generator vs a raw torch.distributed broadcast, and the swap pause.

One run, two processes that matter: this one (the trainer side) and the vLLM worker process of an ``Engine``
started here with ``vllm_args(gloo)``. They share one gloo pair group (``weightsync/collective.py``), set up
through ``init_weight_transfer_engine`` exactly as the ``WeightReceiver`` does it. The engine keeps sampling
requests in flight the whole time ("live").

* push: per version, the snapshot's header and buckets go over the pair group while the worker receives them on
  its prefetch thread and stages them in its shadow model (generation continues); once ``weightsync_ready`` says
  so, ``engine.swap_rpc`` commits them (``weightsync_commit``: vLLM's start, update and finish in one call) inside
  the pause, all in one call into vLLM's engine core (producers/vllm_swap.py), as the generator's receiver does.
  push bytes/s = snapshot bytes / trainer-side send time (the worker posted its receive first).
* raw: the same buffers broadcast over the same pair group into plain receives on the same worker thread that
  prefetches pushes, also while generating (nothing decoded or loaded), into buffers allocated once and received
  into again every round, as a push lands in the buffers of the one before. A 1-byte broadcast first makes sure the
  receiver is waiting, then the bulk is timed.
* pause: ``Engine.swap_rpc`` milliseconds per version on the tiny model, timed in the engine core, and its phases
  (medians): ``pause`` (until the scheduler is idle), ``load`` (the ``weightsync_commit`` RPC), ``resume``; from
  the worker: ``worker_commit`` (the in-pause copy), ``worker_reload`` (an in-pause layerwise reload: 0 when
  staged) and ``stage_before_pause`` (the layerwise reload into the shadow, outside the pause). ``--no-staged``
  measures the unstaged path (the reload inside the pause) for comparison.

Rounds alternate (push, raw, push, raw...) and medians are compared. Reported besides: load ms and the end-to-end
ratio raw / (send + pause). Last line: ``{"bench": "weightsync", "bytes_per_s_vs_broadcast": X, "pause_ms": Y}``
(goals: X >= 0.9, Y <= 50).

Usage: ``python bench/weightsync.py [--swaps N] [--hidden H --layers L] [--no-staged]`` (H/L size the throughput model; the
pause is measured on the tiny model in the same engine run when --hidden is 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """The tiny model, or (hidden > 0) the same architecture widened: for bandwidth numbers above latency noise."""
    from models.tiny_model import MODEL_CONFIG, build_tiny_model

    path = build_tiny_model(out, seed=0)
    if hidden <= 0:
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 64)  # head_dim 64: a size vLLM's CPU attention supports
    cfg = dict(MODEL_CONFIG, hidden_size=hidden, num_hidden_layers=layers, head_dim=64,
               num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), intermediate_size=int(hidden * 2.75))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="float32"))
    model.save_pretrained(path, safe_serialization=True)
    return path


async def run(args: argparse.Namespace) -> dict:
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    from producers.engine import Engine, Sampling
    from weightsync import vllm_args
    from weightsync.collective import Rendezvous, raw_broadcast, send_push, trainer_pair
    from weightsync.config import WeightSyncConfig
    from weightsync.wire import pack

    tmp = Path(tempfile.mkdtemp(prefix="bench-ws-"))
    model_dir = Path(args.model) if getattr(args, "model", "") else build_model(tmp / "model", args.hidden, args.layers)
    base = load_file(str(model_dir / "model.safetensors"))
    cfg = WeightSyncConfig(transport="gloo", timeout_s=60, staged_load=args.staged)
    engine = Engine(str(model_dir), max_model_len=128, extra_args=vllm_args(cfg))
    await engine.start()
    llm = engine.llm
    rdzv = Rendezvous(timeout_s=60)
    pair = asyncio.ensure_future(asyncio.to_thread(trainer_pair, rdzv, "bench/1", timeout_s=60))
    await llm.init_weight_transfer_engine(WeightTransferInitRequest(
        init_info={"address": rdzv.address, "session": "bench/1", "timeout_s": 60.0, "staged": args.staged}))
    pg = await pair

    stop = asyncio.Event()

    async def keep_sampling(i: int) -> None:
        sampling = Sampling(max_tokens=48, temperature=1.0)
        k = 0
        while not stop.is_set():
            k += 1
            await engine.generate([1, 5, 6, 7, 8, 9], 2, sampling, request_id=f"live-{i}-{k}")

    load = [asyncio.ensure_future(keep_sampling(i)) for i in range(2)]
    while engine.tokens_out < 16:
        await asyncio.sleep(0.01)

    push_s, raw_s, pauses, phases, loads, nbytes = [], [], [], [], [], 0
    g = torch.Generator().manual_seed(0)
    for v in range(1, args.swaps + 1):
        named = [(k, t + 0.01 * torch.randn(t.shape, generator=g)) for k, t in base.items()]
        snap = pack(named, version=v, step=v, bucket_bytes=cfg.bucket_bytes)
        nbytes = snap.nbytes
        # push: receiver posted first (prefetch), then the trainer sends; the engine keeps generating
        await llm.collective_rpc("weightsync_prefetch", args=(v,))
        await asyncio.sleep(0.01)
        push_s.append(await asyncio.to_thread(send_push, pg, snap))
        while not (await llm.collective_rpc("weightsync_ready"))[0]["done"]:  # received and staged, as the
            await asyncio.sleep(0.005)  # WeightReceiver waits before it pauses
        # the receiver's swap: the pause around the commit, one call into the engine core (Engine.swap_rpc)
        pause, stats = await engine.swap_rpc(v, "weightsync_commit", (v,), mode="keep")
        pauses.append(pause)
        assert int(stats["version"]) == v, stats
        loads.append((stats["init_s"] + stats["load_s"] + stats["finalize_s"] + stats["commit_s"]) * 1000)
        phases.append({**engine.last_swap_ms, "worker_commit": stats["commit_s"] * 1000,
                       "worker_reload": (stats["init_s"] + stats["load_s"] + stats["finalize_s"]) * 1000,
                       "stage_before_pause": stats["stage_s"] * 1000})
        # raw: the same buffers over the same pair group, nothing loaded
        sizes = [1] + [int(b.numel()) for b in snap.buffers if b.numel()]
        await llm.collective_rpc("weightsync_raw_prefetch", args=(sizes,))

        def raw(snap=snap) -> float:
            raw_broadcast(pg, [torch.zeros(1, dtype=torch.uint8)])  # the receiver is waiting once this is through
            return raw_broadcast(pg, [b for b in snap.buffers if b.numel()])

        raw_s.append(await asyncio.to_thread(raw))
        await llm.collective_rpc("weightsync_raw_wait")
    stop.set()
    await asyncio.wait_for(asyncio.gather(*load, return_exceptions=True), 60)
    await engine.stop()
    shutil.rmtree(tmp, ignore_errors=True)

    push, rawm, pause = statistics.median(push_s), statistics.median(raw_s), statistics.median(pauses)
    return {
        "model_bytes": nbytes, "swaps": args.swaps,
        "push_MBps": nbytes / push / 1e6, "raw_MBps": nbytes / rawm / 1e6,
        "bytes_per_s_vs_broadcast": rawm / push, "pause_ms": pause, "pause_ms_max": max(pauses),
        "pause_phases_ms": {k: round(statistics.median(p[k] for p in phases), 2) for k in phases[0]},
        "load_ms": statistics.median(loads), "e2e_vs_broadcast": rawm / (push + pause / 1000),
        "tokens_generated": engine.tokens_out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swaps", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=0, help="0 = the tiny model (hidden 128)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--throughput-hidden", type=int, default=1024,
                    help="a second run on a wider model for the bandwidth ratio (0 = skip)")
    ap.add_argument("--model", default="", help="an HF model directory (e.g. SmolLM2's) instead of the tiny one: "
                    "its push and pause alone, no throughput run")
    ap.add_argument("--staged", action=argparse.BooleanOptionalAction, default=True,
                    help="stage each push in a shadow model before the pause (the default, as in the generator)")
    args = ap.parse_args()
    tiny = asyncio.run(run(args))
    print(json.dumps({"run": "tiny", **tiny}), flush=True)
    result = {"bench": "weightsync", "pause_ms": round(tiny["pause_ms"], 2),
              "bytes_per_s_vs_broadcast": round(tiny["bytes_per_s_vs_broadcast"], 3)}
    if args.throughput_hidden and args.hidden <= 0 and not args.model:
        wide = asyncio.run(run(argparse.Namespace(swaps=args.swaps, hidden=args.throughput_hidden,
                                                  layers=args.layers, staged=args.staged)))
        print(json.dumps({"run": f"hidden{args.throughput_hidden}", **wide}), flush=True)
        result["bytes_per_s_vs_broadcast"] = round(wide["bytes_per_s_vs_broadcast"], 3)
        result["model_mb"] = round(wide["model_bytes"] / 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
