"""deploy/ stays deployable: every YAML parses, the Kubernetes objects are well formed (compose has
``test_deploy_compose.py``), and every ``STREAMFORGE_*`` variable they set is a real config key
(``streamforge.config.env_overrides``) or a secret the code reads by name, set from a Secret and never inline. Each
role's full environment plus the run config it mounts must load with ``load_config``, so a wrong value type fails
here and not at deploy time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

from streamforge.config import load_config
from tests.helpers.deploy import (
    DEPLOY,
    DNS_1123,
    IMAGE,
    K8S,
    K8S_REQUIRED,
    NAMESPACED,
    ROLES,
    ROOT,
    SECRET_ENV,
    by_kind,
    check_env_names,
    compose,
    k8s_objects,
    load_docs,
    pod_spec,
    role_of,
    yaml_files,
)

# -- every file --------------------------------------------------------------------------------------

def test_deploy_tree_has_every_piece():
    for rel in ("docker/Dockerfile.cpu", "docker/Dockerfile.gpu", "compose/docker-compose.yml", "compose/run.yaml",
                "k8s/base/kustomization.yaml", "k8s/gpu/kustomization.yaml", "README.md"):
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses_to_mappings(path):
    docs = load_docs(path)
    assert docs and all(isinstance(d, dict) for d in docs)


def test_readme_lists_every_deploy_file():
    readme = (DEPLOY / "README.md").read_text()
    missing = [str(p.relative_to(DEPLOY)) for p in sorted(DEPLOY.rglob("*")) if p.is_file() and p.name != "README.md"
               and str(p.relative_to(DEPLOY)) not in readme]
    assert not missing, f"deploy/README.md does not mention {missing}"


# -- Kubernetes --------------------------------------------------------------------------------------

def test_kustomizations_list_existing_files_and_every_manifest():
    base = load_docs(K8S / "base" / "kustomization.yaml")[0]
    assert base["kind"] == "Kustomization"
    listed = set(base["resources"])
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    examples = {n for n in on_disk if ".example." in n}
    assert listed == on_disk - examples, "base kustomization resources differ from the manifests on disk"
    assert examples, "the secrets example documents the Secret names the pods reference"
    gpu = load_docs(K8S / "gpu" / "kustomization.yaml")[0]
    assert gpu["resources"] == ["../base"]
    for patch in gpu["patches"]:
        assert (K8S / "gpu" / patch["path"]).is_file()
    assert {i["name"] for i in gpu["images"]} == {IMAGE}


@pytest.mark.parametrize("path", sorted(K8S.rglob("*.yaml")), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_objects_are_well_formed(path):
    for obj in load_docs(path):
        if obj.get("kind") == "Kustomization":
            assert obj["apiVersion"].startswith("kustomize.config.k8s.io/")
            continue
        for key in ("apiVersion", "kind", "metadata"):
            assert key in obj, f"{path.name}: missing {key}"
        assert obj["kind"] in K8S_REQUIRED, f"{path.name}: kind {obj['kind']} not reviewed in K8S_REQUIRED"
        if path.parent.name == "gpu":
            continue  # strategic-merge patches: partial objects, checked against base below
        for key in K8S_REQUIRED[obj["kind"]]:
            assert key in obj, f"{path.name}: {obj['kind']} needs {key}"
        assert DNS_1123.match(obj["metadata"]["name"]), obj["metadata"]["name"]
        if obj["kind"] in NAMESPACED:
            assert obj["metadata"].get("namespace") == "streamforge", f"{obj['metadata']['name']}: namespace"


def test_k8s_has_the_agreed_workloads():
    objs = k8s_objects()
    roles = {}
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in pod_spec(obj)["containers"]:
                if role := role_of(c.get("args", [])):
                    roles[role] = obj["kind"]
    assert roles == {"generator": "Deployment", "buffer": "Deployment", "trainer": "StatefulSet", "feeder": "Job"}
    jobs = [c["args"] for j in by_kind(objs, "Job").values() for c in pod_spec(j)["containers"]]
    assert any(a[:3] == ["streamforge", "topics", "create"] for a in jobs), "a Job creates the topics"


def test_k8s_workloads_are_consistent():
    objs = k8s_objects()
    config_maps, secrets = by_kind(objs, "ConfigMap"), by_kind(objs, "Secret")
    for kind in ("Deployment", "StatefulSet", "Job"):
        for name, obj in by_kind(objs, kind).items():
            spec, pod = obj["spec"], pod_spec(obj)
            labels = obj["spec"]["template"]["metadata"]["labels"]
            if kind != "Job":
                assert spec["selector"]["matchLabels"].items() <= labels.items(), f"{name}: selector"
            else:
                assert pod["restartPolicy"] in ("OnFailure", "Never")
            assert pod["securityContext"]["runAsNonRoot"] is True, f"{name} runs as root"
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
            for v in volumes.values():
                if "configMap" in v:
                    assert v["configMap"]["name"] in config_maps, f"{name}: volume {v['name']}"
                if "secret" in v:
                    assert v["secret"]["secretName"] in secrets, f"{name}: volume {v['name']}"
            for c in pod.get("initContainers", []) + pod["containers"]:
                where = f"{name}/{c['name']}"
                assert c["image"].split(":")[0] == IMAGE, where
                args = c.get("command", []) + c.get("args", [])
                assert args and args[0] in ("streamforge", "python"), f"{where}: no streamforge command"
                assert "memory" in c["resources"]["limits"], f"{where}: no memory limit"
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes or m["name"] in claims, f"{where}: mount {m['name']}"
                if "--config" in args:
                    path = args[args.index("--config") + 1]
                    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == path)
                    assert "configMap" in volumes[mount["name"]], f"{where}: --config is not the ConfigMap"
                for ref in c.get("envFrom", []):
                    assert ref["configMapRef"]["name"] in config_maps, where
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["key"] in secrets[ref["name"]]["stringData"], f"{where}: {env['name']}"


def test_trainer_statefulset_keeps_checkpoints_on_a_pvc():
    objs = k8s_objects()
    trainer = by_kind(objs, "StatefulSet")["streamforge-trainer"]
    service = by_kind(objs, "Service")[trainer["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= trainer["spec"]["template"]["metadata"]["labels"].items()
    assert trainer["spec"]["replicas"] == 1
    claims = {c["metadata"]["name"] for c in trainer["spec"]["volumeClaimTemplates"]}
    container = pod_spec(trainer)["containers"][0]
    env = container_environ(container, by_kind(objs, "ConfigMap"))
    config = load_config(run_yaml(objs), environ=env)
    runs_mount = mount_for(container, config.run.run_dir)
    assert runs_mount["name"] in claims, "checkpoints and ledger must live on the PVC"


def run_yaml(objs: list[dict], tmp: Path | None = None) -> Path:
    text = by_kind(objs, "ConfigMap")["streamforge-run"]["data"]["run.yaml"]
    path = (tmp or Path(tempfile.mkdtemp())) / "run.yaml"
    path.write_text(text)
    return path


def container_environ(container: dict, config_maps: dict[str, dict]) -> dict[str, str]:
    """The environment a container sees: envFrom ConfigMaps, then env (valueFrom -> a placeholder)."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        env.update({k: str(v) for k, v in config_maps[ref["configMapRef"]["name"]]["data"].items()})
    for item in container.get("env", []):
        env[item["name"]] = str(item["value"]) if "value" in item else "from-secret-or-field"
    return env


