"""Configuration of weight synchronisation between the trainer and the generators."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from topics.errors import ConfigError, check_choices

NCCL_TRANSPORTS = ("nccl", "torch-nccl")  # vLLM's PyNcclCommunicator | torch's ProcessGroupNCCL
COLLECTIVE_TRANSPORTS = ("gloo", *NCCL_TRANSPORTS)  # pushes over a 2-rank group per generator
TRANSPORTS = ("auto", *COLLECTIVE_TRANSPORTS, "file")


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How new weights reach the generators.

    ``transport``: ``gloo`` pushes over a 2-rank torch.distributed gloo group per generator (CPU, any host);
    ``nccl`` over a 2-rank NCCL pair per generator made of vLLM's own ``PyNcclCommunicator``, from the trainer's
    GPU straight into the generator's GPU (the same code as gloo, see ``weightsync/collective.py`` and
    ``weightsync/pynccl.py``; needs CUDA on both sides and vLLM on the trainer's host too); ``torch-nccl`` the same
    over torch's ``ProcessGroupNCCL`` (a trainer host without vLLM); both NCCL transports are covered by a two-GPU
    test that has not run yet; ``file`` writes safetensors to ``shared_dir`` and generators ``reload_weights``
    from there; ``auto`` = nccl with CUDA, else gloo.
    """

    transport: Literal["auto", "nccl", "torch-nccl", "gloo", "file"] = "auto"  # auto = nccl on GPU, gloo on CPU
    host: str = "127.0.0.1"  # trainer-side rendezvous host for collective transports (must be reachable)
    port: int = 0  # 0 = a free port
    generator_host: str = ""  # generator-side address for gloo sockets ("" = derived from the trainer host)
    shared_dir: str = ""  # for the file transport (empty = <run_dir>/weights)
    keep_versions: int = 3  # file transport: version directories kept on disk
    bucket_mb: int = 64
    timeout_s: float = 30.0  # every collective and request is bounded by this
    ack_deadline_s: float = 30.0  # a generator that has not acked by then is fenced
    join_timeout_s: float = 10.0  # a generator's join request (the trainer answers after starting its rendezvous)
    heartbeat_s: float = 2.0  # generator membership heartbeat period
    member_timeout_s: float = 10.0  # a generator silent for this long is dropped from the membership
    # a joined generator must complete the weight-transfer handshake (its pair group; the file transport has none,
    # its join is enough) within this long, or it is dropped: a round waits for an unconfirmed member at most this long
    handshake_timeout_s: float = 15.0
    max_members: int = 256  # joins beyond this many members are refused (dead-lettered)
    # a fenced generator that is no longer a member and never acked a version leaves the fencing record after this
    fence_expiry_s: float = 120.0
    pause_mode: Literal["keep", "wait"] = "keep"  # vLLM pause_generation mode around a swap
    staged_load: bool = True  # collective transports: stage each push in a shadow model before pausing (one more
    # copy of the weights in the generator; see weightsync/staging.py); False = reload inside the pause
    # staged loads: once the staging copy is built (at the join), stage the model's own checkpoint into it this many
    # times, so the first versions stage into warm memory (weightsync/staging.py, ShadowModel.rehearse); 0 = none
    staged_rehearsals: int = 3
    # the dtype of a push's floating-point tensors: "auto" = the generators' engine dtype (generator.dtype) over a
    # collective transport (the receiving engine casts every tensor to it anyway: half the bytes over the wire and
    # no cast on the generator when it is bfloat16), the trainer's own over the file transport (its version
    # directories are read by the evaluator too); "keep" = the trainer's own; "float32"/"bfloat16" = that one.
    # A publisher built outside a run config (streamforge/roles.py resolves "auto") keeps the trainer's own.
    push_dtype: Literal["auto", "keep", "float32", "bfloat16"] = "auto"

    def __post_init__(self) -> None:
        check_choices(self, "weightsync")
        for key in ("timeout_s", "ack_deadline_s", "join_timeout_s", "heartbeat_s", "member_timeout_s",
                    "handshake_timeout_s", "fence_expiry_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"weightsync.{key}", "must be positive")
        if self.member_timeout_s <= self.heartbeat_s:
            raise ConfigError("weightsync.member_timeout_s", "must be longer than weightsync.heartbeat_s")
        if self.staged_rehearsals < 0:
            raise ConfigError("weightsync.staged_rehearsals", "must be >= 0")
        if self.max_members < 1:
            raise ConfigError("weightsync.max_members", "must be at least 1")
        if self.bucket_mb < 1:
            raise ConfigError("weightsync.bucket_mb", "must be at least 1")
        if self.keep_versions < 1:
            raise ConfigError("weightsync.keep_versions", "must be at least 1")
        if not 0 <= self.port < 65536:
            raise ConfigError("weightsync.port", "must be a port number (0 = free port)")

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * 1024 * 1024

    def for_engine(self, engine_dtype: str, *, cuda: bool | None = None) -> WeightSyncConfig:
        """This config with ``push_dtype`` "auto" resolved for generators whose engine runs in ``engine_dtype``."""
        if self.push_dtype != "auto":
            return self
        collective = self.resolved_transport(cuda=cuda) in COLLECTIVE_TRANSPORTS
        return dataclasses.replace(self, push_dtype=engine_dtype if collective else "keep")

    def resolved_transport(self, *, cuda: bool | None = None) -> str:
        """The concrete transport: ``auto`` becomes ``nccl`` when CUDA is available, else ``gloo``."""
        if self.transport != "auto":
            return self.transport
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        return "nccl" if cuda else "gloo"
