"""deploy/kubernetes/, checked offline: against the Kubernetes schema, and against
docker-compose.yml and the code.

Every manifest validates strictly (an unknown field fails) against the JSON schemas
kubernetes-validate ships for the Kubernetes versions named below; no cluster or kubectl.
Then they are held to what compose runs: each service from the same image and module,
given what compose gives it of what it reads (its secrets from the secret README's
commands create), probes where the service serves them, compose's limits and stop grace,
a NATS cluster of three with deploy/nats.conf's users, and prefill's K/V served at its
pod's IP.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from specmesh.services.gateway.app import OPEN_PATHS
from specmesh.shared.config import default_model_dir
from specmesh.shared.cores import CoresConfig
from specmesh.shared.logs import LogConfig
from specmesh.shared.model.fetch import REQUIRED_FILES
from specmesh.shared.service import ServiceConfig
from test_deploy import (
    ALL_SERVICES,
    DEPLOY,
    MODEL_POOLS,
    NATS_NODES,
    ROOT,
    _compose,
    _default,
    _option_variables,
    _runs_module,
)

KUBERNETES = DEPLOY / "kubernetes"
# 1.30: the oldest where the gateway's preStop `sleep` is on by default; 1.37: the newest
# the locked kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# What compose runs that is not here: valkey (the redis-kv profile) and the observability
# stack, which a cluster has its own of (kustomization.yaml says so).
LEFT_OUT = {"valkey", "otel-collector", "jaeger", "prometheus", "grafana"}
# compose's values that differ here: the NATS nodes' names (test_nats_...), valkey's.
NOT_MIRRORED = {"SPECMESH_NATS_URL", "SPECMESH_REDIS_URL", "SPECMESH_REDIS_PASSWORD"}
ENV_CONFIGMAP = "specmesh-env"


@dataclasses.dataclass(frozen=True)
class SecretKey:
    """An environment variable's value from a key of a secret."""

    secret: str
    key: str
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class PodField:
    """An environment variable's value from the pod's own fields (the downward API)."""

    path: str


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())


@functools.cache
def _resources() -> dict[tuple[str, str], dict[str, Any]]:
    """Every resource the kustomization applies, by (kind, name); not to be changed."""
    found = {}
    for file in _kustomization()["resources"]:
        for doc in _documents(KUBERNETES / file):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, key
            found[key] = doc
    return found


def _workloads() -> dict[str, dict[str, Any]]:
    """Deployments, StatefulSets and Jobs by name."""
    kinds = ("Deployment", "StatefulSet", "Job")
    return {name: r for (kind, name), r in _resources().items() if kind in kinds}


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod(workload)["containers"]
    return container


def _all_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, workload in _workloads().items():
        pod = _pod(workload)
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            yield f"{name}/{container['name']}", container


