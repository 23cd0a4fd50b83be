"""``streamforge audit``: reconcile the prompts consumed and episodes produced with what was batched, dropped, trained.

Sources: the ``prompts``, ``episodes``, ``batches``, ``drops``, ``unanswered`` and ``dead-letter`` topics of the run
(read whole, from offset 0 to the high-water marks), the generators' and the buffers' committed offsets, and the
trainer's ledger ``<run_dir>/trainer/ledger.jsonl`` (one line per optimizer step: ``{"step", "policy_version",
"batch_ids", "time"}``).

Everything is counted in distinct episode ids (delivery is at-least-once, so a record may repeat):

* ``produced``: distinct valid episode ids on ``episodes``; ``duplicate_records``: valid records beyond those;
* ``batched``: distinct ids in any batch; ``batches``: distinct batch ids;
* ``dropped``: by reason, distinct ids of the buffer's ``DropRecord``s (``duplicate`` counts duplicate records,
  which are not decisions about an episode), plus ``malformed``: dead letters whose source is ``episodes``;
* ``pending``: produced ids neither batched nor dropped whose every record lies at or beyond the buffers' committed
  offset of its partition: not consumed for good yet (held by a buffer when the run stopped, or never read); a
  restarted buffer reads them again;
* ``lost``: produced ids neither batched nor dropped (for any reason but ``duplicate``) nor pending;
* ``batched_and_dropped``: ids with both outcomes; ``in_two_batches``: ids in two batches with different ids;
* ``trained``: distinct ids of the batches named in the ledger; ``trained_twice``: ids trained in more than one
  optimizer step (two different batch ids holding it, or one batch id trained twice);
* ``refused_batches``: distinct batch ids the trainer dead-lettered as ``already_trained`` (a zombie buffer's batch
  holding episodes it had trained, ``consumers/ledger.py``); ``refused_episodes``: distinct ids in them; and
  ``in_two_batches_refused``: of the ``in_two_batches`` ids, those whose other batches were all refused or never
  trained, i.e. trained at most once;
* ``stale_batches``: distinct batch ids the trainer did not train because a token in them was more than
  ``staleness.max_versions`` versions behind when their turn came (dead-lettered as ``stale``);
  ``stale_batch_episodes``: distinct ids in them; ``stale_fraction``: episodes dropped as stale by the buffers
  plus those, over ``produced`` (generation no step used because it was too old);
* ``reconciles``: ``produced == batched + sum(dropped except duplicate, malformed) + pending`` with nothing lost,
  nothing both batched and dropped, nothing decided that was never produced, and no prompt lost;
* ``episodes_lost``: the episodes lost (above); ``lost``: ``episodes_lost + prompts.lost``.

The prompts (``prompts``; ``reconcile_prompts``), from the ``prompts`` topic, the generators group's committed
offsets on it (``{prefix}.generators``), the episodes, the dead letters of prompts and the ``unanswered`` topic. A
prompt is a record of the ``prompts`` topic, named by its partition and offset (two records may carry one
``prompt_id``: a restarted feeder sends its source again):

* ``source``: ``topic``, or ``local`` when the generators read prompts from a local source
  (``generator.prompt_source``): nothing is consumed from the topic and nothing is committed, so every count
  below is 0 and nothing about the prompts is checked;
* ``records``: records on the topic; ``consumed``: those below the committed offset of their partition: the
  generators are done with them for good; ``pending``: those at or beyond it (in flight, or not taken yet when the
  run stopped; a restarted generator takes them again): neither consumed nor lost;
* of the consumed, exactly one outcome each (the first that applies): ``answered``: an Episode record of it is on
  ``episodes`` (its ``prompt_partition``/``prompt_offset``; an Episode without them, from a version-2 producer,
  answers every prompt with its ``prompt_id``); ``dead_lettered``: a dead letter whose source is the prompts topic
  names its partition and offset (undecodable, or no engine can take it: ``invalid``);
  ``unanswered_by_reason``: ``{reason: prompts}`` of an ``UnansweredPrompt`` record naming it (every episode of its
  group was dead-lettered, e.g. ``env_step_failed`` for an environment that refused every reset); ``lost``: none
  of these: a generator committed past it without producing anything or saying why;
* ``duplicate_ids``: consumed records whose ``prompt_id`` an earlier consumed record carries;
* ``samples.lost``: up to 10 lost prompts as ``{"partition", "offset", "prompt_id"}`` (``prompt_id`` None when the
  record does not decode).

Records repeat (at-least-once): a prompt redone after a crash has its Episodes (or its ``UnansweredPrompt``) twice;
it counts once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from consumers.ledger import ALREADY_TRAINED, STALE
from topics import codec
from topics.admin import describe_topics, group_offsets, read_topic
from topics.errors import CodecError
from topics.schemas import Batch, DeadLetter, DropRecord, Episode, Prompt, UnansweredPrompt

NOT_DECISIONS = ("duplicate", "malformed")
SAMPLE = 10


def read_ledger(path: Path) -> list[dict[str, Any]] | None:
    """The ledger's lines (a torn last line is ignored); None when there is no ledger."""
    if not path.exists():
        return None
    out = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return out


