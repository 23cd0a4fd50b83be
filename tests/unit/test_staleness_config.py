"""``staleness.max_versions`` and what derives from it; cross-section rules that name both keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamforge.config import RunConfig, load_config
from streamforge.staleness import UNBOUNDED_LAG
from topics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def load(*overrides: str, path: Path | None = None) -> RunConfig:
    return load_config(path, list(overrides), environ={})


@pytest.mark.parametrize(("s", "ahead", "gen_lag", "window"), [(0, 1, 0, 1), (1, 1, 0, 2), (2, 1, 1, 2),
                                                                (3, 2, 1, 3), (4, 2, 1, 4), (5, 2, 1, 5)])
def test_bounds_derive_from_the_one_setting(s: int, ahead: int, gen_lag: int, window: int) -> None:
    c = load(f"--staleness.max_versions={s}")
    assert c.buffer.max_batches_ahead == ahead and c.buffer.max_policy_lag == s
    assert c.generator.max_policy_lag == gen_lag and c.generator.quota_window_steps == window
    # the quota's bound: a group is trained at most window - 1 versions after it was taken, by weights gen_lag old;
    # the window is the widest that keeps it (not capped at ahead + 1: it covers the groups still generating)
    assert (window - 1) + gen_lag == s
    # a batch cut behind `ahead` queued ones, of episodes from weights gen_lag old, is still trainable
    assert ahead + gen_lag <= max(s, 1)


def test_quota_is_each_generators_share_of_a_steps_groups() -> None:
    c = load("--buffer.groups_per_batch=8", "--trainer.publish_every=2", "--up.generators=3")
    assert c.generator.groups_per_step == pytest.approx(8 / 3)
    assert c.generator.quota_groups_per_batch == 8  # the trainer's steps counted in full batches of groups
    # (S - G) * P + 1 steps: with a version every P steps, a group taken W steps ahead is (W - 1) / P versions old
    assert c.generator.quota_window_steps == 7
    assert load("--buffer.token_budget=4096").generator.groups_per_step == 0  # groups per batch unknown
    assert load("--buffer.token_budget=4096").generator.quota_groups_per_batch == 0
    assert not load().generator.quota_counts_zero_variance  # the buffer filters them: they use no quota
    assert load("--buffer.filter_zero_variance=false").generator.quota_counts_zero_variance


def test_explicit_settings_win_over_derived_ones() -> None:
    c = load("--staleness.max_versions=3", "--buffer.max_batches_ahead=1", "--generator.groups_per_step=5")
    assert c.buffer.max_batches_ahead == 1 and c.generator.groups_per_step == 5
    assert c.buffer.max_policy_lag == 3  # still derived
    env = load_config(None, [], environ={"STREAMFORGE_GENERATOR__MAX_POLICY_LAG": "0"})
    assert env.generator.max_policy_lag == 0


def test_the_demo_derives_its_bounds() -> None:
    c = load(path=ROOT / "configs" / "demo.yaml")
    assert (c.buffer.max_batches_ahead, c.buffer.max_policy_lag, c.generator.max_policy_lag) == (2, 4, 1)
    assert c.generator.groups_per_step == 8 and c.generator.quota_window_steps == 4


def test_a_generator_lag_beyond_the_buffers_names_both_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load("--generator.max_policy_lag=2", "--buffer.max_policy_lag=1")
    assert err.value.key == "generator.max_policy_lag" and "buffer.max_policy_lag" in str(err.value)


def test_settings_that_break_the_bound_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load("--buffer.max_policy_lag=5")
    assert err.value.key == "buffer.max_policy_lag" and "staleness.max_versions" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load("--buffer.max_batches_ahead=6")
    assert err.value.key == "buffer.max_batches_ahead" and "staleness.max_versions 4" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load("--buffer.max_batches_ahead=0")
    assert err.value.key == "buffer.max_batches_ahead"
    load("--buffer.max_batches_ahead=0", "--trainer.mode=sft")  # no versions in SFT mode: no bound to keep


def test_no_bound() -> None:
    c = load("--staleness.max_versions=-1")
    assert c.buffer.max_batches_ahead == 0 and c.buffer.max_policy_lag == UNBOUNDED_LAG
    assert c.generator.groups_per_step == 0
    with pytest.raises(ConfigError, match="staleness.max_versions"):
        load("--staleness.max_versions=-2")


@pytest.mark.parametrize(("override", "key"), [
    ("--buffer.poll_max_records=0", "buffer.poll_max_records"),
    ("--buffer.dedup_window=0", "buffer.dedup_window"),
    ("--up.buffers=0", "up.buffers"),
    ("--up.generators=-1", "up.generators"),
    ("--buffer.reward_clip=-1", "buffer.reward_clip"),
    ("--buffer.batching=zip", "buffer.batching"),
    ("--trainer.publish_busy=never", "trainer.publish_busy"),
    ("--weightsync.transport=pigeon", "weightsync.transport"),
    ("--model.source=gpt-7", "model.source"),
])
def test_bad_values_name_their_own_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(override)
    assert err.value.key == key, err.value


def test_literal_choices_are_checked_for_configs_built_in_code() -> None:
    from buffer.config import BufferConfig

    with pytest.raises(ConfigError) as err:
        BufferConfig(advantage="ppo")  # type: ignore[arg-type]
    assert err.value.key == "buffer.advantage"


def test_explain_gives_every_key_its_comment() -> None:
    from streamforge.explain import explain, explain_text

    rows = {r["key"]: r for r in explain(load(path=ROOT / "configs" / "demo.yaml"))}
    assert "synchronous" in rows["staleness.max_versions"]["help"]
    assert rows["generator.max_tokens"]["value"] == 2 and rows["generator.max_tokens"]["default"] == 16
    assert "'pad' | 'pack'" == rows["buffer.batching"]["type"]
    assert "Derived from staleness" in rows["buffer.max_batches_ahead"]["help"]  # a comment block above the field
    text = explain_text(load(), "up")
    assert text.startswith("[up]") and "up.buffers" in text and "generator." not in text


def test_the_config_command_prints_the_resolved_config_and_explains_it() -> None:
    from click.testing import CliRunner

    from streamforge.cli import main

    runner = CliRunner()
    out = runner.invoke(main, ["config", "--config", str(ROOT / "configs" / "demo.yaml"), "--staleness.max_versions=0"])
    assert out.exit_code == 0, out.output
    import yaml

    resolved = yaml.safe_load(out.output)
    assert resolved["staleness"]["max_versions"] == 0 and resolved["buffer"]["max_batches_ahead"] == 1
    out = runner.invoke(main, ["config", "--explain", "--section", "staleness"])
    assert out.exit_code == 0 and "0 = synchronous" in out.output
    out = runner.invoke(main, ["config", "--section", "nope"])
    assert out.exit_code != 0 and "no config section 'nope'" in out.output
