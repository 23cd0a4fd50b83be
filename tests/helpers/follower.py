"""A weights-only generator process: a vLLM engine kept on the latest policy by a ``WeightReceiver``.

``python tests/helpers/follower.py [--config run.yaml] [--section.key=value ...]`` starts ``Engine(model.path)``
with ``vllm_args(weightsync)``, joins the run's membership, follows the policy store and, with
``--load`` (``STREAMFORGE_FOLLOWER_LOAD=1``), keeps a few sampling requests running so swaps happen under load.
SIGTERM drains (says ``leave``); a second signal forces. Used by the weight-sync tests and benchmark as an
independent generator that can join, leave or be SIGKILLed; the real generator role embeds ``WeightReceiver``
the same way.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from runtime.lifecycle import Service, run_service
from streamforge.config import RunConfig, load_config
from weightsync import vllm_args
from weightsync.receiver import WeightReceiver

log = logging.getLogger("streamforge.weightsync.follower")


class Follower(Service):
    """Engine + receiver (+ optional sampling load) as one supervised service."""

    name = "follower"

    def __init__(self, config: RunConfig, *, load: bool = False) -> None:
        super().__init__()
        self.config = config
        self.load = load
        self.generator_id = config.generator.generator_id or f"{socket.gethostname()}-{os.getpid()}"
        self.engine: Any = None
        self.nc: Any = None
        self.receiver: WeightReceiver | None = None

    async def _start(self) -> None:
        from producers.engine import Engine
        from topics.nats import connect

        cfg = self.config
        self.engine = Engine(cfg.model.path, max_model_len=cfg.model.max_seq_len, seed=cfg.generator.seed,
                             kv_cache_gib=cfg.generator.kv_cache_gib, extra_args=vllm_args(cfg.weightsync))
        await self.engine.start()
        self.nc = await connect(cfg.nats, name=f"follower-{self.generator_id}")
        self.receiver = WeightReceiver(cfg.weightsync, engine=self.engine, nc=self.nc, names=cfg.names,
                                       generator_id=self.generator_id)
        await self.receiver.start()
        print(f"FOLLOWER_READY {self.generator_id}", flush=True)

    def loops(self) -> dict[str, Any]:
        assert self.receiver is not None
        loops = {"weightsync": self.receiver.loop()}
        if self.load:
            loops["load"] = self._sample_forever()
        return loops

    async def _sample_forever(self) -> None:
        """Keeps requests in flight (waits on the engine only), so every swap pauses live generation."""
        from producers.engine import Sampling

        sampling = Sampling(max_tokens=self.config.generator.max_tokens, temperature=1.0)
        i = 0
        while True:
            i += 1
            await self.engine.generate([1, 5, 6, 7, 8], 2, sampling, request_id=f"{self.generator_id}-load-{i}")

    async def _stop(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
        if self.nc is not None:
            await self.nc.drain()
        if self.engine is not None:
            await self.engine.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    load = os.environ.get("STREAMFORGE_FOLLOWER_LOAD") == "1" or "--load" in argv
    argv = [a for a in argv if a != "--load"]
    path = None
    if argv[:1] == ["--config"]:
        path, argv = argv[1], argv[2:]
    environ = {k: v for k, v in os.environ.items() if k != "STREAMFORGE_FOLLOWER_LOAD"}
    config = load_config(path, argv, environ=environ)
    return run_service(Follower(config, load=load))


if __name__ == "__main__":
    sys.exit(main())