def _env(container: dict[str, Any]) -> dict[str, str | SecretKey | PodField]:
    """The container's environment: its ConfigMaps' data, then its own variables."""
    resources = _resources()
    env: dict[str, str | SecretKey | PodField] = {}
    for source in container.get("envFrom", []):
        env.update(resources[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for var in container.get("env", []):
        value_from = var.get("valueFrom", {})
        if "secretKeyRef" in value_from:
            ref = value_from["secretKeyRef"]
            env[var["name"]] = SecretKey(ref["name"], ref["key"], ref.get("optional", False))
        elif "fieldRef" in value_from:
            env[var["name"]] = PodField(value_from["fieldRef"]["fieldPath"])
        else:
            env[var["name"]] = var["value"]
    return env


def _compose_value(value: str | None) -> str | SecretKey | None:
    """What compose gives a variable: `${NAME:?...}` a secret, here the key NAME of the
    documented secret; None: passed through from .env where set there."""
    if value is None:
        return None
    if match := re.fullmatch(r"\$\{(\w+):\?.*\}", value):
        return SecretKey(_documented_secret()[0], match[1])
    return _default(value) if value.startswith("${") else value


def _service_variables(name: str) -> set[str]:
    """The SPECMESH_* variables `python -m specmesh.services.<name>` reads: the configs
    service_main gives every service and those its __main__ hands it."""
    spec = importlib.util.find_spec(f"specmesh.services.{name}.__main__")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    modules = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    (call,) = [n.value for n in tree.body if isinstance(n, ast.Expr)]
    assert isinstance(call, ast.Call) and isinstance(call.args[1], ast.List)
    names = [n.id for n in call.args[1].elts if isinstance(n, ast.Name)]
    configs = [getattr(importlib.import_module(modules[n]), n) for n in names]
    return _option_variables([ServiceConfig, LogConfig, CoresConfig, *configs])


def _documented_secret() -> tuple[str, set[str], str]:
    """README's Kubernetes section: the secret's name, the keys its commands put in it,
    and the section's text."""
    section = (ROOT / "README.md").read_text().split("\n## Deploy on Kubernetes\n")[1]
    section = section.split("\n## ")[0]
    (name,) = re.findall(r"kubectl -n specmesh create secret generic (\S+)", section)
    (words,) = re.findall(r"for name in (.*?); do", section, re.S)
    keys = set()
    for word in words.replace("\\\n", " ").split():  # shell brace expansion, one pair
        match = re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", word)
        keys |= {match[1] + part + match[3] for part in match[2].split(",")} if match else {word}
    return name, keys, section


def _port(container: dict[str, Any], port: int | str) -> int:
    """A port by number or by the container's name for it."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def _gibibytes(compose_memory: str) -> str:
    match = re.fullmatch(r"(\d+)g", compose_memory)
    assert match, compose_memory
    return f"{match[1]}Gi"


def _validate(resource: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(resource, version, strict=True)


# The schema


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(version: str) -> None:
    for (kind, name), resource in _resources().items():
        try:
            _validate(resource, version)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kind} {name}: {exc}")


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("unknown-field", "'paht' was unexpected"),
        ("wrong-type", "'1' is not of type 'integer'"),
        ("missing-field", "'name' is a required property"),
    ],
)
def test_the_schema_check_fails_a_broken_manifest(fault: str, message: str) -> None:
    """The check is strict down the whole tree: a typo deep in a pod, a number quoted, a
    required field gone."""
    gateway = copy.deepcopy(_workloads()["gateway"])
    _validate(gateway, KUBERNETES_VERSIONS[0])
    container = _container(gateway)
    if fault == "unknown-field":
        container["readinessProbe"]["httpGet"]["paht"] = "/health"
    elif fault == "wrong-type":
        gateway["spec"]["replicas"] = "1"
    else:
        del container["name"]
    with pytest.raises(kubernetes_validate.ValidationError, match=re.escape(message)):
        _validate(gateway, KUBERNETES_VERSIONS[0])


def test_the_kustomization_applies_every_manifest_as_written() -> None:
    """No transformers but the namespace, so the files tested are what is applied; every
    file is listed; no secret value is shipped."""
    kustomization = _kustomization()
    assert set(kustomization) == {"apiVersion", "kind", "namespace", "resources"}
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert "Secret" not in {kind for kind, _ in _resources()}
    for where, container in _all_containers():
        for var in container.get("env", []):
            if re.search(r"PASSWORD|SECRET|API_KEY", var["name"]):
                assert "value" not in var, f"{where}: {var['name']} is a literal"


# The services, as compose runs them


def test_every_service_compose_runs_is_a_workload_here() -> None:
    services = _compose()["services"]
    workloads = _workloads()
    assert set(services) - LEFT_OUT - set(NATS_NODES) == set(workloads) - {"nats"}
    image = _default(services["gateway"]["image"])
    for name in ALL_SERVICES:
        workload = workloads[name]
        assert workload["kind"] == "Deployment"
        module = _runs_module(_container(workload)["command"])
        assert module == _runs_module(services[name]["command"]) == f"specmesh.services.{name}"
        # the learner is off (compose's `learning` profile) until scaled up
        replicas = _default(services[name]["deploy"]["replicas"]) if name != "learner" else "0"
        assert workload["spec"]["replicas"] == int(replicas), name
        assert _pod(workload)["terminationGracePeriodSeconds"] == int(
            services[name]["stop_grace_period"].removesuffix("s")
        )
    model_init = workloads["model-init"]
    assert model_init["kind"] == "Job"
    assert _container(model_init)["command"] == services["model-init"]["command"]
    assert _env(_container(model_init)) == services["model-init"]["environment"]
    for where, container in _all_containers():
        expected = services["nats-0"]["image"] if where.startswith("nats/") else image
        assert container["image"] == expected, where


@pytest.mark.parametrize("name", ALL_SERVICES)
def test_each_service_gets_what_compose_gives_it(name: str) -> None:
    """Its own variables are options it reads; of what compose gives it, what it reads is
    here too, the same values or the same secrets (the documented secret's key of compose's
    variable's name)."""
    reads = _service_variables(name)
    container = _container(_workloads()[name])
    own = {var["name"] for var in container["env"]}
    assert own <= reads, f"{name} sets variables it does not read: {own - reads}"
    env = {key: value for key, value in _env(container).items() if key in reads}
    compose_env = _compose()["services"][name]["environment"]
    # prefill's direct store: its pod's IP (test_prefill_serves_...), compose's route to NATS
    assert env.keys() - compose_env.keys() <= {"SPECMESH_KV_DIRECT_HOST"}, name
    for key, value in compose_env.items():
        if key in reads and key not in NOT_MIRRORED and value is not None:
            assert env.get(key) == _compose_value(value), (name, key)


def test_the_shared_environment_is_what_compose_shares() -> None:
    """specmesh-env: each variable read by some service that takes it; compose's variables
    passed through from .env are named in its comment, to add there."""
    takers = [
        name
        for name, workload in _workloads().items()
        if {"configMapRef": {"name": ENV_CONFIGMAP}} in _container(workload).get("envFrom", [])
    ]
    assert sorted(takers) == sorted(ALL_SERVICES)
    read = set().union(*(_service_variables(name) for name in takers))
    data = _resources()[("ConfigMap", ENV_CONFIGMAP)]["data"]
    assert set(data) <= read, set(data) - read
    text = (KUBERNETES / "env.yaml").read_text()
    passed_through = [
        k for k, v in _compose()["services"]["decode"]["environment"].items() if v is None
    ]
    assert passed_through and all(key in text for key in passed_through)


def test_every_secret_comes_from_the_documented_one() -> None:
    """The keys README's commands put in the secret, each used; compose's variable names,
    so compose's .env makes the secret too. An optional key (the API key) is named there."""
    name, keys, section = _documented_secret()
    referenced = [
        value
        for _, container in _all_containers()
        for value in _env(container).values()
        if isinstance(value, SecretKey)
    ]
    assert {ref.secret for ref in referenced} == {name}
    assert {ref.key for ref in referenced if not ref.optional} == keys
    for ref in referenced:
        if ref.optional:
            assert ref.key in section, ref.key
    assert "kubectl apply -k deploy/kubernetes" in section
    assert f"create secret generic {name}" in (KUBERNETES / "kustomization.yaml").read_text()


def test_probes_ask_where_each_service_serves() -> None:
    """The gateway: ready on /health (503 until a decode worker is up), alive on /live, on
    its API port, which its Service targets; the others ready on /health on the metrics
    port. No probe needs the API key."""
    workloads = _workloads()
    resources = _resources()
    gateway = _container(workloads["gateway"])
    env = _env(gateway)
    api_port = int(str(env["SPECMESH_PORT"]))
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/live")):
        get = gateway[probe]["httpGet"]
        assert (get["path"], _port(gateway, get["port"])) == (path, api_port), probe
    assert gateway["startupProbe"]["httpGet"] == gateway["livenessProbe"]["httpGet"]
    service = resources[("Service", "gateway")]["spec"]
    assert (
        service["selector"].items()
        <= workloads["gateway"]["spec"]["template"]["metadata"]["labels"].items()
    )
    (port,) = service["ports"]
    assert port["port"] == api_port == _port(gateway, port["targetPort"])
    for name in set(ALL_SERVICES) - {"gateway"}:
        container = _container(workloads[name])
        get = container["readinessProbe"]["httpGet"]
        metrics_port = int(str(_env(container)["SPECMESH_METRICS_PORT"]))
        assert (get["path"], _port(container, get["port"])) == ("/health", metrics_port), name
        assert "livenessProbe" not in container, name  # /health is 503 while NATS is away
    probes = [
        c[p]["httpGet"]["path"]
        for w, c in _all_containers()
        if not w.startswith("nats/")
        for p in ("readinessProbe", "livenessProbe", "startupProbe")
        if p in c
    ]
    assert set(probes) <= OPEN_PATHS


def test_resources_threads_volumes_and_shutdown_follow_compose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compose's limits, requests too (the pools that hold the model: the same, Guaranteed);
    SPECMESH_THREADS its CPU limit; SIGTERM's drain within the grace period; the image's
    user; the models volume, after model-init has filled it."""
    services = _compose()["services"]
    workloads = _workloads()
    for where, container in _all_containers():
        resources = container["resources"]
        for side in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[side]), (where, side)
    drain_timeout = ServiceConfig().drain_timeout
    uid = int(re.findall(r"useradd .*--uid (\d+)", (DEPLOY / "Dockerfile").read_text())[0])
    monkeypatch.setenv("SPECMESH_CACHE", "/models")  # the image's (test_deploy checks)
    model = default_model_dir() / "config.json"
    assert model.name in REQUIRED_FILES  # the directory appears whole, by one rename
    for name in (*ALL_SERVICES, "model-init"):
        workload, compose = workloads[name], services[name]
        pod, container = _pod(workload), _container(workload)
        limits = compose["deploy"]["resources"]["limits"]
        cpus, memory = (
            _default(v) if v.startswith("${") else v for v in (limits["cpus"], limits["memory"])
        )
        resources = container["resources"]
        assert resources["limits"] == {"cpu": cpus, "memory": _gibibytes(memory)}, name
        if name in MODEL_POOLS:
            assert resources["requests"] == resources["limits"], name
        assert pod["securityContext"]["runAsUser"] == uid == pod["securityContext"]["fsGroup"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        assert claims[mounts["/models"]] == "models" and "models:/models" in compose["volumes"]
        if name == "model-init":
            continue
        assert str(_env(container)["SPECMESH_THREADS"]) == cpus, name
        stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] > stop + drain_timeout, name
        (init,) = pod["initContainers"]
        assert init["command"][:2] == ["sh", "-c"]
        assert f"until [ -f {model} ]" in init["command"][2], name
    learner = _container(workloads["learner"])
    mounts = {m["mountPath"]: m["name"] for m in learner["volumeMounts"]}
    assert mounts[str(_env(learner)["SPECMESH_SPECULATIVE_ONLINE_DIR"])] == "learner-data"
    assert workloads["learner"]["spec"]["strategy"]["type"] == "Recreate"  # one volume


def test_prefill_serves_direct_kv_at_its_pods_ip() -> None:
    """Decode pulls a prompt's K/V from the prefill pod that computed it, at the address
    the hand-off names: the pod's IP (every pod reaches it, on the port prefill picks)."""
    workloads = _workloads()
    prefill = _env(_container(workloads["prefill"]))
    assert prefill["SPECMESH_KV_TRANSPORT"] == "direct"
    assert prefill["SPECMESH_KV_DIRECT_HOST"] == PodField("status.podIP")
    for name in ALL_SERVICES:
        assert "SPECMESH_KV_DIRECT_PORT" not in _env(_container(workloads[name]))  # 0: any
    assert "NetworkPolicy" not in {kind for kind, _ in _resources()}


# NATS


def _nats() -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The NATS StatefulSet, its headless Service's spec and its nodes' names."""
    resources = _resources()
    nats = resources[("StatefulSet", "nats")]
    spec = nats["spec"]
    headless = resources[("Service", spec["serviceName"])]["spec"]
    name = nats["metadata"]["name"]
    return nats, headless, [f"{name}-{i}.{spec['serviceName']}" for i in range(spec["replicas"])]


def test_nats_is_a_cluster_of_three_as_compose_runs_it() -> None:
    """docker-compose.yml's nats-0..2 command, each node named after its pod and routed to
    the headless Service's names of all three; the services given every node."""
    services = _compose()["services"]
    nats, headless, nodes = _nats()
    assert len(nodes) == len(NATS_NODES)
    # the names resolve before a node is ready, and all start at once: a node alone has no
    # quorum to be ready with
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
    assert nats["spec"]["podManagementPolicy"] == "Parallel"
    container = _container(nats)
    assert container["image"] == services["nats-0"]["image"]
    assert _env(container)["POD_NAME"] == PodField("metadata.name")
    expected = [
        a.replace("--name=nats-0", "--name=$(POD_NAME)") for a in services["nats-0"]["command"]
    ]
    for compose_node, node in zip(NATS_NODES, nodes, strict=True):
        expected = [arg.replace(f"//{compose_node}:", f"//{node}:") for arg in expected]
    assert container["command"] == expected
    assert "--cluster=nats://0.0.0.0:6222" in expected and _port(container, "cluster") == 6222
    assert {p["name"] for p in headless["ports"]} == {p["name"] for p in container["ports"]}
    urls = _resources()[("ConfigMap", ENV_CONFIGMAP)]["data"]["SPECMESH_NATS_URL"]
    client = _port(container, "client")
    assert urls == ",".join(f"nats://{node}:{client}" for node in nodes)
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert _port(container, container["readinessProbe"]["httpGet"]["port"]) == 8222
    assert "8222/healthz" in " ".join(services["nats-0"]["healthcheck"]["test"])
    # drains take one node at a time: two of three keep JetStream's quorum
    budget = _resources()[("PodDisruptionBudget", "nats")]["spec"]
    assert budget["maxUnavailable"] == 1 and budget["selector"] == nats["spec"]["selector"]


def test_nats_config_is_deploy_nats_conf_with_the_services_passwords() -> None:
    """deploy/nats.conf below its header, mounted where the command reads it; each user's
    password the secret's key its service presents, compose's variable; JetStream's store
    on each node's own volume."""
    resources = _resources()
    nats, _, _ = _nats()
    pod, container = _pod(nats), _container(nats)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "--config=/etc/nats/nats.conf" in container["command"]
    (config_map,) = [
        v["configMap"]["name"] for v in pod["volumes"] if v["name"] == mounts["/etc/nats"]
    ]
    config = resources[("ConfigMap", config_map)]["data"]["nats.conf"]
    deployed = (DEPLOY / "nats.conf").read_text().splitlines()
    header = next(i for i, line in enumerate(deployed) if not line.startswith("#"))
    assert config.strip() == "\n".join(deployed[header:]).strip(), "copy deploy/nats.conf here"
    assert f"port: {_port(container, 'client')}" in config
    assert f"http_port: {_port(container, 'monitor')}" in config
    env = _env(container)
    compose_env = _compose()["services"]["nats-0"]["environment"]
    for user in ALL_SERVICES:
        variable = f"NATS_{user.upper()}_PASSWORD"
        assert f"password: ${variable}" in config
        service = _env(_container(resources[("Deployment", user)]))
        assert (
            env[variable]
            == service["SPECMESH_NATS_PASSWORD"]
            == _compose_value(compose_env[variable])
        )
    assert "store_dir: /data" in config
    claims = {t["metadata"]["name"] for t in nats["spec"]["volumeClaimTemplates"]}
    assert claims == {mounts["/data"]}
