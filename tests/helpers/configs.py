"""Run configs for tests that run a role alone."""

from __future__ import annotations


def unbounded(cfg, **buffer):
    """``cfg`` with ``staleness.max_versions: -1`` (no bound: ``streamforge/staleness.py``) and the buffer's
    batches-ahead cap off, plus ``buffer`` settings: for tests that run a role alone on a backlog, a buffer with no
    trainer publishing versions, or a trainer fed batches made beforehand."""
    import dataclasses

    from streamforge.staleness import StalenessConfig

    buffer.setdefault("max_batches_ahead", 0)
    return dataclasses.replace(cfg, staleness=StalenessConfig(max_versions=-1),
                               buffer=dataclasses.replace(cfg.buffer, **buffer))
