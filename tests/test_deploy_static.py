"""Offline checks of the deployment: k8s/ (GPU), the configuration layer k8s-config/ (every preset and the site
example rendered by kustomize), docker-compose*.yml and the Dockerfile are valid, and stay true to the code (entry
points, env vars, ports, broker config)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch
import yaml
from deploy_manifest import (
    BROKER_DIR,
    BROKER_FILES,
    BROKER_USER_RECORDS,
    COMPOSE_FILE,
    COMPOSE_GPU_FILE,
    CPU_PRESET_DIR,
    DFCA_SUBCOMMANDS,
    DOCKERFILE,
    K8S_DIR,
    PRESETS_DIR,
    REPO,
    SECRET_SCRIPT,
    Manifest,
    broker_configmap_data,
    broker_records_placeholder,
    broker_secret_files,
    compose_argv,
    compose_environment,
    compose_stand_in_env,
    container_argv,
    dockerfile_entrypoint,
    dockerfile_stages,
    env_names,
    find_manifest,
    image_repository,
    is_dfca_image,
    load_compose,
    load_manifests,
    manifest_files,
    pod_containers,
    pod_template,
    render_overlay,
    resolve_env,
    run_broker_init_container,
    selector_matches,
    with_cluster_secrets,
    worker_statefulsets,
    workloads,
)

from dfca.devices import DeviceUnavailable, worker_device
from dfca.identity import principals
from dfca.settings import DEFAULT_PORTS, ENV_VARS

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # oldest we support and newest bundled
PRESET_DIRS = {path.name: path for path in sorted(PRESETS_DIR.iterdir()) if (path / "kustomization.yaml").exists()}
# The node labels each cloud sets on a GPU node from the moment it is created (so that an autoscaler knows them from
# the pool's template and can scale a pool up from zero): the only labels a preset may require.
LABELS_THE_CLOUD_SETS = {
    "gke": {"cloud.google.com/gke-accelerator"},
    "eks": set(),  # the device plugin alone sets none
    "gpu-operator": set(),  # nvidia.com/gpu.present comes from GPU Feature Discovery after boot: preferred only
    "cpu": set(),
}
CUSTOM_RESOURCES = {"ServiceMonitor"}  # kinds from CRDs kubernetes-validate has no schema for
GPU_RESOURCE = "nvidia.com/gpu"
APP_COMPONENTS = {"topology", "metrics", "aggregator", "worker"}
API_COMPONENTS = {"topology": 8080, "metrics": 8081}


@pytest.fixture(scope="module")
def gpu_manifests() -> list[Manifest]:
    return with_cluster_secrets(load_manifests(K8S_DIR))


@pytest.fixture(scope="module")
def cpu_manifests() -> list[Manifest]:
    return with_cluster_secrets(render_overlay(CPU_PRESET_DIR))


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def manifests(request: pytest.FixtureRequest, gpu_manifests: list[Manifest],
              cpu_manifests: list[Manifest]) -> list[Manifest]:
    return gpu_manifests if request.param == "gpu" else cpu_manifests


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE_FILE)


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return load_compose(COMPOSE_GPU_FILE)


def component(workload: Manifest) -> str:
    return pod_template(workload)["metadata"]["labels"]["app.kubernetes.io/component"]


def dfca_containers(workload: Manifest) -> list[Manifest]:
    return [c for c in pod_containers(workload) if is_dfca_image(c["image"])]


def compose_dfca_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if is_dfca_image(svc.get("image", ""))}


# ---------------------------------------------------------------- validity


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_pass_kubernetes_validate_strict(version: str, tmp_path: Path,
                                                   cpu_manifests: list[Manifest]) -> None:
    rendered = tmp_path / "cpu-rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(cpu_manifests, sort_keys=False))
    validate_strict([*manifest_files(K8S_DIR), rendered], version)


def validate_strict(files: list[Path], version: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version, *map(str, files)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "did not validate" not in result.stdout + result.stderr


def test_yaml_lints_clean() -> None:
    targets = [K8S_DIR, REPO / "k8s-config", COMPOSE_FILE, COMPOSE_GPU_FILE, REPO / ".yamllint"]
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-c", str(REPO / ".yamllint"), *map(str, targets)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("files", [[COMPOSE_FILE], [COMPOSE_FILE, COMPOSE_GPU_FILE]], ids=["cpu", "gpu"])
def test_compose_config_is_valid(files: list[Path], tmp_path: Path) -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose (Debian package docker-compose) is not installed")
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{key}={value}\n" for key, value in compose_stand_in_env().items()))
    args = [arg for path in files for arg in ("-f", str(path))]
    result = subprocess.run(["docker-compose", "--env-file", str(env_file), *args, "config", "-q"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_k8s_top_level_holds_only_plain_manifests_in_the_dfca_namespace(gpu_manifests: list[Manifest]) -> None:
    assert not (K8S_DIR / "kustomization.yaml").exists(), "`kubectl apply -f k8s/` would try to apply it"
    assert manifest_files(K8S_DIR)[0].name == "00-namespace.yaml", "the Namespace must be applied first"
    for doc in gpu_manifests:
        assert {"apiVersion", "kind", "metadata"} <= set(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "dfca", doc["metadata"]["name"]


def test_the_base_kustomization_is_exactly_the_top_level_manifests() -> None:
    """k8s/Kustomization (no .yaml suffix: `kubectl apply -f k8s/` skips it) lists every file that `kubectl apply -f
    k8s/` applies, so the configuration layer and the one-command deployment never part."""
    kustomization = yaml.safe_load((K8S_DIR / "Kustomization").read_text())
    assert sorted(K8S_DIR / resource for resource in kustomization["resources"]) == manifest_files(K8S_DIR)
    assert "Kustomization" not in [path.name for path in manifest_files(K8S_DIR)]

    def canonical(docs: list[Manifest]) -> list[str]:
        return sorted(json.dumps(doc, sort_keys=True) for doc in docs)

    assert canonical(render_overlay(K8S_DIR)) == canonical(load_manifests(K8S_DIR))


# ---------------------------------------------------------------- true to the code


def registered_subcommands() -> set[str]:
    import typer

    from dfca.cli.main import app

    return set(typer.main.get_command(app).commands)


def test_the_service_subcommands_exist_in_the_cli() -> None:
    assert set(DFCA_SUBCOMMANDS) <= registered_subcommands()


def test_k8s_dfca_containers_run_a_dfca_service_subcommand(manifests: list[Manifest]) -> None:
    run = {}
    for workload in workloads(manifests):
        for container in dfca_containers(workload):
            argv = container_argv(container, dockerfile_entrypoint(DOCKERFILE.read_text()))
            assert argv[0] == "dfca" and len(argv) == 2 and argv[1] in DFCA_SUBCOMMANDS, argv
            assert argv[1] == component(workload), f"{workload['metadata']['name']} runs {argv}"
            run[argv[1]] = workload["metadata"]["name"]
    assert set(run) == set(DFCA_SUBCOMMANDS)


def test_compose_dfca_services_run_a_dfca_service_subcommand(compose: dict[str, Any]) -> None:
    entrypoint = dockerfile_entrypoint(DOCKERFILE.read_text())
    run = set()
    for name, service in compose_dfca_services(compose).items():
        argv = compose_argv(service, entrypoint)
        assert argv[0] == "dfca" and len(argv) == 2 and argv[1] in DFCA_SUBCOMMANDS, (name, argv)
        assert name.split("-")[0] == argv[1], (name, argv)
        run.add(argv[1])
    assert run == set(DFCA_SUBCOMMANDS)


def test_k8s_env_vars_are_the_ones_the_services_read(manifests: list[Manifest]) -> None:
    for workload in workloads(manifests):
        for container in pod_containers(workload):
            names = env_names(container, manifests)
            if is_dfca_image(container["image"]):
                assert names, container["name"]
                assert names <= set(ENV_VARS), names - set(ENV_VARS)
            else:
                assert container["image"].startswith("rabbitmq:"), container["image"]
                assert all(name.startswith("RABBITMQ_") for name in names), names


def test_compose_env_vars_are_the_ones_the_services_read(compose: dict[str, Any],
                                                         compose_gpu: dict[str, Any]) -> None:
    for document in (compose, compose_gpu):
        for name, service in document["services"].items():
            names = set(compose_environment(service))
            if name == "rabbitmq":
                assert all(n.startswith("RABBITMQ_") for n in names), names
            else:
                assert names <= set(ENV_VARS), (name, names - set(ENV_VARS))


def test_only_the_rest_services_hold_the_api_token(manifests: list[Manifest], compose: dict[str, Any],
                                                  compose_gpu: dict[str, Any]) -> None:
    """Workers and the aggregator only read the REST API (DFCA_READ_TOKEN): a compromised one cannot create, start,
    stop or delete an experiment."""
    holders = set()
    for workload in workloads(manifests):
        for container in dfca_containers(workload):
            if "DFCA_API_TOKEN" in env_names(container, manifests):
                holders.add(component(workload))
    assert holders == {"topology", "metrics"}, holders
    for document in (compose, compose_gpu):
        for name, service in document["services"].items():
            if name.startswith(("worker", "aggregator")):
                assert "DFCA_API_TOKEN" not in compose_environment(service), name
    assert "DFCA_API_TOKEN" in compose_environment(compose["services"]["topology"])


def test_ports_match_the_services_defaults(manifests: list[Manifest]) -> None:
    services = {doc["metadata"]["name"]: doc for doc in manifests if doc["kind"] == "Service"}
    for workload in workloads(manifests):
        for container in dfca_containers(workload):
            name = component(workload)
            env = resolve_env(container, manifests, {})
            port = int(env["DFCA_PORT"])
            assert port == DEFAULT_PORTS[name]
            assert [p["containerPort"] for p in container["ports"]] == [port]
            assert env["DFCA_HOST"] == "0.0.0.0"
            service = services[name]
            assert service["spec"]["ports"][0]["port"] == port
    config = find_manifest(manifests, "ConfigMap", "dfca-config")["data"]
    assert config["DFCA_TOPOLOGY_URL"] == f"http://topology:{DEFAULT_PORTS['topology']}"
    assert config["DFCA_METRICS_URL"] == f"http://metrics:{DEFAULT_PORTS['metrics']}"


def test_compose_ports_and_urls_match_the_services_defaults(compose: dict[str, Any]) -> None:
    for name, service in compose_dfca_services(compose).items():
        env = compose_environment(service)
        kind = name.split("-")[0]
        assert int(env["DFCA_PORT"]) == DEFAULT_PORTS[kind], name
        assert env["DFCA_HOST"] == "0.0.0.0"
        assert env["DFCA_TOPOLOGY_URL"] == f"http://topology:{DEFAULT_PORTS['topology']}"
        assert env["DFCA_METRICS_URL"] == f"http://metrics:{DEFAULT_PORTS['metrics']}"
        assert re.fullmatch(r"amqp://[^:@]+:[^@]+@rabbitmq:5672/dfca", env["DFCA_BROKER_URL"])
        assert "/readyz" in " ".join(service["healthcheck"]["test"])
        assert f":{DEFAULT_PORTS[kind]}/" in " ".join(service["healthcheck"]["test"])


def test_secret_and_config_references_resolve(manifests: list[Manifest]) -> None:
    """Every secretKeyRef/configMapKeyRef/envFrom names an object and key that the manifests define."""
    for workload in workloads(manifests):
        for container in pod_containers(workload):
            resolve_env(container, manifests, {})  # raises KeyError on a dangling ref
        for volume in pod_template(workload)["spec"].get("volumes", []):
            if "configMap" in volume:
                find_manifest(manifests, "ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                secret = find_manifest(manifests, "Secret", volume["secret"]["secretName"])
                keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
                assert {item["key"] for item in volume["secret"].get("items", [])} <= keys


def test_no_manifest_holds_a_secret_that_reapplying_would_restore() -> None:
    """`kubectl apply -f k8s/` (or the CPU overlay) never carries a Secret: scripts/k8s_secret.sh makes it once."""
    for docs in (load_manifests(K8S_DIR), *(render_overlay(p) for p in PRESET_DIRS.values())):
        assert not [d for d in docs if d.get("kind") == "Secret"]
    assert "change-me" not in "".join(p.read_text() for p in K8S_DIR.rglob("*.yaml"))


FAKE_KUBECTL = """#!/usr/bin/env bash
# A stand-in kubectl keeping Secrets as folders below $STATE: `-n NS get|create|label|delete secret ...`, and
# `exec` (the broker's rabbitmqctl import_definitions) saving its input.
set -euo pipefail
echo "$*" >> "$STATE/calls"
shift 2
verb="$1"; shift
case "$verb" in
  get)
    [ -d "$STATE/$2" ]
    case "$*" in
      *jsonpath=*) key=$(printf '%s' "$*" | sed -n 's/.*jsonpath={.data.\\(.*\\)}$/\\1/p' | tr -d '\\\\')
                   base64 -w0 "$STATE/$2/$key" ;;
    esac ;;
  create)
    name="$3"; shift 3; mkdir "$STATE/$name"
    for arg in "$@"; do
      case "$arg" in
        --from-literal=*) kv="${arg#--from-literal=}"; printf '%s' "${kv#*=}" > "$STATE/$name/${kv%%=*}" ;;
        --from-file=*) kv="${arg#--from-file=}"; cp "${kv#*=}" "$STATE/$name/${kv%%=*}" ;;
      esac
    done ;;
  label) name="$2"; [ -d "$STATE/$name" ]; shift 2; printf '%s\\n' "$@" >> "$STATE/$name.labels" ;;
  delete)
    if [ "$2" = "-l" ]; then
      for d in "$STATE"/dfca-broker-*/; do [ -d "$d" ] && rm -r "$d"; done; true
    else
      rm -rf "${STATE:?}/$2"
    fi ;;
  exec) cat > "$STATE/imported.json" ;;
