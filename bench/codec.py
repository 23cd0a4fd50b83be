"""Codec benchmark: encode+decode throughput of realistic Episodes against pickle and torch.save, and wire size.

Episodes of 1k and 8k response tokens (256 prompt tokens, logprobs, per-token versions, texts, reward components)
are encoded and decoded by ``topics.codec``, by ``pickle`` (protocol 5, the same dataclass instance) and by
``torch.save``/``torch.load`` (the same fields as a dict of tensors), interleaved in one run. Raw bytes are the
payload itself: tensor bytes plus UTF-8 text bytes. Last line (bench JSON contract):
``{"bench": "codec", "throughput_vs_pickle": X, "wire_bytes_vs_raw": Y, ...}`` where X is the geometric mean
over both sizes of (codec msgs/s) / (pickle msgs/s), and Y the largest wire/raw ratio of the two sizes.
"""

from __future__ import annotations

import io
import math
import pickle  # baseline only: never used on the wire
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from topics import codec
from topics.schemas import Episode


def make_episode(n: int, rng: np.random.Generator) -> Episode:
    return Episode(
        episode_id=f"prompt-{n}/3", group_id=f"prompt-{n}", group_size=8, prompt_id=f"prompt-{n}", task="gsm8k",
        prompt_tokens=rng.integers(0, 150_000, 256, dtype=np.int32),
        response_tokens=rng.integers(0, 150_000, n, dtype=np.int32),
        logprobs=rng.standard_normal(n).astype(np.float32),
        token_versions=np.full(n, 41, dtype=np.int32), policy_version=41, reward=1.0,
        reward_components={"math": 1.0, "format": 0.5, "length": -0.01}, finish_reason="stop",
        generator_id="generator-3", prompt_text="Q: " + "x" * 400, response_text="A: " + "y" * (n * 3),
        timings={"queued_s": 0.01, "generate_s": 1.2, "reward_s": 0.003},
    )


def raw_bytes(ep: Episode) -> int:
    tensors = sum(a.nbytes for a in (ep.prompt_tokens, ep.response_tokens, ep.logprobs, ep.token_versions))
    return tensors + len(ep.prompt_text.encode()) + len(ep.response_text.encode())


def rates(fns: dict[str, object], rounds: int = 6, min_time: float = 0.2) -> dict[str, float]:
    """Calls per second of each function: the best of ``rounds`` runs of at least ``min_time`` each. The functions
    take turns round by round, so a change in the machine's load hits them alike."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(rounds):
        for name, fn in fns.items():
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_time:
                    break
            best[name] = max(best[name], n / dt)
    return best


def main() -> None:
    import torch

    rng = np.random.default_rng(0)
    rows = {}
    for n in (1024, 8192):
        ep = make_episode(n, rng)

        def ours(ep: Episode = ep) -> None:
            codec.decode(codec.encode(ep))

        def pkl(ep: Episode = ep) -> None:
            pickle.loads(pickle.dumps(ep, protocol=5))

        def tsave(ep: Episode = ep) -> None:
            buf = io.BytesIO()
            torch.save({"prompt_tokens": torch.from_numpy(ep.prompt_tokens),
                        "response_tokens": torch.from_numpy(ep.response_tokens),
                        "logprobs": torch.from_numpy(ep.logprobs),
                        "token_versions": torch.from_numpy(ep.token_versions),
                        "meta": {"episode_id": ep.episode_id, "reward": ep.reward, "text": ep.response_text}}, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)

        measured = rates({"ours": ours, "pickle": pkl, "torch": tsave})
        r_ours, r_pickle, r_torch = measured["ours"], measured["pickle"], measured["torch"]
        wire = len(codec.encode(ep))
        rows[n] = {"codec_msgs_per_s": round(r_ours), "pickle_msgs_per_s": round(r_pickle),
                   "torch_save_msgs_per_s": round(r_torch), "vs_pickle": r_ours / r_pickle,
                   "vs_torch_save": r_ours / r_torch, "wire_bytes": wire, "raw_bytes": raw_bytes(ep),
                   "wire_vs_raw": wire / raw_bytes(ep)}
        print(f"{n:5d} tokens: codec {r_ours:8.0f}/s  pickle {r_pickle:8.0f}/s  torch.save {r_torch:7.0f}/s  "
              f"wire {wire} B / raw {raw_bytes(ep)} B = {wire / raw_bytes(ep):.4f}")
    vs_pickle = math.sqrt(rows[1024]["vs_pickle"] * rows[8192]["vs_pickle"])
    vs_torch = math.sqrt(rows[1024]["vs_torch_save"] * rows[8192]["vs_torch_save"])
    print(orjson.dumps({"bench": "codec", "throughput_vs_pickle": round(vs_pickle, 3),
                        "wire_bytes_vs_raw": round(max(r["wire_vs_raw"] for r in rows.values()), 4),
                        "throughput_vs_torch_save": round(vs_torch, 3)}).decode())


if __name__ == "__main__":
    main()
