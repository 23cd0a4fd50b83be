"""Every message that crosses a broker, as versioned dataclasses.

Wire layout (see ``topics/codec.py``): a msgpack map ``{"schema": NAME, "v": VERSION, <field>: <value>...}``.
Tensor fields are numpy arrays on the Python side and the map ``{"dtype": "int32", "shape": [..], "data":
<bin>}`` on the wire (little-endian, C order), so any msgpack reader can decode them.

Conventions shared by producers, buffer and trainer:

* Token positions in a ``Batch`` row are ``prompt + response`` padded on the right (a packed Batch holds several
  such sequences per row, see ``Batch``). ``old_logprobs[b, t]`` is the
  behaviour log-probability of ``input_ids[b, t]`` given ``input_ids[b, :t]``; ``loss_mask[b, t]`` is 1 exactly at
  response tokens. A trainer computes ``logits[:, :-1]`` against ``input_ids[:, 1:]`` and aligns with ``[:, 1:]``.
* ``token_versions`` hold the policy version that sampled each response token (a swap mid-sequence shows as a
  change inside one episode); ``-1`` marks prompt and padding positions in a Batch.
* A multi-turn Episode's response interleaves the model's tokens with the environment's (observations and tool
  results, ``Episode.token_mask`` 0 there): environment tokens carry logprob 0 and version ``-1``, and a Batch's
  ``loss_mask`` is 0 at them, so no loss reads them.
* Ids are strings. ``episode_id`` is deterministic: ``f"{group_id}/{index}"``, so a prompt regenerated after a
  crash yields the same ids and the buffer deduplicates.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from topics.errors import InvalidMessage


def tensor(dtype: str, ndim: int, *, default: bool = False) -> Any:
    """A numpy-array field of a fixed dtype and rank (``default`` gives an empty array)."""
    meta = {"tensor": (dtype, ndim)}
    if default:
        shape = (0,) * ndim
        return field(default_factory=lambda: np.zeros(shape, dtype=dtype), metadata=meta)
    return field(metadata=meta)


def _now() -> float:
    return time.time()


@dataclass(kw_only=True, slots=True)
class Prompt:
    """One task instance to roll out: text (or token ids), the target to score against, and task metadata."""

    SCHEMA: ClassVar[str] = "prompt"
    VERSION: ClassVar[int] = 1

    prompt_id: str
    task: str
    text: str = ""
    token_ids: np.ndarray = tensor("int32", 1, default=True)
    answer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class Episode:
    """One sampled response to one prompt, scored; ``group_size`` episodes share a ``group_id`` (a GRPO group).

    Version 2 adds the multi-turn fields (``producers/multiturn.py``): the response is every token after the
    prompt, the model's turns and the environment's answers in order; ``token_mask[i]`` is 1 where the model
    sampled ``response_tokens[i]`` (trained) and 0 where the environment wrote it (masked out of every loss; its
    logprob is 0 and its version -1); ``turn_ids[i]`` the model turn the token belongs to (an observation belongs
    to the turn that caused it); ``env_name``/``env_replica`` where it ran; ``turn_rewards`` the environment's
    reward after each turn and ``final_reward`` its last one; ``env_restarts`` how often the episode restarted
    from ``reset()`` after losing its replica; ``tool_calls`` the tool calls the model made. A single-turn episode
    (and a version-1 record) has empty ``token_mask``/``turn_ids``: every response token is the model's, turn 0.

    Version 3 adds ``prompt_partition`` and ``prompt_offset``: where the generator read the prompt on the
    ``prompts`` topic (-1 for a prompt from a local source, and in older records), so the audit tells apart two
    prompts that carry the same ``prompt_id`` (``streamforge/audit.py``).
    """

    SCHEMA: ClassVar[str] = "episode"
    VERSION: ClassVar[int] = 3
    OLDER_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)  # decoded into this class, the fields they lack defaulted

    episode_id: str
    group_id: str
    group_size: int
    prompt_id: str
    task: str = ""
    prompt_tokens: np.ndarray = tensor("int32", 1)
    response_tokens: np.ndarray = tensor("int32", 1)
    logprobs: np.ndarray = tensor("float32", 1)  # behaviour logprob of each response token
    token_versions: np.ndarray = tensor("int32", 1)  # policy version that sampled each response token
    policy_version: int = 0  # version at the first response token
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    generator_id: str = ""
    prompt_text: str = ""
    response_text: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # e.g. queued_s, generate_s, reward_s
    created_at: float = field(default_factory=_now)
    # version 2 (multi-turn; see the class docstring): empty or zero on single-turn episodes
    token_mask: np.ndarray = tensor("uint8", 1, default=True)  # [R] 1 = model token, 0 = environment token
    turn_ids: np.ndarray = tensor("int32", 1, default=True)  # [R] model turn of each response token
    env_name: str = ""
    env_replica: str = ""
    turn_rewards: np.ndarray = tensor("float32", 1, default=True)  # [turns] the environment's reward per turn
    final_reward: float = 0.0
    env_restarts: int = 0
    tool_calls: int = 0
    # version 3: the prompt's place on the prompts topic, -1 when it did not come from there
    prompt_partition: int = -1
    prompt_offset: int = -1

    def validate(self) -> None:
        n = len(self.response_tokens)
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise InvalidMessage(
                f"episode {self.episode_id}: response_tokens ({n}), logprobs ({len(self.logprobs)}) and "
                f"token_versions ({len(self.token_versions)}) differ in length"
            )
        for name in ("token_mask", "turn_ids"):
            if len(getattr(self, name)) not in (0, n):
                raise InvalidMessage(f"episode {self.episode_id}: {name} ({len(getattr(self, name))}) must be "
                                     f"empty or as long as response_tokens ({n})")
        # (an empty array's isfinite costs ~0.7 us, twice per codec round trip: a single-turn episode skips it)
        if not (math.isfinite(self.final_reward)
                and (not len(self.turn_rewards) or np.isfinite(self.turn_rewards).all())):
            raise InvalidMessage(f"episode {self.episode_id}: final_reward or turn_rewards not finite")
        if self.env_restarts < 0 or self.tool_calls < 0:
            raise InvalidMessage(f"episode {self.episode_id}: env_restarts and tool_calls must be >= 0")
        if not math.isfinite(self.reward):
            raise InvalidMessage(f"episode {self.episode_id}: reward is not finite ({self.reward})")
        if self.group_size < 1:
            raise InvalidMessage(f"episode {self.episode_id}: group_size {self.group_size} < 1")

    @property
    def model_mask(self) -> np.ndarray:
        """``[R]`` uint8: 1 at the tokens the model sampled (``token_mask``, all ones when it is empty)."""
        if len(self.token_mask):
            return self.token_mask
        return np.ones(len(self.response_tokens), dtype=np.uint8)

    @property
    def turns(self) -> int:
        """Model turns in the episode (1 for a single-turn one)."""
        return int(self.turn_ids.max()) + 1 if len(self.turn_ids) else 1

    @property
    def min_version(self) -> int:
        """The oldest policy version among the model's tokens (the episode's staleness is measured from it)."""
        versions = self.token_versions[self.token_versions >= 0] if len(self.token_mask) else self.token_versions
        return int(versions.min()) if len(versions) else self.policy_version


@dataclass(kw_only=True, slots=True)
class Batch:
    """A training batch of whole GRPO groups; ``batch_id`` is a hash of the sorted episode ids.

    Two layouts of the ``[R, T]`` token arrays (``input_ids``, ``loss_mask``, ``old_logprobs``, ``token_versions``);
    the per-episode arrays (``episode_ids``, ``group_ids``, ``advantages``, ``rewards``, ``prompt_lens``,
    ``seq_lens``) have ``B`` entries in both:

    * padded (``segment_ids`` empty, the default): row ``b`` is episode ``b`` (``R == B``), right-padded;
    * packed (buffer ``batching: pack``): a row holds several whole episodes one after the other, then padding.
      ``segment_ids[r, t]`` is the index (into ``episode_ids``) of the episode the token belongs to, ``-1`` at
      padding; ``position_ids[r, t]`` is the token's position within its own episode (0 at its first token, 0 at
      padding). A trainer attends only within a segment (block-diagonal causal mask) and restarts RoPE positions
      per segment; ``old_logprobs[r, t]`` scores ``input_ids[r, t]`` given the earlier tokens of its own segment.

    Version 2 adds ``episode_partitions`` and ``episode_offsets``: where the buffer read each episode on the
    ``episodes`` topic (provenance, ``streamforge/provenance.py``); a version-1 batch decodes with both empty.
    """

    SCHEMA: ClassVar[str] = "batch"
    VERSION: ClassVar[int] = 2
    OLDER_VERSIONS: ClassVar[tuple[int, ...]] = (1,)  # decoded into this class, the fields they lack defaulted

    batch_id: str
    episode_ids: list[str]
    group_ids: list[str]
    input_ids: np.ndarray = tensor("int32", 2)  # [B, T] prompt + response, right-padded
    loss_mask: np.ndarray = tensor("uint8", 2)  # [B, T] 1 at response tokens
    old_logprobs: np.ndarray = tensor("float32", 2)  # [B, T] behaviour logprobs, 0 off the mask
    token_versions: np.ndarray = tensor("int32", 2)  # [B, T] policy version per token, -1 off the mask
    advantages: np.ndarray = tensor("float32", 1)  # [B]
    rewards: np.ndarray = tensor("float32", 1)  # [B]
    prompt_lens: np.ndarray = tensor("int32", 1)  # [B]
    seq_lens: np.ndarray = tensor("int32", 1)  # [B]
    segment_ids: np.ndarray = tensor("int32", 2, default=True)  # [R, T] packed only: episode index, -1 at padding
    position_ids: np.ndarray = tensor("int32", 2, default=True)  # [R, T] packed only: position in its episode
    # [B] (v2) the episodes topic partition and offset each episode was read from; empty when not known
    episode_partitions: np.ndarray = tensor("int32", 1, default=True)
    episode_offsets: np.ndarray = tensor("int64", 1, default=True)
    pad_token_id: int = 0
    buffer_id: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=_now)

    @property
    def packed(self) -> bool:
        return self.segment_ids.size > 0

    def validate(self) -> None:
        b = len(self.episode_ids)
        if self.packed:
            self._validate_packing(b)
        elif self.input_ids.shape[0] != b:
            raise InvalidMessage(f"batch {self.batch_id}: {b} episode ids but {self.input_ids.shape[0]} rows")
        for name in ("loss_mask", "old_logprobs", "token_versions"):
            if getattr(self, name).shape != self.input_ids.shape:
                raise InvalidMessage(f"batch {self.batch_id}: {name} shape differs from input_ids")
        for name in ("advantages", "rewards", "prompt_lens", "seq_lens"):
            if getattr(self, name).shape != (b,):
                raise InvalidMessage(f"batch {self.batch_id}: {name} must have shape [{b}]")
        for name in ("episode_partitions", "episode_offsets"):
            if getattr(self, name).shape not in ((b,), (0,)):
                raise InvalidMessage(f"batch {self.batch_id}: {name} must have shape [{b}] or be empty")
        if not np.isfinite(self.advantages).all():
            raise InvalidMessage(f"batch {self.batch_id}: advantages are not finite")

    def _validate_packing(self, b: int) -> None:
        """Each episode one contiguous segment of ``seq_lens[e]`` tokens, positions 0.. within it."""
        seg, pos = self.segment_ids, self.position_ids
        if seg.shape != self.input_ids.shape or pos.shape != self.input_ids.shape:
            raise InvalidMessage(f"batch {self.batch_id}: segment_ids and position_ids must have input_ids' shape")
        flat = seg.ravel()
        if flat.size and (int(flat.min()) < -1 or int(flat.max()) >= b):
            raise InvalidMessage(f"batch {self.batch_id}: segment ids outside [-1, {b})")
        idx = np.flatnonzero(flat >= 0)
        counts = np.bincount(flat[idx], minlength=b)
        if self.seq_lens.shape != (b,) or not np.array_equal(counts, self.seq_lens):
            raise InvalidMessage(f"batch {self.batch_id}: segment sizes differ from seq_lens")
        # a segment is contiguous tokens of one row, with positions 0, 1, 2... (the trainer scores each token from
        # the one before it in the row)
        order = np.argsort(flat[idx], kind="stable")
        where = idx[order]  # flat index of each segment's tokens, segment by segment, in order
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        expect = np.arange(idx.size) - starts
        if not np.array_equal(pos.ravel()[where], expect):
            raise InvalidMessage(f"batch {self.batch_id}: position ids do not count 0.. within each segment")
        first = where - expect  # each token's segment start, if contiguous
        if not np.array_equal(first, where[starts]) or not np.array_equal(first // seg.shape[1], where // seg.shape[1]):
            raise InvalidMessage(f"batch {self.batch_id}: a segment is not contiguous within one row")


@dataclass(kw_only=True, slots=True)
class PolicyVersion:
    """A new policy: which version, from which step, and how a generator fetches its weights."""

    SCHEMA: ClassVar[str] = "policy_version"
    VERSION: ClassVar[int] = 1

    version: int
    step: int
    transport: str = "none"  # "nccl" | "torch-nccl" | "gloo" | "file" | "none" (initial weights from the model path)
    path: str = ""  # HF dir or safetensors file for the "file" transport and for late joiners
    address: str = ""  # host:port of the trainer's weight-transfer rendezvous, for collective transports
    trainer_id: str = ""
    batch_ids: list[str] = field(default_factory=list)  # provenance: the batches trained into this version
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent of the span that published it
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class TrainerProgress:
    """Where the trainer is: steps trained and the version it trains with, written after every step (KV key
    ``progress``). Buffers count the batches queued for the trainer from it, generators their quota."""

    SCHEMA: ClassVar[str] = "trainer_progress"
    VERSION: ClassVar[int] = 2
    OLDER_VERSIONS: ClassVar[tuple[int, ...]] = (1,)  # decoded into this class, ``groups`` defaulted (not reported)

    step: int  # optimizer steps trained
    version: int  # the policy version it trains with (its latest publication, in flight or done)
    published_step: int = 0  # the step that publication covers: steps after it are not published yet
    publish_every: int = 1  # trainer.publish_every: at most one version per this many steps
    consumed: int = -1  # records of the batches topic it has consumed (trained, refused, skipped); -1 = unknown
    # (v2) GRPO groups trained over all steps (restored with a checkpoint): generators count their quota in them;
    # -1 = not reported (a v1 record, or a trainer resumed from a checkpoint that did not record them)
    groups: int = -1
    trainer_id: str = ""
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class VersionAck:
    """A generator's report that it adopted (or failed to adopt) a policy version."""

    SCHEMA: ClassVar[str] = "version_ack"
    VERSION: ClassVar[int] = 1

    generator_id: str
    version: int
    ok: bool = True
    pause_ms: float = 0.0
    transfer_ms: float = 0.0
    error: str = ""
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class Membership:
    """A generator joining, beating or leaving (NATS membership subject)."""

    SCHEMA: ClassVar[str] = "membership"
    VERSION: ClassVar[int] = 1

    generator_id: str
    event: str  # "join" | "heartbeat" | "leave"
    version: int = -1
    host: str = ""
    pid: int = 0
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class SFTExample:
    """A prompt/completion pair for supervised fine-tuning (loss on completion tokens only)."""

    SCHEMA: ClassVar[str] = "sft_example"
    VERSION: ClassVar[int] = 1

    example_id: str
    prompt: str
    completion: str
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class DropRecord:
    """The buffer's durable decision to drop episodes (stale, zero_variance, overlong, duplicate, incomplete)."""

    SCHEMA: ClassVar[str] = "drop_record"
    VERSION: ClassVar[int] = 1

    episode_ids: list[str]
    reason: str
    group_id: str = ""
    detail: str = ""
    buffer_id: str = ""
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class UnansweredPrompt:
    """A generator's durable record that a prompt it took from the ``prompts`` topic produced no Episode, and why:
    every episode of its group was dead-lettered (``episode_reasons``: ``{reason: episodes}``, e.g. an environment
    that refused every reset: ``{"env_step_failed": 4}``); ``reason`` is their one reason, or ``mixed``. Written
    and acknowledged before the prompt's offset is committed; ``partition``/``offset`` name the prompt on the
    ``prompts`` topic (the audit's ``prompts.unanswered_by_reason``, ``streamforge/audit.py``)."""

    SCHEMA: ClassVar[str] = "unanswered_prompt"
    VERSION: ClassVar[int] = 1

    prompt_id: str
    partition: int
    offset: int
    reason: str
    detail: str = ""
    episode_reasons: dict[str, Any] = field(default_factory=dict)
    generator_id: str = ""
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class DeadLetter:
    """Whatever could not be handled: the raw bytes, where they came from and why."""

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1

    source: str  # topic or subject
    reason: str  # short machine-readable reason: malformed, unknown_schema, oversized, invalid, reward_error...
    detail: str = ""
    partition: int = -1
    offset: int = -1
    key: bytes = b""
    value: bytes = b""
    role: str = ""
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class ServiceBeat:
    """A replica of a service saying where it serves, how much it holds and how long to trust it: the value of key
    ``<service>.<replica_id>`` of the KV bucket ``{prefix}_services``, rewritten every ``heartbeat_s`` with a
    time-to-live (``runtime/services.py``). ``load`` counts what it holds now (an environment's live sessions, a
    reward service's batches in flight) against ``capacity``."""

    SCHEMA: ClassVar[str] = "service_beat"
    VERSION: ClassVar[int] = 1

    service: str
    replica_id: str
    kind: str = ""  # "env" | "reward" | any other kind of service
    address: str = ""  # how callers reach it: ws://host:port (an environment), a NATS subject (request/reply)
    capacity: int = 1
    load: int = 0
    state: str = "serving"  # "serving" | "draining" (finishing what it holds, takes nothing new)
    heartbeat_s: float = 1.0  # how often it beats
    health_timeout_s: float = 3.0  # a caller that heard nothing from it for longer routes nothing to it
    seq: int = 0  # beats since it started
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # what callers of this kind need (an env's action field)
    created_at: float = field(default_factory=_now)

    def validate(self) -> None:
        if self.capacity < 1 or self.load < 0:
            raise InvalidMessage(f"service beat {self.replica_id}: capacity {self.capacity}, load {self.load}")
        if not (math.isfinite(self.health_timeout_s) and self.health_timeout_s > 0):
            raise InvalidMessage(f"service beat {self.replica_id}: health_timeout_s {self.health_timeout_s}")