esac
"""


def run_secret_script(tmp_path: Path, workers: int | None = None) -> subprocess.CompletedProcess[str]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    if not bin_dir.exists():
        bin_dir.mkdir()
        state.mkdir()
        (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
        (bin_dir / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state), "PYTHON": sys.executable}
    if workers is not None:
        env["WORKERS"] = str(workers)
    return subprocess.run(["bash", str(SECRET_SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_the_secret_script_makes_tokens_and_one_broker_user_per_principal_once(tmp_path: Path,
                                                                               gpu_manifests: list[Manifest]) -> None:
    """Against a stand-in kubectl: random tokens and a broker user per principal on the first run (each URL's
    password is the one whose hash the broker loads); everything kept on the next; a different number of workers
    refused with how to re-size."""
    first = run_secret_script(tmp_path)
    assert first.returncode == 0, first.stderr
    state = tmp_path / "state"
    tokens = {f.name: f.read_text() for f in (state / "dfca-secrets").iterdir()}
    assert set(tokens) == set(find_manifest(gpu_manifests, "Secret", "dfca-secrets")["stringData"])
    assert all(re.fullmatch(r"[0-9a-f]{64}", value) for value in tokens.values()) and len(set(tokens.values())) == 2
    workers = len(worker_statefulsets(gpu_manifests))
    wanted = {*principals.SERVICES, *(principals.worker(i) for i in range(workers))}
    assert {d.name for d in state.iterdir() if d.is_dir()} == {"dfca-secrets", "dfca-broker-users",
                                                                 *(f"dfca-broker-{p}" for p in wanted)}
    records = {f.name: json.loads(f.read_text()) for f in (state / "dfca-broker-users").iterdir()}
    assert set(records) == set(broker_secret_files(gpu_manifests))
    hashes = {user["name"]: user["password_hash"] for user in records["users.json"]}
    for principal in wanted:
        url = urlsplit((state / f"dfca-broker-{principal}" / "url").read_text())
        assert (url.hostname, url.port, url.path, url.username) == ("rabbitmq", 5672, "/dfca",
                                                                  principals.user_of(principal))
        salt_and_digest = base64.b64decode(hashes[url.username])
        salt = salt_and_digest[:4]
        assert hashlib.sha256(salt + unquote(url.password).encode()).digest() == salt_and_digest[4:]
        assert "dfca.dev/broker-users=true" in (state / f"dfca-broker-{principal}.labels").read_text()
    calls = (state / "calls").read_text()
    again = run_secret_script(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "kept as it is" in again.stdout and "kept as they are" in again.stdout
    assert " create " not in (state / "calls").read_text()[len(calls):]
    urls = {p: (state / f"dfca-broker-{p}" / "url").read_text() for p in wanted}
    resized = run_secret_script(tmp_path, workers=workers + 1)
    assert resized.returncode == 0, resized.stderr
    assert "imported them into the running broker" in resized.stdout
    new = principals.worker(workers)
    assert {p: (state / f"dfca-broker-{p}" / "url").read_text() for p in wanted} == urls, "nobody re-passworded"
    assert (state / f"dfca-broker-{new}" / "url").read_text().startswith(f"amqp://{principals.user_of(new)}:")
    merged = {f.name: json.loads(f.read_text()) for f in (state / "dfca-broker-users").iterdir()}
    assert {u["name"] for u in merged["users.json"]} == {principals.user_of(p) for p in [*wanted, new]}
    assert merged["users.json"][:len(records["users.json"])] == records["users.json"]
    imported = json.loads((state / "imported.json").read_text())
    assert [u["name"] for u in imported["users"]] == [principals.user_of(new)]
    assert {p["user"] for p in imported["permissions"]} == {principals.user_of(new)}
    assert " rabbitmqctl import_definitions" in (state / "calls").read_text()


def test_each_workload_holds_only_its_own_broker_user(manifests: list[Manifest]) -> None:
    """Topology, metrics, the aggregator and each worker read their own dfca-broker-<principal> Secret and no
    other; only the broker mounts the users' records."""
    for workload in workloads(manifests):
        name = workload["metadata"]["name"]
        referenced = {ref["secretKeyRef"]["name"] for container in pod_containers(workload)
                      for ref in (e.get("valueFrom", {}) for e in container.get("env", [])) if "secretKeyRef" in ref}
        volumes = pod_template(workload)["spec"].get("volumes", [])
        mounted = {v["secret"]["secretName"] for v in volumes if "secret" in v}
        broker_secrets = {s for s in referenced | mounted if s.startswith("dfca-broker-")}
        expected = {"rabbitmq": {"dfca-broker-users"}}.get(name, {f"dfca-broker-{name}"})
        assert broker_secrets == expected, name
        if name != "rabbitmq":
            (container,) = dfca_containers(workload)
            url = urlsplit(resolve_env(container, manifests, {})["DFCA_BROKER_URL"])
            assert url.username == principals.user_of(name)