def mount_for(container: dict, path: str) -> dict:
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    assert mounts, f"{container['name']}: {path} is on no mounted volume"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def all_k8s_containers() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        for obj in load_docs(path):
            if obj.get("kind") in ("Deployment", "StatefulSet", "Job"):
                for c in pod_spec(obj).get("initContainers", []) + pod_spec(obj)["containers"]:
                    out.append((f"{path.relative_to(K8S)}:{obj['metadata']['name']}/{c['name']}", c))
    return out


@pytest.mark.parametrize(("where", "container"), all_k8s_containers(), ids=lambda x: x if isinstance(x, str) else "")
def test_k8s_env_names_are_config_keys_and_secrets_come_from_secrets(where, container):
    check_env_names([e["name"] for e in container.get("env", [])], where)
    for item in container.get("env", []):
        if item["name"] in SECRET_ENV:
            assert "secretKeyRef" in item.get("valueFrom", {}), f"{where}: {item['name']} must come from a Secret"


def test_k8s_config_maps_hold_valid_config():
    objs = k8s_objects()
    env_map = by_kind(objs, "ConfigMap")["streamforge-env"]["data"]
    check_env_names(list(env_map), "ConfigMap streamforge-env")
    assert not set(env_map) & SECRET_ENV, "secrets never go in a ConfigMap"


def test_each_k8s_role_loads_its_full_config(tmp_path):
    objs = k8s_objects()
    path = run_yaml(objs, tmp_path)
    config_maps = by_kind(objs, "ConfigMap")
    seen = set()
    for kind in ("Deployment", "StatefulSet", "Job"):
        for obj in by_kind(objs, kind).values():
            for c in pod_spec(obj)["containers"]:
                env = container_environ(c, config_maps)
                config = load_config(path, environ=env)
                assert config.kafka.sasl_password_env in env, "the Kafka password env the config names is set"
                if role := role_of(c["args"]):
                    seen.add(role)
                    mount_for(c, config.run.run_dir)
                    mount_for(c, config.model.path)
    assert seen == ROLES


def test_gpu_overlay_patches_existing_containers_with_gpus():
    base = k8s_objects(examples=False)
    for path in sorted((K8S / "gpu").glob("*-gpu.yaml")):
        patch = load_docs(path)[0]
        target = by_kind(base, patch["kind"]).get(patch["metadata"]["name"])
        assert target is not None, f"{path.name} patches no base object"
        names = {c["name"] for c in pod_spec(target)["containers"]}
        for c in pod_spec(patch)["containers"]:
            assert c["name"] in names, f"{path.name}: container {c['name']} not in base"
            assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    patched = {load_docs(p)[0]["metadata"]["name"] for p in (K8S / "gpu").glob("*-gpu.yaml")}
    assert patched == {"streamforge-generator", "streamforge-trainer"}