def reconcile(
    episode_ids: Iterable[str | None],
    batches: Iterable[tuple[str, list[str]]],
    drops: Iterable[tuple[str, list[str]]],
    *,
    malformed: int = 0,
    ledger: list[dict[str, Any]] | None = None,
    refused: Iterable[tuple[str, list[str]]] = (),
    stale: Iterable[tuple[str, list[str]]] = (),
    uncommitted: Iterable[str] = (),
) -> dict[str, Any]:
    """The audit as a pure function: ``episode_ids`` per record (None = undecodable), ``batches`` as
    ``(batch_id, episode_ids)``, ``drops`` as ``(reason, episode_ids)``, the ledger's lines, and the batches the
    trainer refused as already trained, as ``(batch_id, episode_ids)``; ``uncommitted``: the ids all of whose
    records lie at or beyond the buffers' committed offsets."""
    records = 0
    produced: set[str] = set()
    undecodable = 0
    for eid in episode_ids:
        records += 1
        if eid is None:
            undecodable += 1
        else:
            produced.add(eid)
    batch_members: dict[str, set[str]] = {}
    batch_records = 0
    for batch_id, ids in batches:
        batch_records += 1
        batch_members.setdefault(batch_id, set()).update(ids)
    batches_of: dict[str, set[str]] = defaultdict(set)
    for batch_id, ids in batch_members.items():
        for eid in ids:
            batches_of[eid].add(batch_id)
    batched = set(batches_of)
    by_reason: dict[str, set[str]] = defaultdict(set)
    duplicate_ids = 0
    for reason, ids in drops:
        if reason == "duplicate":
            duplicate_ids += len(ids)
        else:
            by_reason[reason].update(ids)
    dropped_ids: set[str] = set().union(*by_reason.values()) if by_reason else set()
    dropped = {reason: len(ids) for reason, ids in sorted(by_reason.items())}
    dropped["duplicate"] = duplicate_ids
    dropped["malformed"] = malformed
    decided = batched | dropped_ids
    pending = (produced - decided) & set(uncommitted)
    lost = produced - decided - pending
    unknown = decided - produced
    both = batched & dropped_ids
    in_two = {e for e, b in batches_of.items() if len(b) > 1}

    trained_steps: Counter[str] = Counter()
    unknown_batches: set[str] = set()
    for line in ledger or []:
        ids: set[str] = set()
        for batch_id in set(line.get("batch_ids", [])):
            members = batch_members.get(batch_id)
            if members is None:
                unknown_batches.add(batch_id)
                continue
            ids |= members
        trained_steps.update(ids)
    trained_twice = {e for e, n in trained_steps.items() if n > 1}
    refused_members: dict[str, set[str]] = {}
    for batch_id, ids in refused:
        refused_members.setdefault(batch_id, set()).update(ids)
    refused_ids: set[str] = set().union(*refused_members.values()) if refused_members else set()
    trained_batches = {b for line in ledger or [] for b in line.get("batch_ids", [])}
    in_two_refused = {e for e in in_two
                      if sum(1 for b in batches_of[e] if b in trained_batches and b not in refused_members) <= 1
                      and any(b in refused_members for b in batches_of[e])}
    decided_total = len(batched) + sum(len(v) for v in by_reason.values())
    stale_members: dict[str, set[str]] = {}
    for batch_id, ids in stale:
        stale_members.setdefault(batch_id, set()).update(ids)
    stale_ids = set().union(*stale_members.values()) if stale_members else set()
    stale_total = len(by_reason.get("stale", set()) | stale_ids)
    return {
        "records": records,
        "produced": len(produced),
        "duplicate_records": records - undecodable - len(produced),
        "batched": len(batched),
        "batches": len(batch_members),
        "batch_records": batch_records,
        "dropped": dropped,
        "pending": len(pending),
        "lost": len(lost),
        "batched_and_dropped": len(both),
        "in_two_batches": len(in_two),
        "unknown_decided": len(unknown),
        "ledger_found": ledger is not None,
        "trained_steps": len(ledger or []),
        "trained": len(trained_steps),
        "trained_twice": len(trained_twice),
        "trained_unknown_batches": len(unknown_batches),
        "refused_batches": len(refused_members),
        "refused_episodes": len(refused_ids),
        "in_two_batches_refused": len(in_two_refused),
        "stale_batches": len(stale_members),
        "stale_batch_episodes": len(stale_ids),
        "stale_fraction": round(stale_total / len(produced), 4) if produced else 0.0,
        "reconciles": not lost and not both and not unknown and decided_total + len(pending) == len(produced),
        "samples": {
            "lost": sorted(lost)[:SAMPLE],
            "in_two_batches": sorted(in_two)[:SAMPLE],
            "trained_twice": sorted(trained_twice)[:SAMPLE],
            "batched_and_dropped": sorted(both)[:SAMPLE],
        },
    }