def test_k8s_workers_script_sets_the_number_of_worker_statefulsets(tmp_path: Path) -> None:
    """scripts/k8s_workers.py N: N copies of worker-0's StatefulSet, each its own ordinal and broker user, and
    DFCA_WORKERS; with the committed number it changes nothing."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s")
    script = REPO / "scripts" / "k8s_workers.py"
    committed = len(worker_statefulsets(load_manifests(K8S_DIR)))
    for workers in (committed, 3, 1):
        run = subprocess.run([sys.executable, str(script), str(workers), "--k8s-dir", str(tmp_path / "k8s")],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        if workers == committed:
            for name in ("worker.yaml", "config.yaml"):
                assert (tmp_path / "k8s" / name).read_text() == (K8S_DIR / name).read_text()
        docs = load_manifests(tmp_path / "k8s")
        statefulsets = worker_statefulsets(docs)
        assert [s["metadata"]["name"] for s in statefulsets] == [f"worker-{i}" for i in range(workers)]
        assert find_manifest(docs, "ConfigMap", "dfca-config")["data"]["DFCA_WORKERS"] == str(workers)
        with_secrets = with_cluster_secrets(docs)
        for ordinal, statefulset in enumerate(statefulsets):
            (container,) = pod_template(statefulset)["spec"]["containers"]
            env = resolve_env(container, with_secrets, {})
            assert env["DFCA_WORKER_ORDINAL"] == str(ordinal)
            assert urlsplit(env["DFCA_BROKER_URL"]).username == principals.user_of(principals.worker(ordinal))
    bad = subprocess.run([sys.executable, str(script), "0", "--k8s-dir", str(tmp_path / "k8s")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "1..1000" in bad.stderr


# ---------------------------------------------------------------- workers, GPU and CPU


def worker_statefulset(manifests: list[Manifest]) -> Manifest:
    """Worker 0's StatefulSet (the others are its copies: test_each_worker_is_one_statefulset_of_one_ordinal)."""
    return worker_statefulsets(manifests)[0]


