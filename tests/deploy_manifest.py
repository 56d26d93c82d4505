"""Read the deployment manifests (k8s/, k8s-config/, docker-compose.yml, Dockerfile) the way the runtimes do.

Used by the deployment tests: they check the manifests against the code, and launch the services
locally with exactly the command and environment a Kubernetes pod would get.

`python tests/deploy_manifest.py --write-rabbitmq-config` regenerates k8s/rabbitmq-config.yaml
from the broker/ files.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from dfca.identity.broker_users import principal_records, principal_url, principals_of

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "k8s"
CONFIG_DIR = REPO / "k8s-config"  # the configuration layer: kustomize components, presets, a site example
PRESETS_DIR = CONFIG_DIR / "presets"
CPU_PRESET_DIR = PRESETS_DIR / "cpu"
SITE_EXAMPLE_DIR = CONFIG_DIR / "site-example"
BROKER_DIR = REPO / "broker"
DOCKERFILE = REPO / "Dockerfile"
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_GPU_FILE = REPO / "docker-compose.gpu.yml"

DFCA_SUBCOMMANDS = ("topology", "metrics", "worker", "aggregator")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")

RABBITMQ_CONFIG_FILE = K8S_DIR / "rabbitmq-config.yaml"
RABBITMQ_CONFIG_NAME = "rabbitmq-config"
BROKER_FILES = ("rabbitmq.conf", "enabled_plugins", "definitions.json")
BROKER_USER_RECORDS = ("users", "permissions", "topic_permissions")  # from the dfca-broker-users Secret


def broker_records_placeholder(key: str) -> str:
    """What stands in the ConfigMap's definitions.json for the Secret's `key` records."""
    return f"__DFCA_BROKER_{key.upper()}__"

Manifest = dict[str, Any]


# ---------------------------------------------------------------- loading


def load_documents(path: Path) -> list[Manifest]:
    """Every non-empty YAML document of one file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files(directory: Path = K8S_DIR) -> list[Path]:
    """The files `kubectl apply -f DIR` reads: not recursive, .yaml/.yml/.json, lexical order."""
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))


def load_manifests(directory: Path = K8S_DIR) -> list[Manifest]:
    return [doc for path in manifest_files(directory) for doc in load_documents(path)]


SECRET_SCRIPT = REPO / "scripts" / "k8s_secret.sh"


def broker_test_password(principal: str) -> str:
    """The stand-in broker password of a principal in the tests' Secrets."""
    return f"test-{principal}-password"


def worker_statefulsets(manifests: Iterable[Manifest]) -> list[Manifest]:
    """The worker StatefulSets (one per worker ordinal), by ordinal."""
    found = [doc for doc in manifests if doc.get("kind") == "StatefulSet"
             and doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"]
    return sorted(found, key=lambda doc: int(doc["metadata"]["labels"]["dfca.dev/worker-ordinal"]))


@functools.cache
def _test_records(workers: int) -> dict[str, list[dict[str, Any]]]:
    """The broker's records for the stand-in passwords, hashed once (a hash has a random salt)."""
    return principal_records({p: broker_test_password(p) for p in principals_of(workers)})


def _secret(name: str, data: Mapping[str, str]) -> Manifest:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": "dfca"}, "stringData": dict(data)}


def cluster_secrets(manifests: Iterable[Manifest]) -> list[Manifest]:
    """The Secrets scripts/k8s_secret.sh creates in a cluster (k8s/ holds none, so that re-applying k8s/ cannot
    restore placeholders), with test stand-ins: dfca-secrets with the script's `--from-literal` keys, the broker's
    records (dfca.identity.broker_users, one user per principal) and each principal's URL Secret."""
    keys = re.findall(r"--from-literal=([a-z-]+)=", SECRET_SCRIPT.read_text())
    workers = len(worker_statefulsets(manifests))
    passwords = {p: broker_test_password(p) for p in principals_of(workers)}
    records = _test_records(workers)
    return [_secret("dfca-secrets", {key: f"test-{key}" for key in keys}),
            _secret("dfca-broker-users", {f"{key}.json": json.dumps(value) for key, value in records.items()}),
            *(_secret(f"dfca-broker-{p}", {"url": principal_url(p, pw, "rabbitmq", 5672)})
              for p, pw in passwords.items())]


def with_cluster_secrets(manifests: list[Manifest]) -> list[Manifest]:
    return [*manifests, *cluster_secrets(manifests)]


def find_manifest(manifests: Iterable[Manifest], kind: str, name: str) -> Manifest:
    for doc in manifests:
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    raise KeyError(f"no {kind} named {name!r} in the manifests")


def workloads(manifests: Iterable[Manifest]) -> list[Manifest]:
    return [doc for doc in manifests if doc.get("kind") in WORKLOAD_KINDS]


def pod_template(workload: Manifest) -> Manifest:
    return workload["spec"]["template"]


def pod_containers(workload: Manifest, *, init: bool = True) -> list[Manifest]:
    spec = pod_template(workload)["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


DFCA_IMAGES = ("dfca", "dfca-cuda")  # the CPU image and the CUDA image (scripts/build_images.sh)


def image_repository(image: str) -> str:
    """registry.example.com/team/dfca-cuda:0.1.0 -> dfca-cuda."""
    return image.rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]


def is_dfca_image(image: str) -> bool:
    return image_repository(image) in DFCA_IMAGES


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions); {} matches all."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