def reconcile_prompts(
    prompts: Iterable[tuple[int, int, str | None]],
    committed: Mapping[int, int],
    answers: Iterable[tuple[str, int, int]],
    dead_lettered: Iterable[tuple[int, int]],
    unanswered: Iterable[tuple[int, int, str]],
) -> dict[str, Any]:
    """The prompts' audit as a pure function (keys in the module docstring): ``prompts`` as ``(partition, offset,
    prompt_id)`` per record of the topic (None = undecodable), ``committed`` the generators group's next offset
    per partition, ``answers`` as ``(prompt_id, prompt_partition, prompt_offset)`` per Episode record (-1, -1 =
    not known), ``dead_lettered`` the ``(partition, offset)`` of the prompts' dead letters, ``unanswered`` as
    ``(partition, offset, reason)`` per ``UnansweredPrompt`` record."""
    records = 0
    consumed: dict[tuple[int, int], str | None] = {}
    pending = 0
    for partition, offset, prompt_id in prompts:
        records += 1
        if offset < committed.get(partition, 0):
            consumed[(partition, offset)] = prompt_id
        else:
            pending += 1
    answered_at: set[tuple[int, int]] = set()
    answered_ids: set[str] = set()
    for prompt_id, partition, offset in answers:
        if partition >= 0 and offset >= 0:
            answered_at.add((partition, offset))
        else:
            answered_ids.add(prompt_id)
    dead = set(dead_lettered)
    reason_at: dict[tuple[int, int], str] = {}
    for partition, offset, reason in unanswered:
        reason_at.setdefault((partition, offset), reason or "unstated")
    answered = dead_count = 0
    by_reason: Counter[str] = Counter()
    lost: list[tuple[int, int]] = []
    seen_ids: set[str] = set()
    duplicate_ids = 0
    for at, prompt_id in sorted(consumed.items()):
        if prompt_id is not None:
            duplicate_ids += prompt_id in seen_ids
            seen_ids.add(prompt_id)
        if at in answered_at or (prompt_id is not None and prompt_id in answered_ids):
            answered += 1
        elif at in dead:
            dead_count += 1
        elif at in reason_at:
            by_reason[reason_at[at]] += 1
        else:
            lost.append(at)
    return {
        "source": "topic",
        "records": records,
        "consumed": len(consumed),
        "answered": answered,
        "dead_lettered": dead_count,
        "unanswered_by_reason": dict(sorted(by_reason.items())),
        "lost": len(lost),
        "pending": pending,
        "duplicate_ids": duplicate_ids,
        "samples": {"lost": [{"partition": p, "offset": o, "prompt_id": consumed[(p, o)]} for p, o in lost[:SAMPLE]]},
    }


def local_prompts() -> dict[str, Any]:
    """The prompts' block of a run whose generators read a local source: nothing consumed, nothing checked."""
    return {"source": "local", "records": 0, "consumed": 0, "answered": 0, "dead_lettered": 0,
            "unanswered_by_reason": {}, "lost": 0, "pending": 0, "duplicate_ids": 0, "samples": {"lost": []}}


