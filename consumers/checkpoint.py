"""Trainer checkpoints: ``<run_dir>/checkpoints/step-<n>/`` with ``state.pt``, ``meta.json`` and ``hf/``.

* ``state.pt`` (``torch.save``; local files only, never on the wire; read back with ``weights_only=True``): the
  full (unsharded) model and optimizer state dicts in torchtitan names and the torch RNG state (the LR schedule
  is a function of the step and is recomputed).
  Under FSDP every rank takes part in gathering the full state and rank 0 writes; on load every rank reads the
  file (the run dir is shared by the job's ranks) and keeps its own shards.
* ``meta.json``: ``step``, ``policy_version``, ``offsets`` (``{"topic:partition": next_offset}``: the batches
  consumed by this step are exactly those before these offsets), ``recent_batch_ids`` (for deduplication after a
  restart), ``time``, ``world_size``, ``groups`` (the GRPO groups trained through this step, which the generators'
  quota counts; -1 in a checkpoint that did not record them).
* ``hf/``: the policy as a Hugging Face dir a user loads with transformers.

A checkpoint is written into ``step-<n>.tmp`` and renamed when complete, so ``latest_checkpoint`` never returns a
half-written one; only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from consumers.model import Policy, export_hf
from consumers.parallel import Dist


@dataclass(kw_only=True, slots=True)
class CheckpointMeta:
    step: int
    policy_version: int
    offsets: dict[str, int] = field(default_factory=dict)
    recent_batch_ids: list[str] = field(default_factory=list)
    time: float = field(default_factory=time.time)
    world_size: int = 1
    groups: int = -1  # GRPO groups trained through this step (TrainerProgress.groups); -1 = not recorded


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
             and (p / "meta.json").exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_meta(path: str | Path) -> CheckpointMeta:
    data = json.loads((Path(path) / "meta.json").read_text())
    return CheckpointMeta(**{k: data[k] for k in CheckpointMeta.__slots__ if k in data})


def _options(full: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def save_checkpoint(run_dir: str | Path, policy: Policy, opt: torch.optim.Optimizer, sched: Any,
                    meta: CheckpointMeta, d: Dist, *, keep: int = 2, export: bool = True) -> Path | None:
    """Collective: every rank calls it; rank 0 writes and returns the path (other ranks return None)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(policy.model, opt, options=_options(d.enabled))
    hf_tensors = None
    if export:
        from consumers.model import hf_named_tensors

        hf_tensors = {k: v.cpu() for k, v in hf_named_tensors(policy)}
    if not d.is_main:
        return None
    final = checkpoints_dir(run_dir) / f"step-{meta.step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
    torch.save(state, tmp / "state.pt")
    if hf_tensors is not None:
        _write_hf(hf_tensors, tmp / "hf", policy.hf_dir)
    (tmp / "meta.json").write_text(json.dumps(asdict(meta), indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_hf(tensors: dict[str, torch.Tensor], out: Path, source_dir: Path) -> None:
    from safetensors.torch import save_file

    from consumers.model import _HF_SIDECARS

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in _HF_SIDECARS:
        if (source_dir / name).exists():
            shutil.copy2(source_dir / name, out / name)


def load_checkpoint(path: str | Path, policy: Policy, opt: torch.optim.Optimizer, sched: Any,
                    d: Dist) -> CheckpointMeta:
    """Collective: restore model, optimizer, scheduler and RNG from ``path``; returns its meta."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    meta = read_meta(path)
    # every rank reads the full state (the run dir is shared by the job's ranks) and keeps its own shards;
    # broadcast_from_rank0 would need non-empty placeholder state on the other ranks (torch skips empty ones)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    set_state_dict(policy.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(d.enabled))
    restore_schedule(opt, sched, meta.step)
    torch.set_rng_state(state["rng"])
    return meta


def restore_schedule(opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    """Put a ``LambdaLR`` where it is after ``step`` steps (same on every rank, nothing to broadcast)."""
    lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    sched.last_epoch = step
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


def export_final(run_dir: str | Path, policy: Policy, d: Dist) -> Path | None:
    """Collective: the latest policy as an HF dir at ``<run_dir>/hf`` (rank 0 writes)."""
    if d.enabled:
        from consumers.model import hf_named_tensors

        tensors = {k: v.cpu() for k, v in hf_named_tensors(policy)}
        if not d.is_main:
            return None
        out = Path(run_dir) / "hf"
        shutil.rmtree(out, ignore_errors=True)
        _write_hf(tensors, out, policy.hf_dir)
        return out
    return export_hf(policy, Path(run_dir) / "hf", policy.hf_dir)
