"""pytest imports test modules by basename (rootdir-relative, no package ``__init__``), so two test files of
the same name in different folders stop collection of the whole suite with 'import file mismatch'. Running one
folder at a time hides it; this check sees the whole tree."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    assert len(where) > 50, "the test tree was not found"
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename: {clashes}"
