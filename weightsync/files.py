"""The file transport: one safetensors directory per version in shared storage, loaded with ``reload_weights``.

Layout: ``<shared_dir>/v<version:08d>/model.safetensors`` with Hugging Face tensor names (what vLLM's loader reads
from a model directory). A version directory is written under a temporary name and renamed, so a generator never
sees a half-written one; the newest ``keep_versions`` directories are kept, older ones deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weightsync.wire import Snapshot

log = logging.getLogger("streamforge.weightsync.files")

WEIGHTS_FILE = "model.safetensors"


def version_dir(shared_dir: Path, version: int) -> Path:
    return Path(shared_dir) / f"v{version:08d}"


def write_version(shared_dir: Path, snapshot: Snapshot, *, keep: int = 3) -> Path:
    """Write ``snapshot`` atomically as ``v<version>/model.safetensors``; prune old versions; return the dir."""
    shared_dir = Path(shared_dir)
    shared_dir.mkdir(parents=True, exist_ok=True)
    final = version_dir(shared_dir, snapshot.version)
    tmp = shared_dir / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # safetensors refuses views that share storage: give each tensor its own (contiguous) copy.
    tensors = {name: t.clone() for name, t in snapshot.tensors()}
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"version": str(snapshot.version),
                                                           "step": str(snapshot.layout.step)})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(shared_dir, keep=keep)
    return final


def prune(shared_dir: Path, *, keep: int) -> None:
    versions = sorted(p for p in Path(shared_dir).glob("v*") if p.is_dir() and p.name[1:].isdigit())
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def read_version(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a version directory (for checks and tests)."""
    return load_file(str(Path(path) / WEIGHTS_FILE))
