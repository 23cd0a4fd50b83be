"""How the benches that race systems to a target read several rounds: per-round ratios and their medians.

A system that missed its target in a round took "forever" in it: its time is None, the ratio of a baseline to it is
0.0, its own to a missed baseline inf. Medians count those (a miss in most rounds makes the median a miss)."""

from __future__ import annotations

import math
import statistics


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den of two times to target (baseline / system): 0.0 where ``den`` missed the target, inf where ``num``
    did, None where both did."""
    if num is None and den is None:
        return None
    return 0.0 if den is None else math.inf if num is None else num / den


def median(values: list[float | None]) -> float | None:
    """The median of the readings that exist (inf counts: a missed target); None when none exists or it is inf."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    m = statistics.median(xs)
    return None if math.isinf(m) else m
