"""The trainer role as 2 FSDP ranks over gloo (torchrun): rank 0 consumes and drives, rank 1 follows; the run
checkpoints under FSDP, stops at max_steps, and a second launch resumes from the sharded-then-gathered checkpoint."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_role import ROOT, latest_version, make_batch, produce

from consumers.ledger import Ledger


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def launch(cfg, tiny_dir: Path, max_steps: int, log: Path) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "streamforge", "run", "trainer", "--trainer.world_size=2",
           f"--run.prefix={cfg.run.prefix}", f"--run.run_dir={cfg.run_dir}",
           f"--kafka.bootstrap={cfg.kafka.bootstrap}", f"--nats.url={cfg.nats.url}", f"--model.path={tiny_dir}",
           f"--trainer.max_steps={max_steps}", "--trainer.checkpoint_every=2", "--trainer.poll_timeout_ms=200",
           "--weightsync.transport=file", "--weightsync.ack_deadline_s=1", "--telemetry.traces=none",
           "--telemetry.metrics=[]", "--staleness.max_versions=-1"]  # batches made beforehand: no staleness bound
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as fh:  # noqa: ASYNC230
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return await asyncio.wait_for(asyncio.to_thread(proc.wait), 200)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


@pytest.mark.timeout(450)
async def test_two_rank_trainer_role_trains_checkpoints_and_resumes(run_config, tiny_dir: Path):
    cfg = run_config
    await produce(cfg, cfg.names.batches, [make_batch(i) for i in range(3)])
    log1 = cfg.run_dir.parent / "ranks1.log"
    rc = await launch(cfg, tiny_dir, 3, log1)
    assert rc == 0, log1.read_text()[-4000:]
    assert [r["batch_ids"][0] for r in Ledger.read(cfg.run_dir)] == [f"batch-{i:03d}" for i in range(3)]
    assert (cfg.run_dir / "checkpoints" / "step-3" / "meta.json").exists()  # the final checkpoint
    pv = await latest_version(cfg)
    assert pv.version == 3 and pv.step == 3

    await produce(cfg, cfg.names.batches, [make_batch(i) for i in range(3, 5)])
    log2 = cfg.run_dir.parent / "ranks2.log"
    rc = await launch(cfg, tiny_dir, 5, log2)
    assert rc == 0, log2.read_text()[-4000:]
    assert "resumed from step 3" in log2.read_text()
    ledger = Ledger.read(cfg.run_dir)
    assert [r["batch_ids"][0] for r in ledger] == [f"batch-{i:03d}" for i in range(5)]
    assert [r["step"] for r in ledger] == [1, 2, 3, 4, 5]
    pv = await latest_version(cfg)
    assert pv.version == 5 and pv.step == 5
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(cfg.run_dir / "hf")
