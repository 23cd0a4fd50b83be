"""The audit's reconciliation as a pure function (the episodes' and the prompts'), and the ledger reader (no
broker)."""

from __future__ import annotations

from streamforge.audit import local_prompts, read_ledger, reconcile, reconcile_prompts, with_prompts


def ledger(*steps):
    return [{"step": i + 1, "policy_version": i + 1, "batch_ids": list(b), "time": 0.0} for i, b in enumerate(steps)]


def test_clean_run_reconciles():
    eps = ["a/0", "a/1", "b/0", "b/1", "c/0", "c/1", "a/0"]  # a/0 delivered twice
    out = reconcile(eps, [("B1", ["a/0", "a/1", "b/0", "b/1"])], [("zero_variance", ["c/0", "c/1"]),
                                                                    ("duplicate", ["a/0"])],
                    malformed=1, ledger=ledger(["B1"]))
    assert out["produced"] == 6 and out["duplicate_records"] == 1 and out["records"] == 7
    assert out["batched"] == 4 and out["batches"] == 1
    assert out["dropped"] == {"zero_variance": 2, "duplicate": 1, "malformed": 1}
    assert out["lost"] == 0 and out["reconciles"] and out["trained"] == 4 and out["trained_twice"] == 0


def test_lost_and_conflicts_are_reported():
    out = reconcile(["a/0", "a/1", "b/0", None], [("B1", ["a/0"])], [("stale", ["a/0"])])
    assert out["lost"] == 2 and out["samples"]["lost"] == ["a/1", "b/0"]
    assert out["batched_and_dropped"] == 1 and not out["reconciles"]
    assert out["ledger_found"] is False and out["trained"] == 0


def test_undecided_episodes_beyond_the_committed_offset_are_pending_not_lost():
    """A run stopped with episodes still held by a buffer (or never read) reconciles: a restart reads them again."""
    eps = ["a/0", "a/1", "b/0", "b/1", "c/0"]
    out = reconcile(eps, [("B1", ["a/0", "a/1"])], [], uncommitted=["a/1", "b/0", "b/1"])
    assert out["pending"] == 2 and out["lost"] == 1 and out["samples"]["lost"] == ["c/0"] and not out["reconciles"]
    out = reconcile(eps[:4], [("B1", ["a/0", "a/1"])], [], uncommitted=["b/0", "b/1"])
    assert out["pending"] == 2 and out["lost"] == 0 and out["reconciles"]


def test_trained_twice_counts_only_batches_the_trainer_accepted():
    eps = ["a/0", "a/1", "b/0", "b/1"]
    batches = [("B1", ["a/0", "a/1"]), ("B2", ["a/0", "a/1", "b/0", "b/1"]), ("B1", ["a/1", "a/0"])]
    # B1 republished (same id, the trainer dedups); B2 re-formed with a different id but never trained
    out = reconcile(eps, batches, [], ledger=ledger(["B1"]))
    assert out["in_two_batches"] == 2 and out["batch_records"] == 3 and out["batches"] == 2
    assert out["trained_twice"] == 0 and out["trained"] == 2
    out = reconcile(eps, batches, [], ledger=ledger(["B1"], ["B2"]))
    assert out["trained_twice"] == 2 and out["samples"]["trained_twice"] == ["a/0", "a/1"]
    out = reconcile(eps, batches, [], ledger=ledger(["B1"], ["B1"], ["X"]))  # one batch trained at two steps
    assert out["trained_twice"] == 2 and out["trained_unknown_batches"] == 1


def test_read_ledger_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    assert read_ledger(path) is None
    path.write_text('{"step": 1, "policy_version": 1, "batch_ids": ["B1"], "time": 1.0}\n{"step": 2, "batch')
    assert read_ledger(path) == [{"step": 1, "policy_version": 1, "batch_ids": ["B1"], "time": 1.0}]


def test_zombie_batch_refused_by_the_trainer_is_counted_and_not_trained_twice():
    eps = ["a/0", "a/1", "b/0", "b/1"]
    # the live owner's B1, then a zombie's Z holding a/0 a/1 again (different id): the trainer refused Z
    batches = [("B1", ["a/0", "a/1", "b/0", "b/1"]), ("Z", ["a/0", "a/1"])]
    out = reconcile(eps, batches, [], ledger=ledger(["B1"]), refused=[("Z", ["a/0", "a/1"])])
    assert out["in_two_batches"] == 2 and out["in_two_batches_refused"] == 2
    assert out["refused_batches"] == 1 and out["refused_episodes"] == 2
    assert out["trained"] == 4 and out["trained_twice"] == 0 and out["reconciles"]
    # without the trainer's refusal (Z trained too) the same topics show a/0 and a/1 trained twice
    out = reconcile(eps, batches, [], ledger=ledger(["B1"], ["Z"]))
    assert out["trained_twice"] == 2 and out["refused_batches"] == 0 and out["in_two_batches_refused"] == 0


def test_trained_episodes_window_and_rebuild_from_ledger(tmp_path):
    from consumers.ledger import Ledger, TrainedEpisodes

    led = Ledger(tmp_path)
    led.record(step=1, policy_version=0, batch_ids=["B1"], episode_ids=["a/0", "a/1"])
    led.record(step=2, policy_version=1, batch_ids=["B2"], episode_ids=["b/0", "b/1"])
    led.record(step=3, policy_version=2, batch_ids=["B3"], episode_ids=["c/0"])
    led.close()
    rows = Ledger.read(tmp_path)
    assert rows[0]["episode_ids"] == ["a/0", "a/1"] and rows[0]["batch_ids"] == ["B1"]
    seen = TrainedEpisodes(window=2)
    seen.load(rows)  # the last two steps only
    assert seen.trained(["a/0", "b/1", "c/0", "x"]) == {"b/1": 2, "c/0": 3}
    seen.add(4, ["d/0"])  # step 2 leaves the window
    assert seen.trained(["b/0", "c/0", "d/0"]) == {"c/0": 3, "d/0": 4} and len(seen) == 2
    old = TrainedEpisodes(window=5)
    old.load([{"step": 1, "batch_ids": ["B1"]}])  # a ledger line written before episode ids were recorded
    assert len(old) == 0


