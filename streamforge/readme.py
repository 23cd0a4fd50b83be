"""Regenerate the README's generated sections: the file tree (from module docstrings) and the topic table.

``python -m streamforge.readme`` rewrites the text between ``<!-- tree:start -->``/``<!-- tree:end -->`` and
``<!-- topics:start -->``/``<!-- topics:end -->``; ``tests/unit/test_readme.py`` fails when they are stale.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from topics.names import topic_table_markdown

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("topics", "runtime", "models", "envs", "weightsync", "producers", "buffer", "consumers", "services",
            "streamforge", "bench")
OTHER = {
    "Makefile": "`make demo` and `make test` (each builds .venv from a fresh clone)",
    "pyproject.toml": "the distribution, its dependencies and extras, pytest settings",
    ".ci/run": "CI entry point: runs `make test`",
    "configs/": "run configs (YAML mapped onto RunConfig)",
    "deploy/": "Dockerfiles, docker-compose (Apache Kafka KRaft + NATS), Kubernetes manifests; see deploy/README.md",
    "tests/unit/": "pure tests (fakes allowed, no broker)",
    "tests/integration/": "real Tansu, nats-server, vLLM CPU engine and gloo process groups",
    "tests/chaos/": "killed roles, a killed durable broker, a frozen NATS, faults between hosts, during real runs (marked slow)",
    "tests/helpers/": "code only the tests use: a weights-only generator process, an in-process batch maker, test hosts in network namespaces",
}


def first_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except SyntaxError:
        doc = None
    return (doc or "").strip().splitlines()[0].rstrip(".") if doc else ""


def tracked(root: Path = ROOT) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(root)) for p in root.rglob("*.py")]


def file_tree(root: Path = ROOT) -> str:
    files = set(tracked(root))
    lines = []
    for pkg in PACKAGES:
        mods = sorted(f for f in files if f.startswith(pkg + "/") and f.endswith(".py") and f.count("/") == 1)
        if not mods:
            continue
        lines.append(f"{pkg}/")
        for mod in mods:
            desc = first_line(root / mod)
            lines.append(f"  {mod.split('/', 1)[1]:<22} {desc}")
    for name, desc in OTHER.items():
        lines.append(f"{name:<24} {desc}")
    return "```\n" + "\n".join(lines) + "\n```"


def render(text: str, root: Path = ROOT) -> str:
    text = re.sub(r"<!-- tree:start -->.*?<!-- tree:end -->",
                  lambda m: f"<!-- tree:start -->\n{file_tree(root)}\n<!-- tree:end -->", text, flags=re.DOTALL)
    text = re.sub(r"<!-- topics:start -->.*?<!-- topics:end -->",
                  lambda m: f"<!-- topics:start -->\n{topic_table_markdown()}\n<!-- topics:end -->", text, flags=re.DOTALL)
    return text


def main() -> None:
    path = ROOT / "README.md"
    path.write_text(render(path.read_text()))


if __name__ == "__main__":
    main()
