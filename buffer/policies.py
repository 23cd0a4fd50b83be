"""The replay buffer's policies as plain functions: advantages, filters, batching, the ``Batch`` layout.

Nothing here touches a broker or a clock; ``buffer/state.py`` calls these and unit tests exercise them directly.

Advantages of one GRPO group with (shaped) rewards ``r_1..r_n``, ``mean = (1/n) sum_j r_j``:

* ``grpo``    ``A_i = (r_i - mean) / (std + eps)`` with the sample standard deviation
  ``std = sqrt(sum_j (r_j - mean)^2 / (n - 1))`` (as TRL's GRPOTrainer, ``torch.std``); ``A_i = 0`` when ``n = 1``.
* ``dr_grpo`` ``A_i = r_i - mean`` (Dr. GRPO: no std normalisation, no length bias).
* ``rloo``    ``A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) * (r_i - mean)``; ``A_i = 0`` when ``n = 1``.

Reward shaping before the advantage: ``r' = clip(scale * r, -clip, clip)`` (no clipping when ``clip == 0``).

Filters (each counted by its reason, see ``Reason``):

* ``stale``: an episode whose oldest token version is older than ``latest - max_policy_lag``;
* ``fenced``: an episode of a generator the trainer fenced, sampled with a version newer than the last one that
  generator acknowledged (the rule is ``weightsync.members.drop_for_fence``; the record is the KV key ``fenced``);
* ``overlong``: more than ``max_response_tokens`` response tokens, or (``filter_truncated``) finished by length;
* ``zero_variance``: a group whose kept episodes all have the same shaped reward (DAPO dynamic sampling), which
  includes a group left with fewer than two episodes: it carries no learning signal for any advantage above.

Layout (``batching``): ``pad`` puts one episode per row, right-padded to the longest; ``pack`` places whole
episodes into rows of ``pack_row_tokens`` (0: the longest episode) first-fit by decreasing length (ties by batch
order, so the layout is deterministic), several per row, with ``segment_ids`` and ``position_ids`` telling the
trainer where each sequence starts (``topics/schemas.py``).

Batching never splits a group. ``plan_batches`` takes groups in the given order and cuts a batch after
``groups_per_batch`` groups, or, with a token budget, before the group that would push the batch's cost over the
budget (cost = rows x longest row when ``budget_count == "padded"``, the sum of row lengths when ``"tokens"``). A
group larger than the budget alone forms its own batch. ``batch_id`` is a hash of the sorted episode ids, so the
same episodes always give the same id whatever their order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from topics.schemas import Batch, Episode
from weightsync.members import drop_for_fence


class Reason:
    """Every reason an episode can leave the buffer without a batch (the keys of ``dropped`` in the audit)."""

    STALE = "stale"
    FENCED = "fenced"  # sampled by a fenced generator with weights the trainer never saw it adopt
    ZERO_VARIANCE = "zero_variance"
    OVERLONG = "overlong"
    DUPLICATE = "duplicate"  # a second record of an episode held or decided by this buffer
    INCOMPLETE = "incomplete"  # its group timed out with fewer than group_size episodes
    LATE = "late"  # it arrived after its group had been decided
    MALFORMED = "malformed"  # undecodable or invalid: dead-lettered, not a DropRecord

    ALL = (STALE, FENCED, ZERO_VARIANCE, OVERLONG, DUPLICATE, INCOMPLETE, LATE, MALFORMED)


ADVANTAGES = ("grpo", "dr_grpo", "rloo")


def shape_rewards(rewards: Sequence[float] | np.ndarray, *, scale: float = 1.0, clip: float = 0.0) -> list[float]:
    """``clip(scale * r, -clip, clip)`` (``clip <= 0`` means no clipping)."""
    r = [float(x) * scale for x in rewards]
    if clip > 0:
        r = [min(max(x, -clip), clip) for x in r]
    return r


def group_advantages(rewards: Sequence[float] | np.ndarray, method: str = "grpo", *, eps: float = 1e-4) -> np.ndarray:
    """Per-episode advantages of one group (formulas in the module docstring), as float32.

    Plain Python arithmetic: groups are small, and numpy's per-call overhead dominated the buffer's profile.
    """
    if method not in ADVANTAGES:
        raise ValueError(f"unknown advantage {method!r} (expected one of {ADVANTAGES})")
    r = [float(x) for x in rewards]
    n = len(r)
    if n < 2:
        return np.zeros(n, dtype=np.float32)
    mean = math.fsum(r) / n
    centred = [x - mean for x in r]
    if method == "grpo":
        std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
        adv = [c / (std + eps) for c in centred]
    elif method == "dr_grpo":
        adv = centred
    else:  # rloo
        adv = [c * (n / (n - 1)) for c in centred]
    return np.asarray(adv, dtype=np.float32)


def is_zero_variance(rewards: Sequence[float] | np.ndarray, *, tol: float = 1e-9) -> bool:
    """True when fewer than two rewards, or all equal within ``tol``: the group has no learning signal."""
    r = [float(x) for x in rewards]
    return len(r) < 2 or max(r) - min(r) <= tol


def is_stale(ep: Episode, latest_version: int | None, max_policy_lag: int) -> bool:
    """True when the episode's oldest token version is below ``latest - max_policy_lag`` (no latest: never)."""
    return latest_version is not None and ep.min_version < latest_version - max_policy_lag


