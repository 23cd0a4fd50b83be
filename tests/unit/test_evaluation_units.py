"""The evaluator's pure parts: its config section, pass@k, the held-out split, which export falls due."""

from __future__ import annotations

import itertools
import math

import orjson
import pytest

from models.tasks import TASKS, is_eval_item
from producers.evaluation import (
    EvalConfig,
    Export,
    PromptResult,
    available_exports,
    checkpoint_exports,
    due_export,
    pass_at_k,
    resolve_source,
    summarise,
)
from producers.sources import eval_prompts, toy_prompts
from streamforge.config import load_config
from topics.errors import ConfigError
from topics.schemas import PolicyVersion

# -- pass@k ---------------------------------------------------------------------------------------------------

def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n samples (c of them correct) holding at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_values_and_bad_arguments():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the share correct
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_summarise_greedy_accuracy_and_sampled_pass_at_k():
    results = [PromptResult(greedy_reward=1.0, greedy_correct=True, samples_correct=[True, False, False, False],
                            samples_reward=[1.0, 0.0, 0.0, 0.0]),
               PromptResult(greedy_reward=0.5, greedy_correct=False, samples_correct=[False] * 4,
                            samples_reward=[0.5] * 4)]
    m = summarise(results, k=2)
    assert m["eval/reward_mean"] == 0.75 and m["eval/accuracy"] == 0.5
    assert m["eval/pass_at_k"] == pytest.approx((0.5 + 0.0) / 2)  # 1 - C(3,2)/C(4,2) = 0.5 for the first
    assert m["eval/pass_at_1"] == pytest.approx(0.125)
    assert m["eval/sample_reward_mean"] == pytest.approx((0.25 + 0.5) / 2)
    with pytest.raises(ValueError):
        summarise([], k=1)


# -- config -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "key"), [
    ("--eval.every_versions=0", "eval.every_versions"),
    ("--eval.size=0", "eval.size"),
    ("--eval.samples=0", "eval.samples"),
    ("--eval.pass_k=9", "eval.pass_k"),
    ("--eval.temperature=0", "eval.temperature"),
    ("--eval.max_tokens=-1", "eval.max_tokens"),
    ("--eval.kv_cache_gib=0", "eval.kv_cache_gib"),
    ("--eval.gpu_memory_utilization=1.5", "eval.gpu_memory_utilization"),
    ("--eval.cpus=a-b", "eval.cpus"),
    ("--eval.correct_reward=nope", "eval.correct_reward"),
    ("--eval.nope=1", "eval.nope"),
    ("--up.evaluators=2", "up.evaluators"),
])
def test_bad_eval_settings_fail_at_load_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override], environ={})
    assert err.value.key == key


def test_up_with_an_evaluator_needs_a_held_out_split():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--up.evaluators=1", "--feeder.source=jsonl:train.jsonl"], environ={})
    assert err.value.key == "eval.source"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--up.evaluators=1", "--trainer.export_hf=false"], environ={})
    assert err.value.key == "trainer.export_hf"
    load_config(None, ["--up.evaluators=1", "--trainer.export_hf=false", "--weightsync.transport=file"], environ={})
    cfg = load_config(None, ["--up.evaluators=1", "--feeder.source=jsonl:train.jsonl",
                             "--eval.source=jsonl:held_out.jsonl"], environ={})
    assert resolve_source(cfg.eval, cfg.feeder.source) == "jsonl:held_out.jsonl"
    cfg = load_config("configs/demo.yaml", ["--up.evaluators=1", "--eval.samples=4", "--eval.pass_k=2"],
                      environ={"STREAMFORGE_EVAL_EVERY_VERSIONS": "3"})
    assert (cfg.up.evaluators, cfg.eval.every_versions, cfg.eval.k) == (1, 3, 2)
    assert resolve_source(cfg.eval, cfg.feeder.source) == "toy:addmod10"
    assert EvalConfig(samples=5).k == 5


