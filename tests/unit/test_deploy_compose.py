"""deploy/compose stays deployable: every service references what exists, Kafka runs KRaft and NATS JetStream,
each role's environment holds only config keys (secrets never inline) and loads with its mounted run config.
``docker compose config`` runs only where a ``docker compose`` CLI answers.
"""

from __future__ import annotations

import ast
import shutil
import subprocess

import pytest

from streamforge.config import load_config
from tests.helpers.deploy import (
    COMPOSE,
    COMPOSE_DIR,
    COMPOSE_GPU,
    ROLES,
    ROOT,
    SECRET_ENV,
    check_env_names,
    compose,
    load_docs,
    role_of,
)


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_services_reference_what_exists():
    doc = compose()
    services, volumes = doc["services"], set(doc.get("volumes", {}))
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            dockerfile = (COMPOSE_DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve()
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
        for dep in svc.get("depends_on", {}):
            assert dep in services and dep != name, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE_DIR / source).exists(), f"{name}: bind source {source}"
            else:
                assert source in volumes, f"{name}: named volume {source} is not declared"
        for key, value in service_env(svc).items():
            assert "${" not in value, f"{name}: {key} relies on host interpolation"


def test_compose_runs_kraft_kafka_nats_jetstream_and_every_role():
    services = compose()["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert kafka["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert not any("zookeeper" in n for n in services)
    nats = services["nats"]
    assert nats["image"].startswith("nats:2.10")
    assert "-js" in nats["command"]
    store = nats["command"][nats["command"].index("-sd") + 1]
    assert any(v.endswith(":" + store) for v in nats["volumes"])
    roles = {role_of(s["command"]): n for n, s in services.items() if role_of(s.get("command", []))}
    assert set(roles) == ROLES and all(roles[r] == r for r in ROLES)
    images = {services[r]["image"] for r in ROLES} | {services["topics-init"]["image"]}
    assert images == {"streamforge:cpu"}, "one image for every role"
    assert services["topics-init"]["command"][:3] == ["streamforge", "topics", "create"]
    for role in ROLES:
        deps = services[role]["depends_on"]
        assert deps["topics-init"]["condition"] == "service_completed_successfully", role


@pytest.mark.parametrize("name", sorted(compose()["services"]))
def test_compose_env_is_config_keys_and_loads(name, tmp_path):
    svc = compose()["services"][name]
    env = service_env(svc)
    check_env_names(list(env), f"compose service {name}")
    assert not set(env) & SECRET_ENV, f"{name}: pass secrets with an env_file or secrets, not inline"
    command = svc.get("command", [])
    if command[:1] == ["streamforge"]:
        config_path = command[command.index("--config") + 1]
        mount = next(v for v in svc["volumes"] if v.split(":")[1] == config_path)
        config = load_config(COMPOSE_DIR / mount.split(":")[0], environ=env)
        bootstrap_host = config.kafka.bootstrap.split(":")[0]
        nats_host = config.nats.url.split("//")[1].split(":")[0]
        assert {bootstrap_host, nats_host} <= set(compose()["services"]), "brokers are compose services"
        mounted = [v.split(":")[1] for v in svc["volumes"]]
        for path in (config.run.run_dir, config.model.path, config.weightsync.shared_dir):
            assert any(path.startswith(m + "/") for m in mounted), f"{name}: {path} is on no volume"


def test_compose_model_init_calls_the_tiny_model_builder():
    command = compose()["services"]["model-init"]["command"]
    assert command[:2] == ["python", "-c"]
    tree = ast.parse((ROOT / "models" / "tiny_model.py").read_text())
    assert "build_tiny_model" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "from models.tiny_model import build_tiny_model" in command[2]


def test_compose_gpu_override_targets_real_services():
    base = compose()["services"]
    override = load_docs(COMPOSE_GPU)[0]["services"]
    assert set(override) <= set(base)
    for name, svc in override.items():
        assert (COMPOSE_DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve().is_file()
        check_env_names(list(service_env(svc)), f"gpu override {name}")
    for role in ("generator", "trainer"):
        devices = override[role]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def _compose_cli() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False).returncode == 0


@pytest.mark.skipif(not _compose_cli(), reason="no `docker compose` CLI here (it needs no engine to check files)")
def test_docker_compose_config_accepts_the_files():
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        args = [a for f in files for a in ("-f", str(f))]
        done = subprocess.run(["docker", "compose", *args, "config", "-q"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
