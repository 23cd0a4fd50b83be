"""The layers never import upward: every import statement of every package module (top level or inside a
function) is read with ``ast`` and checked against the layer order below. No exceptions are listed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# lowest first; a package may import its own modules and those of lower layers only
LAYERS: list[tuple[str, ...]] = [
    ("topics",),  # the wire contract: schemas, codec, names, broker clients
    ("runtime",),  # what every role uses: lifecycle, metrics, telemetry, plugins, the role context
    ("models",),  # policies and tasks shared by generators and trainers
    ("envs",),  # environments for multi-turn episodes and the routing to their replicas
    ("weightsync",),  # weights from the trainer into the generators' engines
    ("producers", "buffer", "consumers", "services"),  # the roles: none imports another
    ("streamforge",),  # the app: CLI, up, the notebook API, the composed run config
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def violations() -> list[str]:
    bad = []
    for pkg, rank in RANK.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, target in imports(path):
                if target == pkg or target not in RANK:
                    continue
                if RANK[target] >= rank:
                    kind = "a peer role" if RANK[target] == rank else "a layer above"
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({kind})")
    return bad


def test_no_module_imports_upward_or_across_roles() -> None:
    assert violations() == []


def test_every_package_has_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench", "deploy"}
    assert packages <= set(RANK), f"packages without a layer: {sorted(packages - set(RANK))}"


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from streamforge.config import RunConfig\n    import producers.engine\n")
    assert imports(mod) == [(2, "streamforge"), (3, "producers")]


def test_integration_and_chaos_markers_come_from_the_folder() -> None:
    import subprocess
    import sys

    def collected(marker: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", marker, "tests/chaos", "tests/unit/test_layers.py",
                              "tests/integration/test_policy_store.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        return [line for line in out.stdout.splitlines() if "::" in line]

    chaos = collected("chaos")
    assert chaos and all(n.startswith("tests/chaos/") for n in chaos)
    integration = collected("integration")
    assert any(n.startswith("tests/integration/") for n in integration)
    assert not any(n.startswith("tests/unit/") for n in integration)
    assert set(chaos) <= set(integration)