def is_fenced(ep: Episode, fenced: Mapping[str, int] | None) -> bool:
    """True when ``ep``'s generator is fenced and a token was sampled with a version newer than the last one
    that generator acknowledged (``fenced`` maps generator id -> last acknowledged version)."""
    if not fenced or ep.generator_id not in fenced:
        return False
    newest = int(ep.token_versions.max()) if len(ep.token_versions) else ep.policy_version
    return drop_for_fence(dict(fenced), ep.generator_id, newest)


def is_overlong(ep: Episode, max_response_tokens: int = 0, *, filter_truncated: bool = False) -> bool:
    """True when the response exceeds ``max_response_tokens`` (> 0), or was cut by length and that is filtered."""
    if max_response_tokens > 0 and len(ep.response_tokens) > max_response_tokens:
        return True
    return filter_truncated and ep.finish_reason == "length"


def batch_id_of(episode_ids: Iterable[str]) -> str:
    """Deterministic id of a batch: sha256 over the sorted episode ids (first 32 hex digits)."""
    h = hashlib.sha256()
    for eid in sorted(episode_ids):
        h.update(eid.encode())
        h.update(b"\n")
    return h.hexdigest()[:32]


@dataclass(slots=True)
class ScoredGroup:
    """A group that passed the filters: its kept episodes (sorted by id) and their advantages."""

    group_id: str
    episodes: list[Episode]
    advantages: np.ndarray  # float32 [len(episodes)]
    partition: int = -1

    @property
    def episode_ids(self) -> list[str]:
        return [e.episode_id for e in self.episodes]

    @property
    def row_lengths(self) -> list[int]:
        return [len(e.prompt_tokens) + len(e.response_tokens) for e in self.episodes]


@dataclass(slots=True)
class GroupVerdict:
    """What the filters decided for one group: a ``ScoredGroup`` (or None) and the dropped ids by reason."""

    kept: ScoredGroup | None
    dropped: dict[str, list[str]] = field(default_factory=dict)


def score_group(
    group_id: str,
    episodes: Sequence[Episode],
    *,
    latest_version: int | None,
    max_policy_lag: int,
    max_response_tokens: int = 0,
    filter_truncated: bool = False,
    filter_zero_variance: bool = True,
    advantage: str = "grpo",
    advantage_eps: float = 1e-4,
    reward_scale: float = 1.0,
    reward_clip: float = 0.0,
    partition: int = -1,
    fenced: Mapping[str, int] | None = None,
) -> GroupVerdict:
    """Apply the episode filters (overlong, then fenced, then stale), the group filter, and compute advantages.

    Episodes are sorted by ``episode_id`` first so the result does not depend on arrival order.
    """
    dropped: dict[str, list[str]] = {}
    kept: list[Episode] = []
    for ep in sorted(episodes, key=lambda e: e.episode_id):
        if is_overlong(ep, max_response_tokens, filter_truncated=filter_truncated):
            dropped.setdefault(Reason.OVERLONG, []).append(ep.episode_id)
        elif is_fenced(ep, fenced):
            dropped.setdefault(Reason.FENCED, []).append(ep.episode_id)
        elif is_stale(ep, latest_version, max_policy_lag):
            dropped.setdefault(Reason.STALE, []).append(ep.episode_id)
        else:
            kept.append(ep)
    if not kept:
        return GroupVerdict(None, dropped)
    rewards = shape_rewards([e.reward for e in kept], scale=reward_scale, clip=reward_clip)
    if filter_zero_variance and is_zero_variance(rewards):
        dropped.setdefault(Reason.ZERO_VARIANCE, []).extend(e.episode_id for e in kept)
        return GroupVerdict(None, dropped)
    adv = group_advantages(rewards, advantage, eps=advantage_eps)
    return GroupVerdict(ScoredGroup(group_id, kept, adv, partition), dropped)


def batch_cost(groups: Sequence[ScoredGroup], budget_count: str = "padded") -> int:
    """Token cost of a batch of groups: rows x longest row ("padded") or the sum of row lengths ("tokens")."""
    lengths = [n for g in groups for n in g.row_lengths]
    if not lengths:
        return 0
    if budget_count == "tokens":
        return sum(lengths)
    return len(lengths) * max(lengths)