# -- the prompts (reconcile_prompts) ----------------------------------------------------------------------------


def test_every_consumed_prompt_has_one_outcome_and_a_silent_commit_is_lost():
    """Partition 0: p0 answered, p1 dead-lettered (invalid), p2 unanswered (its env refused every reset), p3
    committed past without a word; partition 1: q0 answered, q1 beyond the committed offset (pending)."""
    prompts = [(0, 0, "p0"), (0, 1, "p1"), (0, 2, "p2"), (0, 3, "p3"), (1, 0, "q0"), (1, 1, "q1")]
    out = reconcile_prompts(prompts, {0: 4, 1: 1}, [("p0", 0, 0), ("p0", 0, 0), ("q0", 1, 0), ("q1", 1, 1)],
                            [(0, 1)], [(0, 2, "env_step_failed")])
    assert out["records"] == 6 and out["consumed"] == 5 and out["pending"] == 1
    assert out["answered"] == 2 and out["dead_lettered"] == 1
    assert out["unanswered_by_reason"] == {"env_step_failed": 1}
    assert out["lost"] == 1 and out["samples"]["lost"] == [{"partition": 0, "offset": 3, "prompt_id": "p3"}]
    assert out["source"] == "topic"


def test_a_repeated_prompt_id_is_answered_per_place_not_per_id():
    """A restarted feeder sends p0 again at offset 2: an Episode answering offset 0 does not answer offset 2."""
    prompts = [(0, 0, "p0"), (0, 1, "p1"), (0, 2, "p0")]
    out = reconcile_prompts(prompts, {0: 3}, [("p0", 0, 0), ("p1", 0, 1)], [], [])
    assert out["duplicate_ids"] == 1 and out["answered"] == 2 and out["lost"] == 1
    assert out["samples"]["lost"] == [{"partition": 0, "offset": 2, "prompt_id": "p0"}]
    out = reconcile_prompts(prompts, {0: 3}, [("p0", 0, 0), ("p1", 0, 1), ("p0", 0, 2)], [], [])
    assert out["answered"] == 3 and out["lost"] == 0


def test_redelivered_outcomes_count_once_and_an_answer_wins_over_an_earlier_reason():
    """At-least-once: a generator wrote p0's UnansweredPrompt and died before committing; another redid p0 and
    produced its group: answered, once. Duplicate dead letters and duplicate UnansweredPrompts count once."""
    prompts = [(0, 0, "p0"), (0, 1, "p1"), (0, 2, "p2")]
    out = reconcile_prompts(prompts, {0: 3}, [("p0", 0, 0), ("p0", 0, 0)], [(0, 1), (0, 1)],
                            [(0, 0, "env_timeout"), (0, 2, "reward_error"), (0, 2, "reward_error")])
    assert out["answered"] == 1 and out["dead_lettered"] == 1 and out["unanswered_by_reason"] == {"reward_error": 1}
    assert out["lost"] == 0 and out["consumed"] == 3


def test_episodes_without_the_prompts_place_answer_by_prompt_id_and_undecodable_prompts_by_their_dead_letter():
    """A version-2 Episode (no prompt_partition/offset) answers every prompt with its id; an undecodable record
    (prompt_id None) is accounted by the dead letter at its place, or lost without one."""
    prompts = [(0, 0, "p0"), (0, 1, None), (0, 2, None), (1, 0, "p0")]
    out = reconcile_prompts(prompts, {0: 3, 1: 1}, [("p0", -1, -1)], [(0, 1)], [])
    assert out["answered"] == 2 and out["dead_lettered"] == 1 and out["lost"] == 1
    assert out["samples"]["lost"] == [{"partition": 0, "offset": 2, "prompt_id": None}]


def test_nothing_committed_means_nothing_consumed_every_prompt_pending():
    out = reconcile_prompts([(0, 0, "p0"), (1, 0, "p1")], {}, [], [], [])
    assert out["consumed"] == 0 and out["pending"] == 2 and out["lost"] == 0 and out["samples"]["lost"] == []
    out = reconcile_prompts([], {}, [("p0", -1, -1)], [], [])  # episodes fed straight to the topic, no prompts
    assert out["records"] == 0 and out["consumed"] == 0 and out["answered"] == 0 and out["lost"] == 0


def test_lost_prompts_count_in_the_top_level_lost_and_break_reconciles():
    episodes = reconcile(["a/0", "a/1"], [("B1", ["a/0", "a/1"])], [])
    assert episodes["lost"] == 0 and episodes["reconciles"]
    lost = reconcile_prompts([(0, 0, "a"), (0, 1, "b")], {0: 2}, [("a", 0, 0)], [], [])
    out = with_prompts(dict(episodes), lost)
    assert out["lost"] == 1 and out["episodes_lost"] == 0 and out["prompts"]["lost"] == 1 and not out["reconciles"]
    out = with_prompts(reconcile(["a/0"], [], []), reconcile_prompts([(0, 0, "a")], {0: 1}, [("a", 0, 0)], [], []))
    assert out["lost"] == 1 and out["episodes_lost"] == 1 and out["prompts"]["lost"] == 0 and not out["reconciles"]
    out = with_prompts(dict(episodes), local_prompts())
    assert out["prompts"]["source"] == "local" and out["prompts"]["consumed"] == 0 and out["reconciles"]
