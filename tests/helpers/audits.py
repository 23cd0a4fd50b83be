"""The assertion every end-to-end and fault test makes of its run's audit (``streamforge/audit.py``)."""

from __future__ import annotations

from typing import Any


def assert_nothing_lost(audit: dict[str, Any], *, prompts: str = "consumed", reconciles: bool = True,
                        trained_twice: bool = True) -> dict[str, Any]:
    """No episode and no prompt lost; nothing trained twice (``trained_twice=False``: not checked, for a test
    that asserts its own count) and the audit reconciles (``reconciles=False``: not checked). Returns the prompts'
    block.

    ``prompts`` says what the run did with the prompts topic, so that ``lost == 0`` is not vacuous:
    ``"consumed"``: the generators read it and committed at least one prompt; ``"none"``: the test fed episodes
    straight to ``episodes``, so no prompt is on the topic; ``"local"``: the generators read a local source."""
    block = audit["prompts"]
    assert audit["episodes_lost"] == 0, ("episodes lost", audit["samples"]["lost"])
    assert block["lost"] == 0, ("prompts lost", block["samples"]["lost"])
    assert audit["lost"] == 0, audit["lost"]
    if trained_twice:
        assert audit["trained_twice"] == 0, ("trained twice", audit["samples"]["trained_twice"])
    if reconciles:
        assert audit["reconciles"], {k: v for k, v in audit.items() if k != "samples"}
    if prompts == "consumed":
        assert block["source"] == "topic" and block["consumed"] >= 1, block
        assert block["consumed"] == (block["answered"] + block["dead_lettered"]
                                     + sum(block["unanswered_by_reason"].values())), block
    elif prompts == "none":
        assert block["source"] == "topic" and block["records"] == 0 and block["consumed"] == 0, block
    elif prompts == "local":
        assert block["source"] == "local" and block["consumed"] == 0, block
    else:
        raise ValueError(f"prompts must be 'consumed', 'none' or 'local', not {prompts!r}")
    return block
