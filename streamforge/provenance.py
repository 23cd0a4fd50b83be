"""``streamforge provenance``: from a policy version to the data that made it and the generators that adopted it,
and from an episode to the step that trained it, or why none did.

Sources, all the run's own records (the topics read through ``streamforge/runlog.py``, reopened if need be):

* ``<run_dir>/weightsync/versions.jsonl``: per published version its step, batch ids (those trained since the
  previous version), the acks per generator (``ok``, ``at``) and the generators fenced when its round ended;
* ``<run_dir>/trainer/ledger.jsonl``: per step the version it trained with, its batch and episode ids;
* the ``batches`` topic: each batch's episodes and where the buffer read each of them on the ``episodes`` topic
  (``Batch.episode_partitions``/``episode_offsets``, schema v2; for a v1 batch the episodes topic is searched);
* the ``episodes`` topic (an episode's prompt id, read at its offset) and the ``prompts`` topic (the prompt text,
  ``None`` where the prompt is no longer retained);
* for an episode that was not trained: the ``drops`` topic (the buffer's reason) and the ``dead-letter`` topic (a
  batch the trainer refused: ``stale``, ``already_trained``, ``invalid``; a malformed episode).

A version ``V`` covers the steps whose batches its publication names (the steps trained with version ``V - 1``,
the ledger's ``policy_version``); without ``versions.jsonl`` (no NATS) those ledger lines are used alone. The
reverse names the version that first carried the episode's update to the generators (``version``) and the one the
step trained with (``trained_with_version``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from topics.errors import StreamforgeError


def _lines(path: Any) -> list[dict[str, Any]]:
    from streamforge.replay import read_jsonl

    return read_jsonl(path)


async def _batches(config: Any, batch_ids: list[str]) -> dict[str, Any]:
    """The ``Batch`` of each id still on the batches topic."""
    from streamforge.runlog import locate, records_at
    from topics.schemas import Batch

    where = await locate(config.kafka, config.names.batches, set(batch_ids), expect=Batch)
    plan = sorted((*where[b], b) for b in set(batch_ids) if b in where)
    out = {}
    async with contextlib.aclosing(records_at(config.kafka, config.names.batches, plan, expect=Batch)) as it:
        async for batch in it:
            out[batch.batch_id] = batch
    return out


async def _episode_places(config: Any, batches: list[Any]) -> dict[str, tuple[int, int]]:
    """``{episode_id: (partition, offset)}`` of every episode of ``batches``: from the batch (v2), else searched."""
    from streamforge.runlog import locate
    from topics.schemas import Episode

    places: dict[str, tuple[int, int]] = {}
    unknown: set[str] = set()
    for b in batches:
        if b.episode_offsets.size:
            places.update(zip(b.episode_ids, zip(b.episode_partitions.tolist(), b.episode_offsets.tolist())))
        else:
            unknown.update(b.episode_ids)
    if unknown:
        places.update(await locate(config.kafka, config.names.episodes, unknown, expect=Episode))
    return places


async def _episodes_at(config: Any, places: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The ``Episode`` records at ``places``; those gone from the topic are left out."""
    from streamforge.runlog import RecordGone, records_at
    from topics.schemas import Episode

    out: dict[str, Any] = {}
    plan = sorted((p, off, eid) for eid, (p, off) in places.items())
    with contextlib.suppress(RecordGone):  # past the topic's retention: the ids and offsets still stand
        async with contextlib.aclosing(records_at(config.kafka, config.names.episodes, plan, expect=Episode)) as it:
            async for ep in it:
                out[ep.episode_id] = ep
    return out


async def _prompts(config: Any, prompt_ids: set[str]) -> dict[str, str]:
    """The text of each prompt id still on the prompts topic (one pass; only the wanted ones are kept)."""
    from streamforge.runlog import scan
    from topics.schemas import Prompt

    out: dict[str, str] = {}
    if not prompt_ids:
        return out
    async with contextlib.aclosing(scan(config.kafka, config.names.prompts, expect=Prompt)) as records:
        async for r in records:
            if r.value is not None and r.value.prompt_id in prompt_ids and r.value.prompt_id not in out:
                out[r.value.prompt_id] = r.value.text
                if len(out) == len(prompt_ids):
                    break
    return out