def plan_batches(
    groups: Sequence[ScoredGroup],
    *,
    groups_per_batch: int,
    token_budget: int = 0,
    budget_count: str = "padded",
    final: bool = False,
) -> tuple[list[list[ScoredGroup]], list[ScoredGroup]]:
    """Cut ``groups`` (in order) into full batches; returns ``(batches, remainder)``.

    A batch is full at ``groups_per_batch`` groups, or (``token_budget > 0``) when the next group would push its
    cost over the budget. With ``final`` the remainder becomes a last, partial batch.
    """
    batches: list[list[ScoredGroup]] = []
    current: list[ScoredGroup] = []
    for g in groups:
        if token_budget > 0:
            if current and batch_cost([*current, g], budget_count) > token_budget:
                batches.append(current)
                current = []
            current.append(g)
            if batch_cost(current, budget_count) >= token_budget:
                batches.append(current)
                current = []
        else:
            current.append(g)
            if len(current) >= groups_per_batch:
                batches.append(current)
                current = []
    if final and current:
        batches.append(current)
        current = []
    return batches, current


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` placed into rows of ``row_tokens``: first fit, longest first (ties by index).

    A sequence longer than ``row_tokens`` gets a row of its own (the caller widens the rows to fit it).
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(row_tokens - n)
    return rows


def build_batch(
    groups: Sequence[ScoredGroup],
    *,
    pad_token_id: int = 0,
    pad_to_multiple: int = 1,
    buffer_id: str = "",
    created_at: float | None = None,
    pack_row_tokens: int | None = None,
) -> Batch:
    """Lay out groups as a ``Batch`` (conventions in ``topics/schemas.py``).

    Row ``b`` is ``prompt + response`` right-padded with ``pad_token_id`` to ``T`` (the longest row rounded up to
    ``pad_to_multiple``). ``loss_mask`` is 1 exactly at the model's response tokens (``Episode.model_mask``: a
multi-turn episode's environment tokens are 0), ``old_logprobs`` holds the behaviour
    logprob of the token at that position (0 elsewhere), ``token_versions`` the version that sampled it (-1
    elsewhere). ``group_ids`` has one entry per episode. ``rewards`` are the raw episode rewards.

    With ``pack_row_tokens`` (not None) the batch is packed instead (module docstring): rows of that many tokens
    (0: the longest episode; at least the longest, rounded up to ``pad_to_multiple``).
    """
    episodes = [e for g in groups for e in g.episodes]
    if not episodes:
        raise ValueError("a batch needs at least one episode")
    if pack_row_tokens is not None:
        return _packed(groups, episodes, pack_row_tokens, pad_token_id=pad_token_id,
                       pad_to_multiple=pad_to_multiple, buffer_id=buffer_id, created_at=created_at)
    lengths = [len(e.prompt_tokens) + len(e.response_tokens) for e in episodes]
    t = max(lengths)
    if pad_to_multiple > 1:
        t = -(-t // pad_to_multiple) * pad_to_multiple
    b = len(episodes)
    input_ids = np.full((b, t), pad_token_id, dtype=np.int32)
    loss_mask = np.zeros((b, t), dtype=np.uint8)
    old_logprobs = np.zeros((b, t), dtype=np.float32)
    token_versions = np.full((b, t), -1, dtype=np.int32)
    prompt_lens = np.zeros(b, dtype=np.int32)
    for i, ep in enumerate(episodes):
        p, r = len(ep.prompt_tokens), len(ep.response_tokens)
        input_ids[i, :p] = ep.prompt_tokens
        input_ids[i, p:p + r] = ep.response_tokens
        loss_mask[i, p:p + r] = ep.model_mask
        old_logprobs[i, p:p + r] = ep.logprobs
        token_versions[i, p:p + r] = ep.token_versions
        prompt_lens[i] = p
    layout = {"input_ids": input_ids, "loss_mask": loss_mask, "old_logprobs": old_logprobs,
              "token_versions": token_versions, "prompt_lens": prompt_lens}
    return _batch(groups, episodes, lengths, layout, rows=b, width=t, packed=False, pad_token_id=pad_token_id,
                  buffer_id=buffer_id, created_at=created_at)


def _batch(groups: Sequence[ScoredGroup], episodes: list[Episode], lengths: list[int], layout: dict[str, np.ndarray],
           *, rows: int, width: int, packed: bool, pad_token_id: int, buffer_id: str,
           created_at: float | None) -> Batch:
    """The ``Batch`` around a layout's ``[rows, width]`` arrays (and its ``prompt_lens``): the fields that do not
    depend on the layout, and the stats (with ``rows`` when ``packed``)."""
    rewards = np.asarray([e.reward for e in episodes], dtype=np.float32)
    stats = _stats(groups, episodes, rewards, rows=rows, width=width)
    if packed:
        stats["rows"] = float(rows)
    ids = [e.episode_id for e in episodes]
    kwargs = {} if created_at is None else {"created_at": created_at}
    return Batch(
        batch_id=batch_id_of(ids),
        episode_ids=ids,
        group_ids=[g.group_id for g in groups for _ in g.episodes],
        advantages=np.concatenate([g.advantages for g in groups]).astype(np.float32),
        rewards=rewards,
        seq_lens=np.asarray(lengths, dtype=np.int32),
        pad_token_id=pad_token_id,
        buffer_id=buffer_id,
        stats=stats,
        **layout,
        **kwargs,
    )


def _stats(groups: Sequence[ScoredGroup], episodes: list[Episode], rewards: np.ndarray, *, rows: int,
           width: int) -> dict[str, float]:
    """A batch's summary (plain Python over the episodes: numpy's per-call cost dominated it on [B, T] arrays)."""
    b = len(episodes)
    r = rewards.tolist()
    mean = math.fsum(r) / b
    resp = [len(e.response_tokens) for e in episodes]
    versions = np.concatenate([e.token_versions for e in episodes])
    versions = versions[versions >= 0]  # environment tokens of multi-turn episodes carry -1
    tokens = sum(len(e.prompt_tokens) for e in episodes) + sum(resp)
    return {
        "groups": float(len(groups)),
        "episodes": float(b),
        "reward_mean": mean,
        "reward_std": math.sqrt(math.fsum((x - mean) ** 2 for x in r) / b),
        "response_len_mean": sum(resp) / b,
        "padding_fraction": 1.0 - tokens / (rows * width),
        "min_version": float(versions.min()) if versions.size else -1.0,
        "max_version": float(versions.max()) if versions.size else -1.0,
        "env/turns_mean": sum(e.turns for e in episodes) / b,
        "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / b,
    }


def _packed(groups: Sequence[ScoredGroup], episodes: list[Episode], row_tokens: int, *, pad_token_id: int,
            pad_to_multiple: int, buffer_id: str, created_at: float | None) -> Batch:
    """``build_batch``'s packed layout: rows of ``row_tokens`` (see the module docstring), one concatenate per
    field over the pieces of every row."""
    plens = [len(e.prompt_tokens) for e in episodes]
    rlens = [len(e.response_tokens) for e in episodes]
    lengths = [p + r for p, r in zip(plens, rlens)]
    t = max(row_tokens, max(lengths))
    if pad_to_multiple > 1:
        t = -(-t // pad_to_multiple) * pad_to_multiple
    rows = pack_rows(lengths, t)
    pad = np.full(t, pad_token_id, dtype=np.int32)
    zeros = np.zeros(t, dtype=np.float32)
    minus = np.full(t, -1, dtype=np.int32)
    arange = np.arange(t, dtype=np.int32)
    ids_parts: list[np.ndarray] = []
    lp_parts: list[np.ndarray] = []
    ver_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    seg_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    ones = np.ones(t, dtype=np.uint8)
    zeros8 = np.zeros(t, dtype=np.uint8)
    for row in rows:
        used = 0
        for i in row:
            e, p, r = episodes[i], plens[i], rlens[i]
            ids_parts += (e.prompt_tokens, e.response_tokens)
            lp_parts += (zeros[:p], e.logprobs)
            ver_parts += (minus[:p], e.token_versions)
            mask_parts += (zeros8[:p], e.token_mask if len(e.token_mask) else ones[:r])
            seg_parts.append(np.full(p + r, i, dtype=np.int32))
            pos_parts.append(arange[:p + r])
            used += p + r
        if used < t:
            ids_parts.append(pad[:t - used])
            lp_parts.append(zeros[:t - used])
            ver_parts.append(minus[:t - used])
            mask_parts.append(zeros8[:t - used])
            seg_parts.append(minus[:t - used])
            pos_parts.append(np.zeros(t - used, dtype=np.int32))
    n_rows = len(rows)
    layout = {"input_ids": ids_parts, "loss_mask": mask_parts, "old_logprobs": lp_parts, "token_versions": ver_parts,
              "segment_ids": seg_parts, "position_ids": pos_parts}
    arrays = {name: np.concatenate(parts).reshape(n_rows, t) for name, parts in layout.items()}
    arrays["prompt_lens"] = np.asarray(plens, dtype=np.int32)
    return _batch(groups, episodes, lengths, arrays, rows=n_rows, width=t, packed=True, pad_token_id=pad_token_id,
                  buffer_id=buffer_id, created_at=created_at)