# -- the held-out split ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", sorted(TASKS))
def test_training_prompts_never_hold_an_eval_item(task):
    held_out = eval_prompts(f"toy:{task}", size=64, seed=1)
    assert held_out and all(is_eval_item(p.text) for p in held_out)
    assert len({p.text for p in held_out}) == len(held_out)  # distinct
    train = {p.text for p in itertools.islice(toy_prompts(task, seed=0), 3000)}
    assert not train & {p.text for p in held_out}
    assert all(max(TASKS[task].score(p.answer, p.answer), TASKS[task].score(f"<answer>{p.answer}</answer>", p.answer))
               == 1.0 for p in held_out)


def test_addmod10_holds_out_13_of_its_100_sums_and_add1_12_of_81():
    assert len(eval_prompts("toy:addmod10", size=100, seed=5)) == 13
    assert len(eval_prompts("toy:add1", size=100, seed=5)) == 12
    a = [p.text for p in eval_prompts("toy:add2", size=20, seed=2)]
    assert a == [p.text for p in eval_prompts("toy:add2", size=20, seed=2)] and len(a) == 20  # deterministic


# -- exports ------------------------------------------------------------------------------------------------------

def checkpoint(run_dir, step: int, version: int, *, weights: bool = True, name: str = "") -> None:
    d = run_dir / "checkpoints" / (name or f"step-{step}")
    (d / "hf").mkdir(parents=True)
    (d / "meta.json").write_bytes(orjson.dumps({"step": step, "policy_version": version}))
    if weights:
        (d / "hf" / "model.safetensors").write_bytes(b"x")


def test_exports_are_complete_checkpoints_and_the_file_transports_version(tmp_path):
    assert checkpoint_exports(tmp_path) == []
    checkpoint(tmp_path, 10, 9)
    checkpoint(tmp_path, 20, 19)
    checkpoint(tmp_path, 30, 29, name="step-30.tmp")  # being written
    checkpoint(tmp_path, 40, 39, weights=False)  # no HF export (trainer.export_hf: false)
    found = checkpoint_exports(tmp_path)
    assert [(e.version, e.step) for e in found] == [(9, 10), (19, 20)]
    assert found[0].path == tmp_path / "checkpoints" / "step-10" / "hf"
    vdir = tmp_path / "weights" / "v00000023"
    vdir.mkdir(parents=True)
    (vdir / "model.safetensors").write_bytes(b"x")
    latest = PolicyVersion(version=23, step=23, transport="file", path=str(vdir))
    assert [e.version for e in available_exports(tmp_path, latest)] == [9, 19, 23]
    gloo = PolicyVersion(version=23, step=23, transport="gloo")
    assert [e.version for e in available_exports(tmp_path, gloo)] == [9, 19]


def test_due_export_follows_the_cadence_and_counts_skipped_versions():
    exports = [Export(v, v, tmp) for v, tmp in ((3, None), (5, None), (12, None))]  # type: ignore[arg-type]
    assert due_export([], None, 2) == (None, 0)
    assert due_export(exports, None, 2) == (exports[-1], 0)  # a late joiner starts with the newest
    assert due_export(exports, 12, 1) == (None, 0)  # nothing newer
    assert due_export(exports, 11, 2) == (None, 0)  # 12 < 11 + 2: not due yet
    assert due_export(exports, 10, 2) == (exports[-1], 0)  # exactly on cadence
    assert due_export(exports, 5, 2) == (exports[-1], 2)  # due at 7 and 9 passed over, 11 reached by 12
    assert due_export(exports, 5, 1) == (exports[-1], 6)
    assert math.isclose(due_export(exports, 0, 4)[1], 2)


# -- one evaluation, on a fake engine (the real one: tests/integration/test_evaluator.py) --------------------------