def _published(config: Any) -> list[dict[str, Any]]:
    return _lines(config.run_dir / "weightsync" / "versions.jsonl")


async def version_provenance(config: Any, version: int) -> dict[str, Any]:
    """What made policy ``version`` and who adopted it (module docstring). The CLI's ``--json`` object."""
    from consumers.ledger import Ledger

    ledger = Ledger.read(config.run_dir)
    line = next((v for v in reversed(_published(config)) if v.get("version") == version), None)
    if line is not None:
        named = set(line.get("batch_ids", []))
        rows = [r for r in ledger if named & set(r.get("batch_ids", []))]
        batch_ids = list(line.get("batch_ids", []))
    else:
        rows = [r for r in ledger if r.get("policy_version") == version - 1]
        batch_ids = [b for r in rows for b in r.get("batch_ids", [])]
    if not rows and line is None:
        known = sorted({v.get("version") for v in _published(config)} | {r["policy_version"] + 1 for r in ledger})
        raise StreamforgeError(f"version {version} is not in run {config.run_dir} (versions: "
                               f"{known[0] if known else '-'}..{known[-1] if known else '-'})")
    batches = await _batches(config, batch_ids)
    ordered = [batches[b] for b in batch_ids if b in batches]
    places = await _episode_places(config, ordered)
    episode_ids = [e for b in ordered for e in b.episode_ids]
    for r in rows:  # a batch gone from the topic: its episode ids from the ledger, their offsets unknown
        if r["batch_ids"][0] not in batches:
            episode_ids += r.get("episode_ids", [])
    records = await _episodes_at(config, places)
    prompt_of = {eid: ep.prompt_id for eid, ep in records.items()}
    texts = await _prompts(config, set(prompt_of.values()))
    acks = (line or {}).get("acks", {})
    adopted = [{"generator_id": g, "at": a.get("at"), "pause_ms": a.get("pause_ms")}
               for g, a in sorted(acks.items()) if a.get("ok")]
    fenced = sorted(set((line or {}).get("fenced", [])) | {g for g, a in acks.items() if not a.get("ok")})
    return {
        "version": version,
        "steps": sorted(int(r["step"]) for r in rows),
        "batch_ids": batch_ids,
        "episodes": [{"episode_id": e, "partition": places.get(e, (None, None))[0],
                      "offset": places.get(e, (None, None))[1], "prompt_id": prompt_of.get(e)} for e in episode_ids],
        "prompts": [{"prompt_id": p, "text": texts.get(p)} for p in sorted(set(prompt_of.values()))],
        "adopted_by": adopted,
        "fenced": fenced,
        "published": line is not None,
        "published_at": (line or {}).get("published_at"),
        "targets": (line or {}).get("targets", []),
        "missing_batches": [b for b in batch_ids if b not in batches],
    }


async def episode_provenance(config: Any, episode_id: str) -> dict[str, Any]:
    """Where episode ``episode_id`` came from and the step that trained it, or why none did."""
    from consumers.ledger import Ledger
    from streamforge.runlog import scan
    from topics.schemas import Episode

    ledger = Ledger.read(config.run_dir)
    published = _published(config)
    trained = []
    for r in ledger:
        if episode_id in r.get("episode_ids", []):
            batch_id = r["batch_ids"][0]
            carried = next((v["version"] for v in published if batch_id in v.get("batch_ids", [])), None)
            trained.append({"step": int(r["step"]), "batch_id": batch_id, "version": carried,
                            "trained_with_version": r.get("policy_version")})
    place: tuple[int, int] | None = None
    if trained:
        batch = (await _batches(config, [trained[0]["batch_id"]])).get(trained[0]["batch_id"])
        if batch is not None:
            place = (await _episode_places(config, [batch])).get(episode_id)
    record = None
    if place is not None:
        record = (await _episodes_at(config, {episode_id: place})).get(episode_id)
    else:  # not trained (or from a v1 batch): its first retained record
        async with contextlib.aclosing(scan(config.kafka, config.names.episodes, expect=Episode)) as records:
            async for r in records:
                if r.value is not None and r.value.episode_id == episode_id:
                    place, record = (r.partition, r.offset), r.value
                    break
    out: dict[str, Any] = {
        "episode_id": episode_id, "found": place is not None or bool(trained),
        "partition": place[0] if place else None, "offset": place[1] if place else None,
        "prompt_id": record.prompt_id if record is not None else None,
        "reward": record.reward if record is not None else None,
        "generated_with_version": record.policy_version if record is not None else None,
        "trained": trained,
        "batch_id": trained[0]["batch_id"] if trained else None,
        "step": trained[0]["step"] if trained else None,
        "version": trained[0]["version"] if trained else None,
        "dropped": None, "drop_detail": None,
    }
    if not trained:
        out.update(await _why_not_trained(config, episode_id))
    return out