def test_gpu_workers_request_select_and_tolerate_gpus(gpu_manifests: list[Manifest]) -> None:
    worker = worker_statefulset(gpu_manifests)
    spec = pod_template(worker)["spec"]
    (container,) = spec["containers"]
    assert int(container["resources"]["limits"][GPU_RESOURCE]) >= 1
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "affinity" not in spec and "nodeSelector" not in spec, "the base requires no node label"
    env = resolve_env(container, gpu_manifests, {})
    assert env["DFCA_DEVICE"] == "cuda"
    assert image_repository(container["image"]) == "dfca-cuda"


def test_cpu_workers_neither_request_nor_select_gpus(cpu_manifests: list[Manifest],
                                                     gpu_manifests: list[Manifest]) -> None:
    cpu_worker = worker_statefulset(cpu_manifests)
    spec = pod_template(cpu_worker)["spec"]
    assert "nvidia" not in json.dumps(cpu_worker)
    assert "tolerations" not in spec and "affinity" not in spec and "nodeSelector" not in spec
    (container,) = spec["containers"]
    assert resolve_env(container, cpu_manifests, {})["DFCA_DEVICE"] == "cpu"
    assert image_repository(container["image"]) == "dfca"
    # Apart from the GPU settings, the CPU variant is the GPU manifest: nothing else drifted.
    gpu_spec = json.loads(json.dumps(pod_template(worker_statefulset(gpu_manifests))["spec"]))
    del gpu_spec["tolerations"]
    gpu_container = gpu_spec["containers"][0]
    del gpu_container["resources"]["limits"][GPU_RESOURCE]
    gpu_container["image"] = container["image"]
    next(e for e in gpu_container["env"] if e["name"] == "DFCA_DEVICE")["value"] = "cpu"
    assert gpu_spec == spec
    cpu_workers, gpu_workers = worker_statefulsets(cpu_manifests), worker_statefulsets(gpu_manifests)
    assert [w["metadata"]["name"] for w in cpu_workers] == [w["metadata"]["name"] for w in gpu_workers]
    assert all("nvidia" not in json.dumps(w) for w in cpu_workers)
    others_cpu = [d for d in cpu_manifests if not any(d is w for w in cpu_workers)]
    others_gpu = [d for d in gpu_manifests if not any(d is w for w in gpu_workers)]
    assert sorted(json.dumps(d, sort_keys=True) for d in others_cpu) == \
        sorted(json.dumps(d, sort_keys=True) for d in others_gpu)


