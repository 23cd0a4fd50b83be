"""The simulated trainer: ``python -m bench.sim.trainer SPEC.json`` (a child of ``bench/sim/fleet.py``).

It is the trainer role without its GPU: it reads every partition of ``batches`` from offset 0 through
``consumers/source.RecordSource`` (undecodable records dead-lettered there), refuses a batch with a token more than
``staleness.max_versions`` versions behind its version (dead-lettered with reason ``stale``, as
``consumers/trainer.py``), "trains" a batch by sleeping the simulated GPU's step time for its sequences
(``bench/sim/model.py``: tokens over a rate; ``bench/sim/perf.py``: the FLOPs over the training GPUs), appends the step to the real ledger (``consumers/ledger.Ledger``, which the audit reads),
publishes a ``PolicyVersion`` after every step through ``weightsync/policy_kv.PolicyKV`` (compare-and-set of the
KV ``latest`` key, which also notifies ``names.policy_subject``) and writes its ``TrainerProgress`` (steps and
records consumed: the buffers' and generators' bounds read it).

A publication round (the weight push and the generators' acks) lasts the model's swap time. ``trainer.publish_busy:
wait`` (sync) waits for it before the next step; ``skip`` (async) trains on and folds the steps trained meanwhile
into the next version, as the real trainer does.

Runs until SIGTERM, then writes every step (real start and end times, tokens, episodes, version) and the
staleness of every trained token (a histogram) to the spec's ``stats`` path.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

from bench.sim.generators import speed_of
from consumers.ledger import STALE, Ledger
from consumers.source import RecordSource
from streamforge.config import load_config
from topics.kafka import DeadLetters, Producer
from topics.nats import PolicyStore, connect
from topics.schemas import Batch, PolicyVersion, TrainerProgress
from weightsync.members import Registry
from weightsync.policy_kv import PolicyKV


class SimTrainer:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.cfg = load_config(spec["config"], environ={})
        self.model = speed_of(spec)
        s = self.cfg.staleness.max_versions
        self.max_staleness = s if s >= 0 else None
        self.wait_rounds = self.cfg.trainer.publish_busy == "wait"
        self.step = 0
        self.groups = 0  # groups trained (TrainerProgress.groups: the generators' quota counts them)
        self.version = 0
        self.published_step = 0
        self.round: asyncio.Task | None = None
        self.steps: list[list[float]] = []  # [t_start, t_end, tokens, episodes, version]
        self.staleness: Counter[int] = Counter()  # trained response tokens by versions behind
        self.publications: list[list[float]] = []  # [time, version, step]
        self.stale_batches = 0
        self.stop = asyncio.Event()

    async def run(self) -> dict:
        cfg, names = self.cfg, self.cfg.names
        producer = Producer(cfg.kafka, client_id="simtrainer")
        await producer.start()
        dead = DeadLetters(producer, names, "trainer")
        self.source = RecordSource(cfg.kafka, names.batches, group_id=names.trainers_group, expect=Batch,
                                   dead_letters=dead, client_id="simtrainer")
        await self.source.start({})
        nc = await connect(cfg.nats, name="simtrainer")
        self.store = PolicyStore(nc, names, history=cfg.nats.kv_history, timeout_s=cfg.nats.request_timeout_s)
        await self.store.start()
        self.kv = PolicyKV(self.store, Registry(), timeout_s=cfg.weightsync.timeout_s, counters=Counter(),
                           metric=lambda key, value: None)
        await self.kv.read_latest()
        self.ledger = Ledger(cfg.run.run_dir)
        await self.progress()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stop.set)
        print("ready", flush=True)
        loop = asyncio.ensure_future(self.train_loop())
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait([loop, stopped], return_when=asyncio.FIRST_COMPLETED)
        failure = repr(loop.exception()) if loop.done() and not loop.cancelled() and loop.exception() else ""
        loop.cancel()
        stopped.cancel()
        await asyncio.gather(loop, stopped, return_exceptions=True)
        if self.round is not None:
            self.round.cancel()
        self.ledger.close()
        await self.source.stop()
        await producer.stop()
        await nc.close()
        return {"steps": self.steps, "staleness": {str(k): v for k, v in self.staleness.items()}, "publications": self.publications,
                "stale_batches": self.stale_batches, "version": self.version, "step": self.step,
                "failure": failure}

    async def train_loop(self) -> None:
        """One batch per step. Waits on the batches topic (50 ms at a time, then publishes a version it owes).
        Runs until cancelled."""
        while True:
            rec = await self.source.next(50)
            if rec is None:
                if self.owed() and (self.round is None or self.round.done()):
                    await self.publish()
                continue
            batch: Batch = rec.value
            mask = batch.loss_mask.astype(bool) & (batch.token_versions >= 0)
            behind = self.version - batch.token_versions[mask]
            worst = int(behind.max()) if behind.size else 0
            if self.max_staleness is not None and worst > self.max_staleness:
                self.stale_batches += 1
                await self.source.dead_letters.send(rec, reason=STALE, detail=(
                    f"batch {batch.batch_id}: a token {worst} versions behind version {self.version} "
                    f"(staleness.max_versions {self.max_staleness})"))
                self.source.advance(rec)
                await self.progress()
                continue
            tokens = int(batch.seq_lens.sum())
            t0 = time.time()
            await asyncio.sleep(self.model.train_s(batch.seq_lens) / self.model.time_scale)
            self.step += 1
            self.groups += len(set(batch.group_ids))
            self.source.advance(rec)
            self.ledger.record(step=self.step, policy_version=self.version, batch_ids=[batch.batch_id],
                               episode_ids=batch.episode_ids)
            self.steps.append([t0, time.time(), tokens * self.model.token_scale, len(batch.episode_ids),
                               self.version])
            values, counts = np.unique(behind, return_counts=True)
            for v, c in zip(values.tolist(), counts.tolist()):
                self.staleness[int(v)] += int(c)
            if self.wait_rounds or self.round is None or self.round.done():
                await self.publish()
            await self.progress()

    def owed(self) -> bool:
        return self.step > self.published_step

    async def publish(self) -> None:
        """Write the next PolicyVersion (``PolicyKV.store_version``); its round lasts the swap time."""
        if self.round is not None:
            await self.round
        self.published_step = self.step
        self.version += 1
        pv = PolicyVersion(version=self.version, step=self.step, transport="none", trainer_id="simtrainer")
        await self.kv.store_version(pv)
        self.publications.append([time.time(), self.version, self.step])
        self.round = asyncio.ensure_future(asyncio.sleep(self.model.swap_s([]) / self.model.time_scale))
        if self.wait_rounds:
            await self.round

    async def progress(self) -> None:
        await self.store.put_progress(TrainerProgress(
            step=self.step, version=self.version, published_step=self.published_step,
            publish_every=self.cfg.trainer.publish_every, consumed=sum(self.source.offsets.values()),
            groups=self.groups, trainer_id="simtrainer"))


def main() -> None:
    spec = orjson.loads(Path(sys.argv[1]).read_bytes())
    stats = asyncio.run(SimTrainer(spec).run())
    Path(spec["stats"]).write_bytes(orjson.dumps(stats))


if __name__ == "__main__":
    main()
