"""No pickle, eval or arbitrary import on any network path: a static scan of the wire code with ``ast``.

Scanned: every ``.py`` under ``topics/ producers/ buffer/ consumers/ weightsync/ streamforge/``. Rules:

- ``pickle-import``: importing pickle, cPickle, _pickle, cloudpickle, dill, marshal, shelve, jsonpickle or joblib.
- ``eval-exec``: calling the builtins ``eval``, ``exec`` or ``__import__`` (``model.eval()`` is a method, not these),
  outside the reviewed sites in ``ALLOWED_EXEC`` (module path, enclosing function), each of which compiles only
  source built from code (never from a message or a config value).
- ``torch-load``: ``torch.load(...)`` without the literal keyword ``weights_only=True``.
- ``object-collective``: ``torch.distributed.*_object*`` collectives (they unpickle what peers send).
- ``numpy-pickle``: ``numpy.load(..., allow_pickle=True)``.
- ``yaml-unsafe``: ``yaml.load`` without ``Loader=SafeLoader|CSafeLoader``, ``yaml.unsafe_load``, ``yaml.full_load``.
- ``shell``: ``subprocess.*(..., shell=True)``.
- ``dynamic-import``: ``importlib.import_module`` / ``pkgutil.resolve_name`` / ``importlib.__import__`` outside
  the reviewed sites in ``ALLOWED_DYNAMIC_IMPORTS`` (module path, enclosing function), each of which imports
  only names that come from the config or a fixed table, never from a message. A new site fails this test until
  someone reviews it and adds it here; an entry whose site disappeared fails too, so the list stays true.

Names are resolved through the file's imports (``import torch.distributed as dist`` makes
``dist.broadcast_object_list`` the full name), so aliases do not hide a call.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIRE_DIRS = ("topics", "runtime", "models", "producers", "buffer", "consumers", "weightsync", "streamforge")

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle", "joblib"}
DYNAMIC_IMPORTS = {"importlib.import_module", "importlib.__import__", "pkgutil.resolve_name"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "yaml.SafeLoader", "yaml.CSafeLoader"}

# Reviewed config-driven import sites: (path relative to the repo root, enclosing function) -> what feeds it.
ALLOWED_DYNAMIC_IMPORTS: dict[tuple[str, str], str] = {
    ("streamforge/roles.py", "role_class"): "module from the fixed ROLES table, looked up by the CLI's role name",
    ("runtime/plugins.py", "load_object"): "user plugins named in config: generator.rewards 'module:callable' "
                                               "(RewardSet) and trainer.loss 'module:factory' (make_loss), resolved "
                                               "once at start-up, never from a message",
}


# Reviewed exec sites: (path relative to the repo root, enclosing function) -> what the compiled source is made of.
ALLOWED_EXEC: dict[tuple[str, str], str] = {
    ("topics/codegen.py", "_compile"): "the codec's per-schema encode/finish functions, assembled at import time from "
                                       "fixed templates and the registered schema classes' field names (checked to "
                                       "be identifiers); values are passed in the namespace, no message byte reaches "
                                       "it",
}


@dataclass(frozen=True, slots=True)
class Finding:
    path: str
    line: int
    rule: str
    detail: str
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} [{self.rule}] {self.detail} (in {self.function or '<module>'})"


class _Scanner(ast.NodeVisitor):
    """Collects findings for one module; ``aliases`` maps local names to fully qualified ones."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}
        self.scope: list[str] = []
        self.findings: list[Finding] = []
        self.dynamic_sites: list[Finding] = []

    def _add(self, node: ast.AST, rule: str, detail: str) -> None:
        self.findings.append(Finding(self.path, node.lineno, rule, detail, ".".join(self.scope)))

    # -- imports ------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in PICKLE_MODULES:
                self._add(node, "pickle-import", f"import {alias.name}")
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                root = alias.name.split(".")[0]
                self.aliases[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] in PICKLE_MODULES:
            self._add(node, "pickle-import", f"from {module} import ...")
        for alias in node.names:
            if alias.name in PICKLE_MODULES:  # from six.moves import cPickle, from x import pickle
                self._add(node, "pickle-import", f"from {module} import {alias.name}")
            full = f"{module}.{alias.name}" if module and node.level == 0 else alias.name
            self.aliases[alias.asname or alias.name] = full

    # -- scopes -------------------------------------------------------------------------------------
    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    # -- calls --------------------------------------------------------------------------------------
    def _qualname(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    @staticmethod
    def _keyword(node: ast.Call, name: str) -> ast.expr | None:
        return next((kw.value for kw in node.keywords if kw.arg == name), None)

    def _is_true(self, node: ast.Call, name: str) -> bool:
        value = self._keyword(node, name)
        return isinstance(value, ast.Constant) and value.value is True

    def visit_Call(self, node: ast.Call) -> None:
        name = self._qualname(node.func)
        if name:
            self._check_call(node, name)
        self.generic_visit(node)

    def _check_call(self, node: ast.Call, name: str) -> None:
        if name in ("eval", "exec", "__import__", "builtins.eval", "builtins.exec", "builtins.__import__"):
            self._add(node, "eval-exec", f"{name}(...)")
        elif name in ("torch.load", "torch.serialization.load") and not self._is_true(node, "weights_only"):
            self._add(node, "torch-load", f"{name} without weights_only=True")
        elif name.startswith("torch.distributed.") and "_object" in name.rsplit(".", 1)[-1]:
            self._add(node, "object-collective", f"{name} unpickles what peers send")
        elif name == "numpy.load" and self._is_true(node, "allow_pickle"):
            self._add(node, "numpy-pickle", "numpy.load(allow_pickle=True)")
        elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
            self._add(node, "yaml-unsafe", f"{name}(...)")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = self._keyword(node, "Loader")
            if loader is None and len(node.args) > 1:
                loader = node.args[1]
            if loader is None or self._qualname(loader) not in SAFE_YAML_LOADERS:
                self._add(node, "yaml-unsafe", f"{name} without a safe Loader")
        elif name.startswith("subprocess.") and self._is_true(node, "shell"):
            self._add(node, "shell", f"{name}(shell=True)")
        elif name in DYNAMIC_IMPORTS:
            self.dynamic_sites.append(Finding(self.path, node.lineno, "dynamic-import", name, ".".join(self.scope)))


def scan_source(source: str, path: str = "<memory>") -> tuple[list[Finding], list[Finding]]:
    """Scan one module's source: (findings, dynamic-import sites)."""
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings, scanner.dynamic_sites


def wire_files() -> list[Path]:
    return sorted(p for d in WIRE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def scan_repo() -> tuple[list[Finding], list[Finding]]:
    findings: list[Finding] = []
    sites: list[Finding] = []
    for path in wire_files():
        f, s = scan_source(path.read_text(), str(path.relative_to(ROOT)))
        findings += f
        sites += s
    return findings, sites


# -- the scan of the real code ------------------------------------------------------------------------

def test_wire_code_is_scanned():
    files = {str(p.relative_to(ROOT)) for p in wire_files()}
    for expected in ("topics/codec.py", "topics/schemas.py", "streamforge/config.py"):
        assert expected in files
    assert all(any(f.startswith(d + "/") for f in files) for d in WIRE_DIRS)


def test_no_pickle_eval_or_unsafe_load_on_wire_paths():
    findings, _ = scan_repo()
    unsafe = [f for f in findings if not (f.rule == "eval-exec" and (f.path, f.function) in ALLOWED_EXEC)]
    assert not unsafe, "unsafe code on a network path:\n" + "\n".join(map(str, unsafe))
    stale = set(ALLOWED_EXEC) - {(f.path, f.function) for f in findings if f.rule == "eval-exec"}
    assert not stale, f"allow-listed exec sites that no longer exist: {sorted(stale)}"


def test_dynamic_imports_only_at_reviewed_config_sites():
    _, sites = scan_repo()
    unreviewed = [s for s in sites if (s.path, s.function) not in ALLOWED_DYNAMIC_IMPORTS]
    assert not unreviewed, (
        "dynamic import at a site nobody reviewed (check its argument comes only from config, then add it to "
        "ALLOWED_DYNAMIC_IMPORTS):\n" + "\n".join(map(str, unreviewed)))
    stale = set(ALLOWED_DYNAMIC_IMPORTS) - {(s.path, s.function) for s in sites}
    assert not stale, f"allow-listed dynamic-import sites that no longer exist: {sorted(stale)}"


# -- the scanner itself catches what it claims to -----------------------------------------------------

@pytest.mark.parametrize(("source", "rule"), [
    ("import pickle", "pickle-import"),
    ("import cloudpickle as cp", "pickle-import"),
    ("from dill import loads", "pickle-import"),
    ("import marshal", "pickle-import"),
    ("from pickle import loads as l", "pickle-import"),
    ("eval(payload)", "eval-exec"),
    ("def f(m):\n    exec(m.value)", "eval-exec"),
    ("__import__(name)", "eval-exec"),
    ("import torch\ntorch.load(path)", "torch-load"),
    ("import torch\ntorch.load(path, weights_only=False)", "torch-load"),
    ("import torch as t\nt.load(path, weights_only=flag)", "torch-load"),
    ("from torch import load\nload(path)", "torch-load"),
    ("import torch.distributed as dist\ndist.broadcast_object_list(objs, src=0)", "object-collective"),
    ("from torch.distributed import recv_object_list\nrecv_object_list(objs)", "object-collective"),
    ("import torch\ntorch.distributed.all_gather_object(out, obj)", "object-collective"),
    ("import numpy as np\nnp.load(f, allow_pickle=True)", "numpy-pickle"),
    ("import yaml\nyaml.load(text)", "yaml-unsafe"),
    ("import yaml\nyaml.load(text, Loader=yaml.Loader)", "yaml-unsafe"),
    ("import yaml\nyaml.unsafe_load(text)", "yaml-unsafe"),
    ("import subprocess\nsubprocess.run(cmd, shell=True)", "shell"),
])
def test_scanner_flags(source, rule):
    findings, _ = scan_source(source)
    assert [f.rule for f in findings] == [rule], findings


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(path, weights_only=True)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import orjson, msgpack\norjson.loads(b)\nmsgpack.unpackb(b)",
    "model.eval()\nself.exec = 1",
    "import numpy as np\nnp.load(f)",
    "import subprocess\nsubprocess.run(['tansu', 'broker'])",
    "import torch.distributed as dist\ndist.broadcast(t, src=0)",
    "from safetensors.torch import load_file\nload_file(p)",
])
def test_scanner_passes_safe_code(source):
    findings, sites = scan_source(source)
    assert findings == [] and sites == []


def test_scanner_reports_dynamic_import_site_with_its_function():
    source = (
        "import importlib\nfrom pkgutil import resolve_name\n"
        "class Rewards:\n    def load(self, spec):\n        return importlib.import_module(spec)\n"
        "def role_class(name):\n    return resolve_name(name)\n")
    findings, sites = scan_source(source, "producers/x.py")
    assert findings == []
    assert {(s.path, s.function, s.detail) for s in sites} == {
        ("producers/x.py", "Rewards.load", "importlib.import_module"),
        ("producers/x.py", "role_class", "pkgutil.resolve_name"),
    }