class FakeEngine:
    """Answers each addmod10 prompt: greedy right, samples right for the first ``right`` of them."""

    def __init__(self, right: int) -> None:
        self.right = right
        self.version = 0
        self.loaded: list[tuple[int, str]] = []

    async def generate(self, tokens, n, sampling, *, request_id=""):  # type: ignore[no-untyped-def]
        from producers.engine import Completion

        a, b = int(chr(tokens[0])), int(chr(tokens[2]))
        answer = str((a + b) % 10)
        if sampling.temperature == 0:
            return [Completion(index=0, text=answer)]
        return [Completion(index=i, text=answer if i < self.right else "x") for i in range(n)]

    async def swap(self, version, load, *, mode="keep"):  # type: ignore[no-untyped-def]
        class LLM:
            async def collective_rpc(_self, method, kwargs):  # type: ignore[no-untyped-def]
                self.loaded.append((version, kwargs["weights_path"]))

        await load(LLM())
        self.version = version
        return 1.0


async def test_an_evaluation_scores_every_held_out_prompt_and_appends_its_row(tmp_path):
    from producers.evaluator import EvaluatorRole, read_eval_rows
    from producers.rewards import RewardSet
    from streamforge.roles import build_role

    cfg = load_config(None, [f"--run.run_dir={tmp_path}", "--eval.samples=4", "--eval.pass_k=2",
                             "--eval.every_versions=2"], environ={})
    engine = FakeEngine(right=1)
    role: EvaluatorRole = build_role("evaluator", cfg, engine=engine)
    role.rewards = RewardSet(["toy"])
    role.correct = "toy"
    role.prompts = [(p, [ord(c) for c in p.text]) for p in eval_prompts(role.source, size=64, seed=1)]
    checkpoint(tmp_path, 6, 5)
    checkpoint(tmp_path, 9, 8)
    role.latest = PolicyVersion(version=8, step=9, transport="gloo")
    role.last_version = 3
    await role._evaluate_due()
    checkpoint(tmp_path, 12, 9)
    await role._evaluate_due()  # 9 < 8 + 2: not due
    await role._evaluate_due(final=True)  # the drain's: the newest, whatever the cadence
    rows = read_eval_rows(tmp_path / "eval.jsonl")
    assert [(r["policy_version"], r["step"]) for r in rows] == [(8, 9), (9, 12)]
    assert [v for v, _ in engine.loaded] == [8, 9] and engine.version == 9
    assert (tmp_path / "evaluator" / "weights" / "model.safetensors").exists()
    r = rows[0]
    assert r["episodes"] == 13 and r["eval/accuracy"] == 1.0 and r["eval/reward_mean"] == 1.0
    assert r["eval/pass_at_1"] == 0.25 and r["eval/pass_at_k"] == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert r["skipped"] == 1 and rows[1]["skipped"] == 1  # 5 was due after 3 and passed over for 8
    role.rewards.close()


def test_reward_png_carries_the_eval_curve(tmp_path):
    from streamforge.plots import _plot_eval, plot_run

    (tmp_path / "metrics.jsonl").write_bytes(b"".join(
        orjson.dumps({"step": s, "time_s": 10.0 + s, "reward_mean": 0.1, "staleness_mean": 1, "loss": 0}) + b"\n"
        for s in range(1, 21)))
    (tmp_path / "eval.jsonl").write_bytes(b"".join(
        orjson.dumps({"policy_version": v, "step": v, "eval/accuracy": v / 20, "eval/pass_at_k": v / 10, "k": 4})
        + b"\n" for v in (0, 10, 20)))

    class Axes:
        def __init__(self) -> None:
            self.lines: list[tuple[list, list, str]] = []

        def plot(self, x, y, fmt, **kw):  # type: ignore[no-untyped-def]
            self.lines.append((x, y, kw["label"]))

        def legend(self, **kw):  # type: ignore[no-untyped-def]
            pass

    ax = Axes()
    _plot_eval(ax, tmp_path / "eval.jsonl", {0: 11.0, 10: 20.0, 20: 30.0})
    assert ax.lines == [([11.0, 20.0, 30.0], [0.0, 0.5, 1.0], "held-out accuracy"),
                        ([11.0, 20.0, 30.0], [0.0, 1.0, 2.0], "held-out pass@4")]
    assert plot_run(tmp_path) == tmp_path / "reward.png" and (tmp_path / "reward.png").stat().st_size > 0