# -- rendered kustomizations (kubectl's built-in kustomize; optional schema validation) ----------------

def render(overlay: str) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (kustomize) here")


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_kustomize_renders_every_object_into_the_namespace(overlay):
    rendered = render(overlay)
    assert {(o["kind"], o["metadata"]["name"]) for o in rendered} == {
        (o["kind"], o["metadata"]["name"]) for o in k8s_objects(examples=False)}
    for obj in rendered:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "streamforge"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "streamforge"


@needs_kubectl
def test_gpu_overlay_renders_gpu_roles_that_still_load_their_config(tmp_path):
    rendered = render("gpu")
    path = run_yaml(rendered, tmp_path)
    config_maps = by_kind(rendered, "ConfigMap")
    gpu_roles = set()
    for obj in rendered:
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        for c in pod_spec(obj).get("initContainers", []) + pod_spec(obj)["containers"]:
            assert c["image"] == "streamforge:gpu"
        for c in pod_spec(obj)["containers"]:
            role = role_of(c["args"])
            if c["resources"].get("limits", {}).get("nvidia.com/gpu"):
                gpu_roles.add(role)
                assert c["envFrom"] and any(e["name"] == "STREAMFORGE_KAFKA_PASSWORD" for e in c["env"]), \
                    "the patch merged into the base container instead of replacing it"
            load_config(path, environ=container_environ(c, config_maps))
    assert gpu_roles == {"generator", "trainer"}


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_rendered_manifests_match_the_kubernetes_schemas(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = render(overlay) + (load_docs(K8S / "base" / "secrets.example.yaml") if overlay == "base" else [])
    for obj in docs:
        kubernetes_validate.validate(obj, "1.32.0", strict=True)


# -- every command is a real CLI invocation ---------------------------------------------------------

def deploy_commands() -> list[tuple[str, list[str]]]:
    out = [(f"compose:{n}", s["command"]) for n, s in compose()["services"].items()
           if s.get("command", [None])[0] == "streamforge"]
    out += [(w, c["args"]) for w, c in all_k8s_containers() if c.get("args", [None])[0] == "streamforge"]
    return out


@pytest.mark.parametrize(("where", "argv"), deploy_commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_deploy_commands_parse_with_the_cli(where, argv):
    import click

    from streamforge.cli import main
    from streamforge.roles import ROLES as CLI_ROLES

    command: click.Command = main
    rest = argv[1:]
    while isinstance(command, click.Group):
        assert rest and rest[0] in command.commands, f"{where}: {argv} is not a streamforge command"
        command, rest = command.commands[rest[0]], rest[1:]
    ctx = command.make_context(argv[0], list(rest))
    assert ctx.params.get("config_path") == "/etc/streamforge/run.yaml", where
    assert not ctx.args, f"{where}: unparsed arguments {ctx.args}"
    if command.name == "run":
        assert ctx.params["role"] in CLI_ROLES, where


# -- Dockerfiles -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_dockerfiles_install_the_package_with_its_extra(flavor):
    text = (DEPLOY / "docker" / f"Dockerfile.{flavor}").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = re.findall(r'"\.\[([a-z,]+)\]"', text)
    assert len(extras) == 1, "one `pip install .[extras]` of the package"
    assert flavor in extras[0].split(",")
    assert set(extras[0].split(",")) <= set(pyproject["project"]["optional-dependencies"])
    copied = {src for line in text.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1] if not src.startswith("--")}
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"the image misses packages {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied and all((ROOT / c).exists() for c in copied)
    assert "USER streamforge" in text
    ignore = [line for line in (DEPLOY / "docker" / f"Dockerfile.{flavor}.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*", "the build context is an allow-list"
    assert {"!" + c for c in copied} <= set(ignore), "everything the Dockerfile copies is allowed in the context"
    if flavor == "cpu":
        assert next(line for line in text.splitlines() if line.startswith("FROM ")) == "FROM python:3.11-slim"
        assert "pip uninstall -y torchvision torchaudio torchcodec" in text


def test_the_nats_authorization_files_are_what_the_cli_prints() -> None:
    """``deploy/nats/authorization-*.conf`` are ``streamforge nats-permissions`` for the examples' prefixes."""
    from streamforge.config import load_config
    from streamforge.permissions import config_authorization

    k8s = load_config(None, ["--run.prefix=k8s"], environ={})
    compose = load_config(ROOT / "deploy" / "compose" / "run.yaml", [], environ={})
    for name, cfg in (("k8s", k8s), ("compose", compose)):
        assert (ROOT / "deploy" / "nats" / f"authorization-{name}.conf").read_text() == config_authorization(cfg)