@dataclass(kw_only=True, slots=True)
class ServiceFault:
    """A replica's answer to a request it could not serve (``code``: malformed, unknown_request, handler_error,
    overloaded, draining); ``retriable``: another replica may serve the same request."""

    SCHEMA: ClassVar[str] = "service_fault"
    VERSION: ClassVar[int] = 1

    code: str
    detail: str = ""
    replica_id: str = ""
    retriable: bool = False
    created_at: float = field(default_factory=_now)


@dataclass(kw_only=True, slots=True)
class RewardRequest:
    """A batch of responses for a reward service to score, column by column (row ``i`` is ``responses[i]`` to the
    prompt ``prompt_ids[i]``); ``metadata`` holds each prompt's metadata by prompt id."""

    SCHEMA: ClassVar[str] = "reward_request"
    VERSION: ClassVar[int] = 1

    request_id: str = ""
    prompt_ids: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=_now)

    def validate(self) -> None:
        n = len(self.responses)
        if any(len(col) != n for col in (self.prompt_ids, self.tasks, self.prompt_texts, self.answers)):
            raise InvalidMessage(f"reward request {self.request_id}: columns differ in length")


@dataclass(kw_only=True, slots=True)
class RewardReply:
    """A reward service's scores for one ``RewardRequest``, row by row; ``errors[i]`` is empty where ``scores[i]``
    is good, else why that row has no score (its score is then NaN)."""

    SCHEMA: ClassVar[str] = "reward_reply"
    VERSION: ClassVar[int] = 1

    request_id: str = ""
    scores: np.ndarray = tensor("float64", 1, default=True)
    errors: list[str] = field(default_factory=list)
    replica_id: str = ""
    seconds: float = 0.0
    created_at: float = field(default_factory=_now)

    def validate(self) -> None:
        if len(self.errors) != len(self.scores):
            raise InvalidMessage(f"reward reply {self.request_id}: {len(self.scores)} scores, {len(self.errors)} errors")


ALL_SCHEMAS: tuple[type, ...] = (
    Prompt, Episode, Batch, PolicyVersion, TrainerProgress, VersionAck, Membership, SFTExample, DropRecord,
    UnansweredPrompt, DeadLetter, ServiceBeat, ServiceFault, RewardRequest, RewardReply,
)


def fields_of(cls: type) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cls)
