"""``RLConfig`` (the notebook API) mapped onto the run config."""

from __future__ import annotations

from streamforge.api import RLConfig, build_run_config


def test_the_api_runs_one_episodes_partition_for_its_one_buffer() -> None:
    """A batch holds one partition's groups: the API's run (one buffer) keeps them in one partition unless told."""
    cfg, overrides = build_run_config(RLConfig(output_dir="/tmp/unused", max_staleness=0), reward_functions=[],
                                      dataset=None)
    assert cfg.topics.episodes_partitions == 1 and "--topics.episodes_partitions=1" in overrides
    assert cfg.up.buffers == 1 and cfg.staleness.max_versions == 0
    cfg, _ = build_run_config(RLConfig(output_dir="/tmp/unused", episodes_partitions=4), reward_functions=[],
                              dataset=None)
    assert cfg.topics.episodes_partitions == 4
    cfg, _ = build_run_config(RLConfig(output_dir="/tmp/unused", extra={"topics.episodes_partitions": 2}),
                              reward_functions=[], dataset=None)
    assert cfg.topics.episodes_partitions == 2  # extra keys come last
