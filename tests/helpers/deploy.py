"""What the deploy/ tests share: where the files are, the roles, the secrets read by name, and YAML helpers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamforge.config import _NON_CONFIG_ENV, ENV_PREFIX, env_overrides
from topics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
COMPOSE_GPU = COMPOSE_DIR / "docker-compose.gpu.yml"
ROLES = {"feeder", "generator", "buffer", "trainer"}
# Secrets the code reads by name (never config keys): they must come from a Secret, never inline.
SECRET_ENV = {ENV_PREFIX + n.upper() for n in _NON_CONFIG_ENV if n.endswith(("password", "token"))}
IMAGE = "streamforge"

# Fields each kind must have besides apiVersion/kind/metadata; an unlisted kind fails until it is reviewed here.
K8S_REQUIRED = {
    "Namespace": (), "ConfigMap": ("data",), "Secret": (), "Service": ("spec",),
    "Deployment": ("spec",), "StatefulSet": ("spec",), "Job": ("spec",),
}
NAMESPACED = set(K8S_REQUIRED) - {"Namespace"}
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def load_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def k8s_objects(directory: Path = K8S / "base", *, examples: bool = True) -> list[dict]:
    out = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name == "kustomization.yaml" or (not examples and ".example." in path.name):
            continue
        out += load_docs(path)
    return out


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def role_of(args: list[str]) -> str | None:
    return args[2] if args[:2] == ["streamforge", "run"] and len(args) > 2 else None


def check_env_names(names: list[str], where: str) -> None:
    """Each STREAMFORGE_* name is a config key or a secret read by name (env_overrides raises otherwise)."""
    for name in names:
        if not name.startswith(ENV_PREFIX):
            continue
        try:
            env_overrides({name: "x"})
        except ConfigError as exc:
            pytest.fail(f"{where}: {name} is not a streamforge config key: {exc}")


def compose() -> dict:
    return load_docs(COMPOSE)[0]