def with_prompts(result: dict[str, Any], prompts: dict[str, Any]) -> dict[str, Any]:
    """The episodes' audit (``reconcile``) with the prompts' block: ``lost`` counts both, a lost prompt breaks
    ``reconciles``."""
    result["prompts"] = prompts
    result["episodes_lost"] = result["lost"]
    result["lost"] = result["lost"] + prompts["lost"]
    result["reconciles"] = bool(result["reconciles"] and not prompts["lost"])
    return result


def _batch_id_in(detail: str) -> str:
    """The batch id a trainer's dead-letter detail starts with (``"batch <id>: ..."``), or ''."""
    head, _, _ = detail.partition(":")
    return head.removeprefix("batch ").strip() if head.startswith("batch ") else ""


async def run_audit(config: Any) -> dict[str, Any]:
    """Read the run's topics and ledger and reconcile them (see the module docstring for every key)."""
    names, kafka = config.names, config.kafka
    # the generators' prompt offsets first: a generator commits a prompt only once its group (or its reason) is
    # acknowledged, so every prompt below this snapshot has its records in the topics read after it; read later, a
    # live run's newer commits would count prompts whose episodes were read before they were produced as lost
    prompts_committed = await group_offsets(kafka, names.generators_group, names.prompts)
    episodes = await read_topic(kafka, names.episodes, expect=Episode)
    committed = await group_offsets(kafka, names.buffers_group, names.episodes)
    below: set[str] = set()  # ids with a record below the committed offset: consumed for good
    beyond: set[str] = set()
    for r in episodes:
        if r.value is not None:
            (beyond if r.offset >= committed.get(r.partition, 0) else below).add(r.value.episode_id)
    batches = await read_topic(kafka, names.batches, expect=Batch)
    drops = await read_topic(kafka, names.drops, expect=DropRecord)
    dead = await read_topic(kafka, names.dead_letter, expect=DeadLetter)
    malformed = sum(1 for r in dead if r.value is not None and r.value.source == names.episodes)
    by_id = {r.value.batch_id: r.value.episode_ids for r in batches if r.value is not None}
    refused, stale = [], []
    for r in dead:
        if r.value is None or r.value.source != names.batches or r.value.reason not in (ALREADY_TRAINED, STALE):
            continue
        try:
            batch_id = codec.decode(r.value.value, expect=Batch).batch_id
        except CodecError:
            batch_id = _batch_id_in(r.value.detail)  # truncated by the dead-letter size cap: its detail names it
        if batch_id in by_id:
            (refused if r.value.reason == ALREADY_TRAINED else stale).append((batch_id, by_id[batch_id]))
    result = reconcile(
        (r.value.episode_id if r.value is not None else None for r in episodes),
        ((r.value.batch_id, r.value.episode_ids) for r in batches if r.value is not None),
        ((r.value.reason, r.value.episode_ids) for r in drops if r.value is not None),
        malformed=malformed,
        ledger=read_ledger(config.run_dir / "trainer" / "ledger.jsonl"),
        refused=refused,
        stale=stale,
        uncommitted=beyond - below,
    )
    result["undecodable_outputs"] = sum(1 for r in (*batches, *drops) if r.value is None)
    result["prefix"] = names.prefix
    return with_prompts(result, await _audit_prompts(config, episodes, dead, prompts_committed))


async def _audit_prompts(config: Any, episodes: list[Any], dead: list[Any],
                         committed: dict[int, int]) -> dict[str, Any]:
    """Read the prompts topic and the unanswered prompts; reconcile them against the generators group's offsets
    ``committed`` (taken before ``episodes`` and ``dead`` were read)."""
    names, kafka = config.names, config.kafka
    if config.generator.prompt_source == "local":
        return local_prompts()
    prompts = await read_topic(kafka, names.prompts, expect=Prompt)
    unanswered: list[Any] = []
    if (await describe_topics(kafka, [names.unanswered])).get(names.unanswered, {}).get("partitions"):  # old logs lack it
        unanswered = await read_topic(kafka, names.unanswered, expect=UnansweredPrompt)
    return reconcile_prompts(
        ((r.partition, r.offset, r.value.prompt_id if r.value is not None else None) for r in prompts),
        committed,
        ((r.value.prompt_id, r.value.prompt_partition, r.value.prompt_offset) for r in episodes if r.value is not None),
        ((r.value.partition, r.value.offset) for r in dead if r.value is not None and r.value.source == names.prompts),
        ((r.value.partition, r.value.offset, r.value.reason) for r in unanswered if r.value is not None),
    )