def test_the_manifests_device_is_where_a_worker_computes(cpu_manifests: list[Manifest], gpu_manifests: list[Manifest],
                                                          compose: dict[str, Any], compose_gpu: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker reads DFCA_DEVICE (dfca.devices.worker_device): a CPU pod computes on the CPU whatever the config
    asks, and a GPU pod computes on the GPU, or fails naming DFCA_DEVICE where the node has none."""
    cpu_env = resolve_env(pod_template(worker_statefulset(cpu_manifests))["spec"]["containers"][0], cpu_manifests,
                          {})
    gpu_env = resolve_env(pod_template(worker_statefulset(gpu_manifests))["spec"]["containers"][0], gpu_manifests,
                          {})
    compose_envs = [compose_environment(s) for n, s in compose["services"].items() if n.startswith("worker-")]
    gpu_compose_envs = [compose_environment(s) for s in compose_gpu["services"].values()]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for env in [cpu_env, *compose_envs]:
        assert worker_device("cuda", env["DFCA_DEVICE"]) == torch.device("cpu")
    for env in [gpu_env, *gpu_compose_envs]:
        assert worker_device("cpu", env["DFCA_DEVICE"]) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match="DFCA_DEVICE: cuda"):
        worker_device("cpu", gpu_env["DFCA_DEVICE"])


def test_each_worker_is_one_statefulset_of_one_ordinal(manifests: list[Manifest]) -> None:
    """One StatefulSet of one pod per worker ordinal (a StatefulSet's pods share a template, so one for all would
    give every worker every worker's broker user), numbered 0..DFCA_WORKERS-1, each selecting only its own pod,
    all copies of worker 0's apart from the ordinal."""
    statefulsets = worker_statefulsets(manifests)
    config = find_manifest(manifests, "ConfigMap", "dfca-config")["data"]
    assert len(statefulsets) == int(config["DFCA_WORKERS"]) >= 2
    template = json.dumps(statefulsets[0])
    for ordinal, worker in enumerate(statefulsets):
        assert worker["metadata"]["name"] == f"worker-{ordinal}" and worker["spec"]["replicas"] == 1
        assert json.dumps(worker) == template.replace("worker-0", f"worker-{ordinal}").replace(
            '"dfca.dev/worker-ordinal": "0"', f'"dfca.dev/worker-ordinal": "{ordinal}"').replace(
            '"name": "DFCA_WORKER_ORDINAL", "value": "0"', f'"name": "DFCA_WORKER_ORDINAL", "value": "{ordinal}"')
        (container,) = pod_template(worker)["spec"]["containers"]
        env = resolve_env(container, manifests, {})
        assert env["DFCA_WORKER_ORDINAL"] == str(ordinal)
        others = [pod_template(w)["metadata"]["labels"] for w in statefulsets if w is not worker]
        assert selector_matches(worker["spec"]["selector"], pod_template(worker)["metadata"]["labels"])
        assert not any(selector_matches(worker["spec"]["selector"], labels) for labels in others)
        claims = {t["metadata"]["name"] for t in worker["spec"]["volumeClaimTemplates"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts[env["DFCA_CHECKPOINT_DIR"]] in claims
        headless = find_manifest(manifests, "Service", worker["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"


def test_compose_workers_have_distinct_ordinals_and_volumes(compose: dict[str, Any],
                                                            compose_gpu: dict[str, Any]) -> None:
    workers = {n: s for n, s in compose["services"].items() if n.startswith("worker-")}
    envs = {n: compose_environment(s) for n, s in workers.items()}
    assert sorted(int(e["DFCA_WORKER_ORDINAL"]) for e in envs.values()) == list(range(len(workers)))
    assert all(f"worker-{e['DFCA_WORKER_ORDINAL']}" == n for n, e in envs.items())
    assert {int(e["DFCA_WORKERS"]) for e in envs.values()} == {len(workers)}
    checkpoint_volumes = [v for s in workers.values() for v in s["volumes"] if v.endswith(":/var/lib/dfca/checkpoints")]
    assert len(set(checkpoint_volumes)) == len(workers)
    assert all(e["DFCA_DEVICE"] == "cpu" for e in envs.values())
    assert "nvidia" not in json.dumps(compose)
    assert set(compose_gpu["services"]) == set(workers)
    for service in compose_gpu["services"].values():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        assert compose_environment(service)["DFCA_DEVICE"] == "cuda"
        assert service["build"]["args"]["TORCH_VARIANT"] != "cpu"


def test_compose_dependencies_wait_for_health(compose: dict[str, Any]) -> None:
    assert "healthcheck" in compose["services"]["rabbitmq"]
    for name, service in compose_dfca_services(compose).items():
        depends = service["depends_on"]
        assert depends["rabbitmq"]["condition"] == "service_healthy", name
        if name.startswith("worker-"):
            assert depends["topology"]["condition"] == depends["metrics"]["condition"] == "service_healthy"
    assert compose["services"]["aggregator"]["profiles"] == ["aggregator"]


# ---------------------------------------------------------------- probes, security, resources


def test_dfca_containers_probe_livez_and_readyz(manifests: list[Manifest]) -> None:
    for workload in workloads(manifests):
        for container in dfca_containers(workload):
            port_name = container["ports"][0]["name"]
            for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz"),
                                ("startupProbe", "/livez")):
                http = container[probe]["httpGet"]
                assert (http["path"], http["port"]) == (path, port_name), (workload["metadata"]["name"], probe)
    broker = find_manifest(manifests, "StatefulSet", "rabbitmq")
    assert "readinessProbe" in pod_template(broker)["spec"]["containers"][0]


def test_pods_are_restricted_and_non_root(manifests: list[Manifest]) -> None:
    dockerfile_user = next(rest for keyword, rest in dockerfile_stages(DOCKERFILE.read_text())[-1]["instructions"]
                           if keyword == "USER")
    uid = int(dockerfile_user.split(":")[0])
    for workload in workloads(manifests):
        spec = pod_template(workload)["spec"]
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True
        assert pod_security["runAsUser"] != 0
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        if dfca_containers(workload):
            assert pod_security["runAsUser"] == uid, "pods and image must agree on the dfca uid"
        for container in pod_containers(workload):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert security["readOnlyRootFilesystem"] is True
            assert "privileged" not in security and "hostPath" not in json.dumps(spec)


def test_every_container_has_resource_requests_and_limits(manifests: list[Manifest]) -> None:
    for workload in workloads(manifests):
        for container in pod_containers(workload):
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), (workload["metadata"]["name"], container["name"])


def test_pdb_keeps_all_but_one_worker(manifests: list[Manifest]) -> None:
    pdbs = [doc for doc in manifests if doc["kind"] == "PodDisruptionBudget"]
    covering = [pdb for pdb in pdbs
                if all(selector_matches(pdb["spec"]["selector"], pod_template(w)["metadata"]["labels"])
                       for w in worker_statefulsets(manifests))]
    assert len(covering) == 1
    assert covering[0]["spec"]["maxUnavailable"] == 1


def pod_labels_by_component(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    return {component(w): pod_template(w)["metadata"]["labels"] for w in workloads(manifests)}


def test_network_policies_deny_by_default_and_open_only_broker_and_apis(manifests: list[Manifest]) -> None:
    policies = [doc for doc in manifests if doc["kind"] == "NetworkPolicy"]
    pods = pod_labels_by_component(manifests)
    assert set(pods) == APP_COMPONENTS | {"broker"}

    def allowed(target: str) -> list[dict[str, Any]]:
        return [rule for p in policies if selector_matches(p["spec"]["podSelector"], pods[target])
                for rule in p["spec"].get("ingress", [])]

    default_deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert any(p["spec"]["policyTypes"] == ["Ingress"] for p in default_deny), "no default-deny ingress policy"
    broker_rules = [rule for rule in allowed("broker") if [port["port"] for port in rule["ports"]] != [15692]]
    assert [port["port"] for rule in broker_rules for port in rule["ports"]] == [5672]
    scrape = [rule for rule in allowed("broker") if [port["port"] for port in rule["ports"]] == [15692]]
    assert [peer["podSelector"]["matchLabels"] for rule in scrape for peer in rule["from"]] == [
        {"app.kubernetes.io/name": "prometheus"}], "only Prometheus reaches the broker's metrics port"
    reachers = {name for name, labels in pods.items()
                for rule in broker_rules for peer in rule["from"]
                if set(peer) == {"podSelector"} and selector_matches(peer["podSelector"], labels)}
    assert reachers == APP_COMPONENTS
    for name in pods:
        rules = allowed(name)
        open_to_all = [rule for rule in rules if "from" not in rule]
        if name in API_COMPONENTS:
            assert [port["port"] for rule in open_to_all for port in rule["ports"]] == [API_COMPONENTS[name]]
        else:
            assert not open_to_all, f"{name} is exposed"


def test_services_select_their_pods_and_name_real_ports(manifests: list[Manifest]) -> None:
    containers_by_component = {component(w): pod_containers(w, init=False) for w in workloads(manifests)}
    pods = pod_labels_by_component(manifests)
    for service in (doc for doc in manifests if doc["kind"] == "Service"):
        selected = [name for name, labels in pods.items()
                    if selector_matches({"matchLabels": service["spec"]["selector"]}, labels)]
        assert len(selected) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in containers_by_component[selected[0]] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


# ---------------------------------------------------------------- RabbitMQ config


def test_rabbitmq_configmap_is_the_broker_files_byte_for_byte(gpu_manifests: list[Manifest]) -> None:
    data = find_manifest(gpu_manifests, "ConfigMap", "rabbitmq-config")["data"]
    assert set(data) == set(BROKER_FILES)
    assert data == broker_configmap_data(), "run: python tests/deploy_manifest.py --write-rabbitmq-config"
    for name in BROKER_FILES:
        original = (BROKER_DIR / name).read_text()
        if name != "definitions.json":
            assert data[name] == original
            continue
        ours, theirs = json.loads(data[name]), json.loads(original)
        for key in BROKER_USER_RECORDS:  # no shared user: the Secret's principals stand here
            assert ours.pop(key) == broker_records_placeholder(key)
            theirs.pop(key)
        assert ours == theirs


def test_rabbitmq_reads_the_config_where_it_is_mounted(gpu_manifests: list[Manifest],
                                                       compose: dict[str, Any]) -> None:
    conf = (BROKER_DIR / "rabbitmq.conf").read_text()
    definitions_path = re.search(r"^load_definitions\s*=\s*(\S+)$", conf, re.M).group(1)
    broker = pod_template(find_manifest(gpu_manifests, "StatefulSet", "rabbitmq"))["spec"]
    mounts = {m["mountPath"] for m in broker["containers"][0]["volumeMounts"]}
    assert str(Path(definitions_path).parent) in mounts
    init_script = broker["initContainers"][0]["command"][-1]
    assert f"> {definitions_path}" in init_script
    binds = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["rabbitmq"]["volumes"]
             if v.startswith("./")}
    assert binds[definitions_path] == compose_stand_in_env()["DFCA_BROKER_DEFINITIONS"]  # compose_broker_users.sh
    assert binds["/etc/rabbitmq/rabbitmq.conf"] == "./broker/rabbitmq.conf"
    assert binds["/etc/rabbitmq/enabled_plugins"] == "./broker/enabled_plugins"
    assert "rabbitmq_management" in (BROKER_DIR / "enabled_plugins").read_text()
    assert "rabbitmq_prometheus" in (BROKER_DIR / "enabled_plugins").read_text()


def test_rabbitmq_init_container_puts_the_principals_into_definitions(
        gpu_manifests: list[Manifest], tmp_path: Path) -> None:
    files = broker_secret_files(gpu_manifests)
    result = run_broker_init_container(gpu_manifests, files, tmp_path)
    assert result.returncode == 0, result.stderr
    rendered = tmp_path / "config"
    definitions = json.loads((rendered / "definitions.json").read_text())
    for key in BROKER_USER_RECORDS:
        assert definitions[key] == json.loads(files[f"{key}.json"])
    assert "dfca" not in {user["name"] for user in definitions["users"]}
    original = json.loads((BROKER_DIR / "definitions.json").read_text())
    for key in ("vhosts", "exchanges", "queues", "bindings", "policies"):
        assert definitions[key] == original[key]
    assert (rendered / "enabled_plugins").read_bytes() == (BROKER_DIR / "enabled_plugins").read_bytes()
    ours = (rendered / "rabbitmq.conf").read_text().splitlines()
    theirs = (BROKER_DIR / "rabbitmq.conf").read_text().splitlines()
    assert ours[:-1] == [line for line in theirs if not line.startswith("vm_memory_high_watermark.")]
    assert ours[-1].startswith("vm_memory_high_watermark.absolute = ")


@pytest.mark.parametrize("records", ["", '{"name": "x"}', "null", "[1] trailing"])
def test_rabbitmq_init_container_refuses_records_that_are_not_json_arrays(
        gpu_manifests: list[Manifest], tmp_path: Path, records: str) -> None:
    files = {**broker_secret_files(gpu_manifests), "permissions.json": records}
    result = run_broker_init_container(gpu_manifests, files, tmp_path)
    assert result.returncode != 0 and "scripts/k8s_secret.sh" in result.stderr
    assert not (tmp_path / "config" / "definitions.json").exists()


# ---------------------------------------------------------------- Dockerfile


def resolve_args(text: str, value: str) -> str:
    """Substitute ${NAME} / $NAME with the defaults of the Dockerfile's global ARGs."""
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), value)


def test_dockerfile_is_multi_stage_slim_and_non_root() -> None:
    text = DOCKERFILE.read_text()
    stages = dockerfile_stages(text)
    assert len(stages) >= 2
    assert all(resolve_args(text, stage["base"]) == "python:3.11-slim" for stage in stages)
    final = stages[-1]
    users = [rest for keyword, rest in final["instructions"] if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert dockerfile_entrypoint(text) == ["dfca"]
    copies_from_build = [rest for keyword, rest in final["instructions"] if keyword == "COPY"]
    assert any(rest.startswith(f"--from={stages[0]['name']}") for rest in copies_from_build)


def test_dockerfile_installs_pinned_torch_from_the_variant_index_before_the_project() -> None:
    text = DOCKERFILE.read_text()
    build = dockerfile_stages(text)[0]
    runs = [rest for keyword, rest in build["instructions"] if keyword == "RUN"]
    torch_step = next(i for i, rest in enumerate(runs) if "torch==" in rest)
    project_step = next(i for i, rest in enumerate(runs) if re.search(r"pip install \.(\s|$)", rest))
    assert torch_step < project_step
    assert re.search(r"torch==\$\{TORCH_VERSION\}", runs[torch_step])
    assert "--index-url" in runs[torch_step] and "${TORCH_VARIANT}" in runs[torch_step]
    build_args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert build_args["TORCH_VARIANT"] == "cpu"
    assert build_args["TORCH_VERSION"] == "2.13.0"


def test_dockerfile_copies_only_existing_files_that_dockerignore_lets_through() -> None:
    text = DOCKERFILE.read_text()
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore is an allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for stage in dockerfile_stages(text):
        for keyword, rest in stage["instructions"]:
            if keyword != "COPY" or rest.startswith("--from"):
                continue
            sources = rest.split()[:-1]
            for source in sources:
                path = source.rstrip("/")
                assert (REPO / path).exists(), f"COPY {source}: missing in the repository"
                assert path in allowed, f"COPY {source}: excluded by .dockerignore"


def test_image_uid_owns_the_volume_paths_the_manifests_mount(gpu_manifests: list[Manifest]) -> None:
    text = DOCKERFILE.read_text()
    created = set(re.findall(r"(/var/lib/dfca/\w+)", text))
    for workload in workloads(gpu_manifests):
        for container in dfca_containers(workload):
            for mount in container["volumeMounts"]:
                if mount["mountPath"].startswith("/var/lib/dfca"):
                    assert mount["mountPath"] in created, mount["mountPath"]


def test_chaos_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(REPO / "scripts" / "chaos_k8s.sh")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr



def test_compose_runs_each_service_as_its_own_broker_user(tmp_path: Path) -> None:
    """scripts/compose_broker_users.sh's env file gives every compose service its own principal's URL and the
    broker the generated definitions, and generated tokens (the API token only to the REST services, the read
    token to every service); without it `up` refuses, naming the script; --shared-user is the explicit opt-in to
    the development user."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose (Debian package docker-compose) is not installed")
    env_file = tmp_path / "compose.env"
    script = REPO / "scripts" / "compose_broker_users.sh"
    script_env = {**os.environ, "ENV_FILE": str(env_file), "PYTHON": sys.executable}
    made = subprocess.run(["bash", str(script)], env=script_env, capture_output=True, text=True, check=False,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    assert env_file.stat().st_mode & 0o077 == 0

    def rendered(*env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker-compose", *env, "-f", str(COMPOSE_FILE), "config"], cwd=REPO,
                              capture_output=True, text=True, check=False)

    done = rendered("--env-file", str(env_file))
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    for name in ("topology", "metrics", "worker-0", "worker-1", "worker-2"):
        url = services[name]["environment"]["DFCA_BROKER_URL"]
        assert url.startswith(f"amqp://dfca-{name}:") and url.endswith("@rabbitmq:5672/dfca"), (name, url)
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert len(written["DFCA_API_TOKEN"]) == 64 and written["DFCA_API_TOKEN"] != written["DFCA_READ_TOKEN"]
    for name in ("topology", "metrics"):
        assert services[name]["environment"]["DFCA_API_TOKEN"] == written["DFCA_API_TOKEN"], name
    for name in ("topology", "metrics", "worker-0", "worker-2"):
        assert services[name]["environment"]["DFCA_READ_TOKEN"] == written["DFCA_READ_TOKEN"], name
    assert "DFCA_API_TOKEN" not in services["worker-0"]["environment"]
    again = subprocess.run(["bash", str(script)], env=script_env, capture_output=True, text=True, check=False,
                           timeout=120)
    assert again.returncode == 0 and f"DFCA_API_TOKEN={written['DFCA_API_TOKEN']}" in env_file.read_text()
    mounts = [str(v) for v in services["rabbitmq"]["volumes"]]
    assert any(".dfca/broker-definitions.json" in v and "/etc/rabbitmq/definitions.json" in v for v in mounts), mounts
    (tmp_path / "empty.env").write_text("")
    refused = rendered("--env-file", str(tmp_path / "empty.env"))
    assert refused.returncode != 0 and "scripts/compose_broker_users.sh" in refused.stderr, refused.stderr
    shared_env = tmp_path / "shared.env"
    opted = subprocess.run(["bash", str(script), "--shared-user"], env={**script_env, "ENV_FILE": str(shared_env)},
                           capture_output=True, text=True, check=False, timeout=120)
    assert opted.returncode == 0 and "WARNING" in opted.stderr, opted.stderr
    done = rendered("--env-file", str(shared_env))
    assert done.returncode == 0, done.stderr
    shared = yaml.safe_load(done.stdout)["services"]
    assert {shared[n]["environment"]["DFCA_BROKER_URL"] for n in ("topology", "worker-0", "worker-2")} == \
        {"amqp://dfca:dfca@rabbitmq:5672/dfca"}


def test_compose_mounts_folders_the_image_makes_and_keeps_state_on_them(compose: dict[str, Any]) -> None:
    """Every folder a compose service mounts below /var/lib/dfca exists in the image, owned by its user (a fresh
    named volume there inherits that), and each service's state (topology records, metrics database, checkpoints)
    lives on a volume, not in the container; each worker reads its own data folder, read-only."""
    created = set(re.findall(r"(/var/lib/dfca/\w+)", DOCKERFILE.read_text()))
    data_sources = []
    for name, service in compose_dfca_services(compose).items():
        mounts = {}
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, mode)
            assert target in created, (name, target)
        env = compose_environment(service)
        kind = name.split("-")[0]
        state = {"topology": env.get("DFCA_CHECKPOINT_DIR"), "worker": env.get("DFCA_CHECKPOINT_DIR"),
                 "aggregator": "/var/lib/dfca/checkpoints",
                 "metrics": env.get("DFCA_METRICS_DB_URL", "").removeprefix("sqlite:///").rsplit("/", 1)[0]}[kind]
        assert state in mounts and not mounts[state][0].startswith("."), (name, state)
        if kind == "worker":
            source, mode = mounts[env["DFCA_DATA_DIR"]]
            assert mode == ["ro"] and source.endswith(f"/{name}"), (name, source)
            data_sources.append(source)
    assert len(set(data_sources)) == 3