async def _why_not_trained(config: Any, episode_id: str) -> dict[str, Any]:
    """The buffer's drop (``drops``), else a batch of it that the trainer refused (``dead-letter``), else a
    malformed record; ``pending`` when it was batched or produced and not decided when the run stopped."""
    from streamforge.runlog import scan
    from topics import codec
    from topics.errors import CodecError
    from topics.schemas import Batch, DeadLetter, DropRecord

    async with contextlib.aclosing(scan(config.kafka, config.names.drops, expect=DropRecord)) as records:
        async for r in records:
            if r.value is not None and episode_id in r.value.episode_ids and r.value.reason != "duplicate":
                return {"dropped": r.value.reason, "drop_detail": r.value.detail or None,
                        "buffer_id": r.value.buffer_id or None}
    async with contextlib.aclosing(scan(config.kafka, config.names.dead_letter, expect=DeadLetter)) as records:
        async for r in records:
            letter = r.value
            if letter is None or letter.source not in (config.names.batches, config.names.episodes):
                continue
            try:
                msg = codec.decode(letter.value)
            except CodecError:
                continue
            if isinstance(msg, Batch) and episode_id in msg.episode_ids:
                return {"dropped": letter.reason, "drop_detail": letter.detail, "batch_id": msg.batch_id}
            if getattr(msg, "episode_id", None) == episode_id:
                return {"dropped": letter.reason, "drop_detail": letter.detail}
    return {"dropped": None, "drop_detail": "not decided when the run stopped (pending), or never produced"}


def render(result: dict[str, Any]) -> str:
    """A reader's summary of a provenance result (the CLI prints it before the ``--json`` line)."""
    if "version" in result and "steps" in result:
        eps = result["episodes"]
        lines = [f"version {result['version']}: steps {result['steps']}, {len(result['batch_ids'])} batches, "
                 f"{len(eps)} episodes from {len(result['prompts'])} prompts"
                 + ("" if result["published"] else " (not published: no versions.jsonl line)")]
        lines += [f"  batch {b}" for b in result["batch_ids"]]
        lines += [f"  episode {e['episode_id']}  episodes[{e['partition']}]@{e['offset']}" for e in eps[:20]]
        if len(eps) > 20:
            lines.append(f"  ... {len(eps) - 20} more episodes (--json lists all)")
        lines += [f"  prompt {p['prompt_id']}: {p['text']!r}" for p in result["prompts"][:10]]
        lines.append("  adopted by: " + (", ".join(f"{a['generator_id']} at {_when(a['at'])}"
                                                   for a in result["adopted_by"]) or "none"))
        lines.append("  fenced: " + (", ".join(result["fenced"]) or "none"))
        return "\n".join(lines)
    head = f"episode {result['episode_id']}"
    if result["partition"] is not None:
        head += f"  episodes[{result['partition']}]@{result['offset']}  prompt {result['prompt_id']}"
    if result["trained"]:
        t = result["trained"][0]
        return (f"{head}\n  trained at step {t['step']} in batch {t['batch_id']} (with version "
                f"{t['trained_with_version']}); first in version {t['version']}")
    if result["dropped"]:
        return f"{head}\n  not trained: {result['dropped']} ({result['drop_detail']})"
    return f"{head}\n  not trained: {result['drop_detail']}"


def _when(at: float | None) -> str:
    import datetime

    if not at:
        return "?"
    return datetime.datetime.fromtimestamp(at).isoformat(sep=" ", timespec="milliseconds")