# ---------------------------------------------------------------- kustomize


def kustomize_command(directory: Path) -> list[str]:
    """The real renderer: `kubectl kustomize` (kubectl ships kustomize), else a standalone `kustomize build`."""
    import shutil

    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(directory)]
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(directory)]
    raise RuntimeError("rendering the k8s-config overlays needs kubectl (it ships kustomize) or kustomize on PATH: "
                       "install kubectl (https://kubernetes.io/docs/tasks/tools/)")


def render_overlay(directory: Path) -> list[Manifest]:
    """What `kubectl kustomize DIRECTORY` renders, as documents (no load-restrictor flag: none is needed)."""
    result = subprocess.run(kustomize_command(directory), capture_output=True, text=True, check=False, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"kustomize failed on {directory}: {result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


# ---------------------------------------------------------------- commands and environment


def container_argv(container: Mapping[str, Any], image_entrypoint: list[str] | None = None) -> list[str]:
    """The process a container runs: `command` replaces the image ENTRYPOINT, `args` its CMD."""
    command = container.get("command")
    args = container.get("args", [])
    if command is None:
        if image_entrypoint is None:
            raise ValueError(f"container {container.get('name')!r} has no command and no image entrypoint given")
        command = image_entrypoint
    return [*command, *args]


def env_names(container: Mapping[str, Any], manifests: Iterable[Manifest]) -> set[str]:
    """Names of every env var a container gets, including envFrom ConfigMaps/Secrets."""
    return set(resolve_env(container, manifests, labels={}, strict=False))


def _source_data(manifests: Iterable[Manifest], kind: str, name: str) -> dict[str, str]:
    doc = find_manifest(manifests, kind, name)
    data = {key: str(value) for key, value in (doc.get("data") or {}).items()}
    if kind == "Secret":
        import base64

        data = {key: base64.b64decode(value).decode() for key, value in data.items()}
        data.update({key: str(value) for key, value in (doc.get("stringData") or {}).items()})
    return data


_DEPENDENT_VAR = re.compile(r"\$\((\w+)\)")


def resolve_env(
    container: Mapping[str, Any], manifests: Iterable[Manifest], labels: Mapping[str, str], *, strict: bool = True
) -> dict[str, str]:
    """The environment the kubelet gives a container: envFrom first, then env (which wins), with
    ConfigMap/Secret references and downward-API labels resolved and $(VAR) expanded."""
    manifests = list(manifests)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = _source_data(manifests, "ConfigMap", source["configMapRef"]["name"])
        else:
            data = _source_data(manifests, "Secret", source["secretRef"]["name"])
        env.update({prefix + key: value for key, value in data.items()})
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = _DEPENDENT_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
            continue
        ref = item["valueFrom"]
        if "configMapKeyRef" in ref:
            env[name] = _source_data(manifests, "ConfigMap", ref["configMapKeyRef"]["name"])[
                ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            data = _source_data(manifests, "Secret", ref["secretKeyRef"]["name"])
            if ref["secretKeyRef"]["key"] in data or not ref["secretKeyRef"].get("optional", False):
                env[name] = data[ref["secretKeyRef"]["key"]]  # a missing optional key leaves the variable unset
        elif "resourceFieldRef" in ref:  # the kubelet's number (init_container_env computes it)
            env[name] = f"<{ref['resourceFieldRef']['resource']}>"
        elif "fieldRef" in ref:
            match = re.fullmatch(r"metadata\.labels\['([^']+)'\]", ref["fieldRef"]["fieldPath"])
            if match is None:
                raise ValueError(f"{name}: only metadata.labels[...] field refs are supported")
            if match.group(1) in labels:
                env[name] = labels[match.group(1)]
            elif strict:
                raise KeyError(f"{name}: the pod has no label {match.group(1)!r}")
        else:
            raise ValueError(f"{name}: unsupported valueFrom {sorted(ref)}")
    return env


# ---------------------------------------------------------------- local launch


@dataclass(frozen=True)
class LocalEndpoints:
    """Where the cluster's services live on this machine."""

    broker_url: str  # every process connects here (a shared user); "" with broker_port
    service_ports: Mapping[str, int]  # Kubernetes Service name -> local port
    state_dir: Path  # volumes are mapped below this folder
    broker_port: int | None = None  # each process keeps its own broker user, at 127.0.0.1:broker_port


@dataclass(frozen=True)
class LaunchSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int


def service_ports(manifests: Iterable[Manifest]) -> dict[str, int]:
    """Service name -> its first port, for every Service in the manifests."""
    return {doc["metadata"]["name"]: doc["spec"]["ports"][0]["port"]
            for doc in manifests if doc.get("kind") == "Service"}


def localize_url(value: str, cluster_services: Mapping[str, int], local: LocalEndpoints) -> str:
    """http://topology:8080 -> http://127.0.0.1:<local port of topology>; other values unchanged."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or parts.hostname not in cluster_services:
        return value
    if (parts.port or 80) != cluster_services[parts.hostname]:
        raise ValueError(f"{value}: port differs from Service {parts.hostname}'s port")
    netloc = f"127.0.0.1:{local.service_ports[parts.hostname]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def local_broker_url(url: str, port: int) -> str:
    """A cluster AMQP URL (amqp://user:password@rabbitmq:5672/dfca), its credentials kept, pointed at 127.0.0.1:port."""
    parts = urlsplit(url)
    netloc = f"{parts.netloc.rpartition('@')[0]}@127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def localize_path(value: str, mounts: Mapping[str, Path]) -> str:
    """A path (or sqlite:/// URL) inside a volume mount -> the same path below the local folder."""
    for mount_path, local_dir in sorted(mounts.items(), key=lambda item: -len(item[0])):
        for prefix in ("", "sqlite:///"):
            if value == prefix + mount_path or value.startswith(prefix + mount_path + "/"):
                return prefix + str(local_dir) + value[len(prefix + mount_path):]
    return value


def launch_spec(
    manifests: list[Manifest], workload_name: str, local: LocalEndpoints, *, local_port: int | None = None,
) -> LaunchSpec:
    """The command and environment of a workload's dfca container, made runnable on this machine:
    Service hostnames -> 127.0.0.1 and local ports, the broker -> the local broker, volume paths
    -> folders below `local.state_dir`, the bind address -> 127.0.0.1. Everything else is verbatim."""
    workload = next(doc for doc in workloads(manifests) if doc["metadata"]["name"] == workload_name)
    containers = [c for c in pod_containers(workload, init=False) if is_dfca_image(c["image"])]
    if len(containers) != 1:
        raise ValueError(f"{workload_name}: expected one dfca container, found {len(containers)}")
    container = containers[0]
    pod_name = f"{workload_name}-0" if workload["kind"] == "StatefulSet" else workload_name  # one pod each
    env = resolve_env(container, manifests, pod_template(workload)["metadata"].get("labels", {}))
    cluster_services = service_ports(manifests)
    mounts = {m["mountPath"]: local.state_dir / pod_name / m["name"] for m in container.get("volumeMounts", [])}
    for local_dir in mounts.values():
        local_dir.mkdir(parents=True, exist_ok=True)
    port = local_port if local_port is not None else int(env["DFCA_PORT"])
    localized = {}
    for name, value in env.items():
        value = localize_path(localize_url(value, cluster_services, local), mounts)
        localized[name] = value
    broker = urlsplit(env["DFCA_BROKER_URL"])
    if broker.hostname not in cluster_services:
        raise ValueError(f"DFCA_BROKER_URL host {broker.hostname!r} is not a Service in the manifests")
    broker_url = local.broker_url if local.broker_port is None else local_broker_url(env["DFCA_BROKER_URL"],
                                                                                     local.broker_port)
    localized.update(DFCA_BROKER_URL=broker_url, DFCA_HOST="127.0.0.1", DFCA_PORT=str(port))
    base = {key: value for key, value in os.environ.items() if not key.startswith("DFCA_")}
    return LaunchSpec(name=pod_name, argv=container_argv(container), env={**base, **localized}, port=port)


# ---------------------------------------------------------------- Dockerfile and compose


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    result = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def dockerfile_stages(text: str) -> list[dict[str, Any]]:
    """Each build stage: its base image, name and instructions."""
    stages: list[dict[str, Any]] = []
    for keyword, rest in dockerfile_instructions(text):
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append({"base": words[0], "name": name, "instructions": []})
        elif stages:
            stages[-1]["instructions"].append((keyword, rest))
    return stages


def exec_form(arguments: str) -> list[str]:
    """The argv of an exec-form (JSON array) or shell-form instruction."""
    if arguments.startswith("["):
        return json.loads(arguments)
    return ["/bin/sh", "-c", arguments]


def dockerfile_entrypoint(text: str) -> list[str]:
    final = dockerfile_stages(text)[-1]
    entrypoints = [rest for keyword, rest in final["instructions"] if keyword == "ENTRYPOINT"]
    if not entrypoints:
        raise ValueError("the final stage has no ENTRYPOINT")
    return exec_form(entrypoints[-1])


_COMPOSE_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?-|:?\?)([^}]*))?\}")


