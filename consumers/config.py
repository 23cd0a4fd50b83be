"""Configuration of the trainer role."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.cpus import parse_cpus
from topics.errors import ConfigError, check_choices


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The training loop: loss, optimizer, schedule, checkpoints, publication of versions."""

    mode: Literal["rl", "sft"] = "rl"  # rl = the batches topic; sft = the sft topic
    loss: str = "grpo"  # name registered in consumers.losses
    loss_args: dict[str, Any] = field(default_factory=dict)  # TRL names: epsilon, epsilon_high, beta, delta...
    lr: float = 3e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    warmup_steps: int = 0  # linear warm-up steps of the learning rate
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after the warm-up
    grad_clip: float = 1.0  # max gradient norm (0 = no clipping)
    # optimizer steps per batch: the batch's rows cut into `minibatches` contiguous minibatches, each trained once
    # per epoch, `ppo_epochs` times (1 and 1 = one step on the whole batch). A loss that asks for the proximal
    # policy (decoupled_ppo) gets the logprobs of the weights before the batch's first update (consumers/ppo.py)
    ppo_epochs: int = 1
    minibatches: int = 1
    max_steps: int = 0  # 0 = run as long as batches arrive
    reward_target: float = 0.0  # non-zero: stop when the running mean reward reaches it (a negative target: blackjack)
    publish_every: int = 1  # publish a PolicyVersion every k steps
    # a publication falling due while the previous round still waits for generators' acks: "wait" for it (the
    # trainer stalls on the slowest swap) or "skip" (train on; those steps join the next version, published at
    # the first step after the round ended)
    publish_busy: Literal["wait", "skip"] = "wait"
    checkpoint_every: int = 10  # steps between checkpoints
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    export_hf: bool = True  # an HF dir inside every checkpoint and at <run_dir>/hf at the end
    reward_window: int = 20  # batches in the running mean compared with reward_target
    dedup_window: int = 10_000  # recent batch ids remembered (and checkpointed) to drop redelivered batches
    sft_batch_size: int = 8  # SFT examples per step
    poll_timeout_ms: int = 1000  # longest wait for the next record before re-checking for stop
    ref_model: str = ""  # HF dir of the frozen reference for beta > 0 (empty = model.path)
    world_size: int = 1  # ranks (torchrun or spawned); gloo on CPU, nccl on GPU
    tp: int = 1  # tensor-parallel degree (divides world_size); the other world_size / tp ranks are data-parallel
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameters and compute
    # mixed precision: the step's matmuls in bf16 under torch.autocast while parameters, gradients and AdamW state
    # stay float32 (a bf16 parameter loses updates smaller than 1/256 of its value; lr 1e-5 is such an update);
    # the logprobs' vocabulary projection stays fp32. Needs trainer.dtype float32 (bench/bf16.py measures it)
    autocast: bool = False
    seed: int = 0  # torch seed of the trainer
    # torch's intra-op threads in each rank (0 = torch's default, one per core); for several ranks or roles on one
    # CPU host. The demo keeps 0: there 1 thread made the median step slower (README, "The demo").
    threads: int = 0
    # the cores the trainer runs on, a CPU list such as "1" or "2-7" ("" = any); its torch threads default to their
    # number. On a CPU host this keeps the trainer off the generator's engine cores (runtime/cpus.py)
    cpus: str = ""
    # how long the trainer's OpenMP threads busy-wait at a barrier before they sleep (GOMP_SPINCOUNT, set by
    # `streamforge run trainer` before torch loads; a value already in the environment wins; -1 = OpenMP's default,
    # 300,000). Where an engine shares the trainer's cores, a thread whose partner lost its core to the engine spins
    # at every barrier on a core the engine needs: both the step and the generation beside it slow (runtime/cpus.py)
    omp_spincount: int = 10_000
    # the samples of a group share their prompt: run it through the model once per group, not once per sample
    # (consumers/prefix.py; padded batches, mode rl). Each row holds a group's prompt and its samples' responses,
    # at most shared_prefix_tokens tokens (the dense attention mask grows with its square)
    shared_prefix: bool = False
    shared_prefix_tokens: int = 1024

    def __post_init__(self) -> None:
        check_choices(self, "trainer")
        if self.lr <= 0:
            raise ConfigError("trainer.lr", "must be positive")
        if self.max_steps < 0:
            raise ConfigError("trainer.max_steps", "must be >= 0")
        if self.publish_every < 1:
            raise ConfigError("trainer.publish_every", "must be at least 1")
        if self.checkpoint_every < 1:
            raise ConfigError("trainer.checkpoint_every", "must be at least 1")
        if self.keep_checkpoints < 1:
            raise ConfigError("trainer.keep_checkpoints", "must be at least 1")
        if self.reward_window < 1:
            raise ConfigError("trainer.reward_window", "must be at least 1")
        if self.dedup_window < 1:
            raise ConfigError("trainer.dedup_window", "must be at least 1")
        if self.sft_batch_size < 1:
            raise ConfigError("trainer.sft_batch_size", "must be at least 1")
        if self.ppo_epochs < 1:
            raise ConfigError("trainer.ppo_epochs", "must be at least 1")
        if self.minibatches < 1:
            raise ConfigError("trainer.minibatches", "must be at least 1")
        if self.mode == "sft" and self.ppo_epochs * self.minibatches > 1:
            raise ConfigError("trainer.ppo_epochs", "several optimizer steps per batch are for mode rl; sft takes "
                              "one step per trainer.sft_batch_size examples")
        if self.grad_clip < 0:
            raise ConfigError("trainer.grad_clip", "must be >= 0 (0 = no clipping)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("trainer.betas", "must be two numbers in [0, 1)")
        if self.warmup_steps < 0:
            raise ConfigError("trainer.warmup_steps", "must be >= 0")
        if self.world_size < 1:
            raise ConfigError("trainer.world_size", "must be at least 1")
        if self.tp < 1 or self.world_size % self.tp:
            raise ConfigError("trainer.tp", f"must be at least 1 and divide trainer.world_size {self.world_size}")
        if self.threads < 0:
            raise ConfigError("trainer.threads", "must be >= 0 (0 = torch's default)")
        if self.omp_spincount < -1:
            raise ConfigError("trainer.omp_spincount", "must be >= 0, or -1 for OpenMP's default")
        if self.autocast and self.dtype != "float32":
            raise ConfigError("trainer.autocast", "keeps float32 master weights: it needs trainer.dtype float32")
        if self.shared_prefix_tokens < 2:
            raise ConfigError("trainer.shared_prefix_tokens", "must be at least 2")
        parse_cpus(self.cpus, key="trainer.cpus")

    @property
    def dp(self) -> int:
        """Data-parallel degree: the shares each batch's rows are split into."""
        return self.world_size // self.tp