def compose_stand_in_env(workers: int = 3) -> dict[str, str]:
    """What scripts/compose_broker_users.sh puts in .env, with stand-in passwords."""
    from dfca.identity.broker_users import env_name

    urls = {env_name(p): principal_url(p, broker_test_password(p), "rabbitmq", 5672) for p in principals_of(workers)}
    tokens = {"DFCA_API_TOKEN": "stand-in-api-token", "DFCA_READ_TOKEN": "stand-in-read-token"}
    return {**urls, **tokens, "DFCA_BROKER_DEFINITIONS": "./.dfca/broker-definitions.json"}


def compose_defaults(value: Any, env: Mapping[str, str] | None = None) -> Any:
    """A compose document as `docker compose` sees it with `env` set (by default what compose_broker_users.sh
    writes): ${NAME:-default} -> env or default, ${NAME} -> env or '', ${NAME:?error} -> env, else ValueError."""
    env = compose_stand_in_env() if env is None else env
    if isinstance(value, dict):
        return {key: compose_defaults(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [compose_defaults(item, env) for item in value]
    if isinstance(value, str):
        def substitute(match: re.Match[str]) -> str:
            name, operator, word = match.group(1), match.group(2) or "", match.group(3) or ""
            if env.get(name):
                return env[name]
            if "?" in operator:
                raise ValueError(f"{name} is required: {word}")
            return word
        return _COMPOSE_VARIABLE.sub(substitute, value)
    return value


def load_compose(path: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return compose_defaults(yaml.safe_load(path.read_text()), env)


def compose_argv(service: Mapping[str, Any], image_entrypoint: list[str]) -> list[str]:
    """The process a compose service runs (`entrypoint` replaces the image's, `command` its CMD)."""
    entrypoint = service.get("entrypoint", image_entrypoint)
    command = service.get("command", [])
    if isinstance(entrypoint, str):
        entrypoint = shlex.split(entrypoint)
    if isinstance(command, str):
        command = shlex.split(command)
    return [*entrypoint, *command]


def compose_environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


# ---------------------------------------------------------------- RabbitMQ ConfigMap


def template_definitions(text: str) -> str:
    """broker/definitions.json with its users, permissions and topic permissions replaced by placeholders,
    which the broker pod's init container fills from the dfca-broker-users Secret (no shared user)."""
    document = json.loads(text)
    for key in BROKER_USER_RECORDS:
        document[key] = broker_records_placeholder(key)
    return json.dumps(document, indent=2) + "\n"


def broker_configmap_data(broker_dir: Path = BROKER_DIR) -> dict[str, str]:
    data = {name: (broker_dir / name).read_text() for name in BROKER_FILES}
    data["definitions.json"] = template_definitions(data["definitions.json"])
    return data


def _block_scalar(text: str, indent: str) -> str:
    """`text` as a literal block scalar whose value is exactly `text` (one or no final newline)."""
    if "\t" in text or any(line != line.rstrip() for line in text.split("\n")):
        raise ValueError("broker files must have no tabs or trailing spaces to embed as YAML block scalars")
    if text.endswith("\n\n") or text[:1].isspace():
        raise ValueError("broker files must not start with blanks nor end with blank lines")
    chomp = "" if text.endswith("\n") else "-"
    body = text.removesuffix("\n")
    return f"|{chomp}\n" + "\n".join((indent + line) if line else "" for line in body.split("\n"))


def rabbitmq_configmap_text(broker_dir: Path = BROKER_DIR) -> str:
    header = (
        "# GENERATED from broker/ by `python tests/deploy_manifest.py --write-rabbitmq-config`; do not edit.\n"
        "# Same bytes as the broker/ files, except that definitions.json has placeholders for its users,\n"
        "# permissions and topic permissions: the rabbitmq pod's init container puts the records of the\n"
        "# dfca-broker-users Secret (one user per principal, scripts/k8s_secret.sh) in their place.\n"
    )
    body = [
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        f"  name: {RABBITMQ_CONFIG_NAME}",
        "  namespace: dfca",
        "  labels:",
        "    app.kubernetes.io/component: broker",
        "    app.kubernetes.io/part-of: dfca",
        "data:",
    ]
    for name, text in broker_configmap_data(broker_dir).items():
        body.append(f"  {name}: {_block_scalar(text, '    ')}")
    return header + "\n".join(body) + "\n"


def run_broker_init_container(manifests: list[Manifest], secret_files: Mapping[str, str],
                              root: Path) -> subprocess.CompletedProcess:
    """Run the broker pod's init container script here, its volumes mapped to folders below `root`:
    the ConfigMap's files, the Secret's items (their text from `secret_files`, by key), and the config
    emptyDir (`root/config`)."""
    broker = pod_template(find_manifest(manifests, "StatefulSet", "rabbitmq"))["spec"]
    (init,) = broker["initContainers"]
    if init["command"][:2] != ["bash", "-c"]:
        raise ValueError("the broker init container is expected to run `bash -c SCRIPT`")
    volumes = {volume["name"]: volume for volume in broker["volumes"]}
    script = init["command"][2]
    env = {**os.environ, **init_container_env(broker, init)}
    for mount in sorted(init["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        local = root / mount["name"]
        local.mkdir(parents=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            for key, value in find_manifest(manifests, "ConfigMap", volume["configMap"]["name"])["data"].items():
                (local / key).write_text(value)
        if "secret" in volume:
            for item in volume["secret"]["items"]:
                (local / item["path"]).write_text(secret_files[item["key"]])
        script = script.replace(mount["mountPath"] + "/", f"{local}/")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False, env=env)


_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (2Gi, 512Mi, 1G, 1048576) in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMG])?", str(quantity))
    if match is None:
        raise ValueError(f"unsupported memory quantity {quantity!r}")
    return int(match.group(1)) * _BINARY_SUFFIXES[match.group(2) or ""]


def init_container_env(pod_spec: Manifest, container: Manifest) -> dict[str, str]:
    """An init container's literal env and resourceFieldRef values (limits.memory of a named container), as the
    kubelet computes them: the quantity divided by the divisor, rounded up."""
    env: dict[str, str] = {}
    by_name = {c["name"]: c for c in pod_spec["containers"]}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]["resourceFieldRef"]
        if ref["resource"] != "limits.memory":
            raise ValueError(f"{item['name']}: only limits.memory resource refs are supported")
        limit = quantity_bytes(by_name[ref["containerName"]]["resources"]["limits"]["memory"])
        divisor = quantity_bytes(ref.get("divisor", "1"))
        env[item["name"]] = str(-(-limit // divisor))
    return env


def broker_secret_files(manifests: list[Manifest]) -> dict[str, str]:
    """The dfca-broker-users Secret's files, by key."""
    return dict(find_manifest(manifests, "Secret", "dfca-broker-users")["stringData"])


def start_k8s_broker(manifests: list[Manifest], root: Path) -> Any:
    """A private RabbitMQ node configured like the broker pod: its init container run here on the manifests'
    Secrets, the rendered rabbitmq.conf and definitions loaded. Returns the started rabbitmq_node.RabbitMQNode."""
    from rabbitmq_node import RabbitMQNode, node_config, server_bin_dir

    bin_dir = server_bin_dir()
    if bin_dir is None:
        raise RuntimeError("RabbitMQ is not installed (scripts/install_rabbitmq.sh)")
    rendered = run_broker_init_container(manifests, broker_secret_files(manifests), root / "pod")
    if rendered.returncode != 0:
        raise RuntimeError(f"the broker init container failed: {rendered.stderr}")
    node = RabbitMQNode(root / "node", bin_dir)
    config = root / "pod" / "config"
    (node.base_dir / "rabbitmq.conf").write_text(node_config((config / "rabbitmq.conf").read_text(),
                                                             config / "definitions.json"))
    node.start()
    return node


def main(argv: list[str]) -> int:
    if argv == ["--write-rabbitmq-config"]:
        RABBITMQ_CONFIG_FILE.write_text(rabbitmq_configmap_text())
        print(f"wrote {RABBITMQ_CONFIG_FILE.relative_to(REPO)}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
