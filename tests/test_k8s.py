"""deploy/k8s rendered with the real kustomize (kubectl's), every built-in object checked against the
Kubernetes API's own schemas (kubernetes-validate, offline), and what the manifests say about the worker
checked against the worker itself: its settings, ports, probe paths, group, topics and drain bound, so that
the manifests cannot drift from the code. KEDA's and the Prometheus Operator's objects (custom resources,
outside those schemas) are checked field by field against what their documentation requires.

What these tests cannot show is a cluster running them: no cluster is at hand here (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from worker.config import ENV_PREFIX, WorkerSettings
from worker.environment import OTHER_VARIABLES
from worker.health import HealthServer
from worker.lag_exporter import LagExporterEnvironment
from worker.supervisor import STOP_GRACE_S, plan_slots

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
COMPONENTS = ("secure", "prometheus-operator")
# Kubernetes releases the manifests must be valid for: the oldest still commonly run, and a recent one.
KUBERNETES_VERSIONS = ("1.29.0", "1.34.0")
CUSTOM_KINDS = {"ScaledObject", "TriggerAuthentication", "PodMonitor"}
SETTINGS_VARIABLES = {f"{ENV_PREFIX}{name.upper()}" for name in WorkerSettings.model_fields} | {
    f"{ENV_PREFIX}{name}" for name in OTHER_VARIABLES
}


def _kustomize() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    reason = "neither kubectl nor kustomize is installed: the manifests cannot be rendered here"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def render(overlay: str, components: tuple[str, ...], scratch: Path) -> list[dict[str, Any]]:
    """The objects of an overlay with some components, as kustomize builds them."""
    scratch.mkdir(parents=True, exist_ok=True)
    relative = Path(os.path.relpath(K8S, scratch))
    (scratch / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(relative / "overlays" / overlay)],
                "components": [str(relative / "components" / name) for name in components],
            }
        )
    )
    done = subprocess.run([*_kustomize(), str(scratch)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=[(o, c) for o in OVERLAYS for c in ((), COMPONENTS)], ids=str)
def objects(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    overlay, components = request.param
    return render(overlay, components, tmp_path_factory.mktemp(f"k8s-{overlay}"))


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def settings_of(objects: list[dict[str, Any]]) -> dict[str, str]:
    return dict(one(objects, "ConfigMap", "score-worker")["data"])


def _port(box: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in box["ports"] if p["name"] == name_or_number)


def _served(path: str) -> int:
    """The status the worker's health server answers a GET of `path` with."""
    server = HealthServer("127.0.0.1", 0, lambda: b"", lambda: {"ok": True})
    status, *_ = asyncio.run(server._respond(f"GET {path} HTTP/1.1\r\n\r\n".encode()))
    return int(status.split()[0])


# -- the Kubernetes API's schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_built_in_object_validates_against_the_api_schemas(
    objects: list[dict[str, Any]], version: str
) -> None:
    import kubernetes_validate

    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises, naming the field, when invalid


def test_every_file_of_deploy_k8s_is_rendered_or_an_example() -> None:
    """No manifest lies beside the kustomizations unused (it would drift unchecked)."""
    listed: set[Path] = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        listed |= {(kustomization.parent / name).resolve() for name in spec.get("resources", [])}
        listed.add(kustomization.resolve())
    for path in K8S.rglob("*.yaml"):
        assert path.resolve() in listed or path.name.endswith(".example.yaml"), (
            f"{path} is in no kustomization"
        )


def test_the_example_secrets_validate_and_hold_only_what_the_worker_and_keda_read() -> None:
    import kubernetes_validate

    docs = list(yaml.safe_load_all((K8S / "components" / "secure" / "secret.example.yaml").read_text()))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    kafka = next(d for d in docs if d["metadata"]["name"] == "score-worker-kafka")
    for key in kafka["stringData"]:
        assert key in SETTINGS_VARIABLES or key in {"KEDA_SASL", "KEDA_TLS"}, key
    import certifi  # any CA bundle: the worker reads it at start-up

    given = {
        k.removeprefix(ENV_PREFIX).lower(): v
        for k, v in kafka["stringData"].items()
        if k.startswith(ENV_PREFIX)
    }
    WorkerSettings(bootstrap_servers="b:9092", model_dir=ROOT, ssl_cafile=certifi.where(), **given)


# -- the worker as the manifests describe it ----------------------------------------------------------


def test_the_settings_are_the_workers_own(objects: list[dict[str, Any]]) -> None:
    data = settings_of(objects)
    unknown = set(data) - SETTINGS_VARIABLES
    assert not unknown, f"no worker setting has these names: {unknown}"
    values = {
        k.removeprefix(ENV_PREFIX).lower(): v
        for k, v in data.items()
        if k.removeprefix(ENV_PREFIX) not in OTHER_VARIABLES
    }
    values.pop("ssl_cafile", None)  # a file inside the pod
    WorkerSettings(**{**values, "model_dir": ROOT})  # every value is one the worker takes


def test_probes_ports_and_drain_match_the_worker(objects: list[dict[str, Any]]) -> None:
    data = settings_of(objects)
    workers = one(objects, "StatefulSet", "score-worker")
    worker = container(workers, "worker")
    port = int(data.get(f"{ENV_PREFIX}METRICS_PORT", WorkerSettings.model_fields["metrics_port"].default))
    assert _port(worker, "metrics") == port
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = worker[probe]["httpGet"]
        assert get["path"] == path and _port(worker, get["port"]) == port
        assert _served(path) == 200
    annotations = workers["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(port), "/metrics")
    # The pod is never killed mid-drain: the drain bound and the supervisor's grace for a process still
    # loading its model, with 5 s for the preStop hook's own polling.
    drain_s = int(data.get(f"{ENV_PREFIX}DRAIN_TIMEOUT_MS", 30_000)) / 1000
    grace = workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= drain_s + STOP_GRACE_S + 5
    assert "kill -TERM 1" in " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    # Static membership from the pod's name, stable in a StatefulSet.
    member = next(e for e in worker["env"] if e["name"] == f"{ENV_PREFIX}GROUP_INSTANCE_ID")
    assert member["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    labels = workers["spec"]["template"]["metadata"]["labels"]
    for kind, name in (("Service", "score-worker"), ("PodDisruptionBudget", "score-worker")):
        obj = one(objects, kind, name)
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), f"{kind}/{name} selects no worker pod"
    assert workers["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_lag_exporter_matches_its_command(objects: list[dict[str, Any]]) -> None:
    exporter = container(one(objects, "Deployment", "score-lag-exporter"), "lag-exporter")
    assert exporter["args"] == ["lag-exporter"]
    port = LagExporterEnvironment.model_fields["port"].default
    assert _port(exporter, "metrics") == port
    assert exporter["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert exporter["readinessProbe"]["httpGet"]["path"] == "/readyz"
    names = {e["name"] for e in exporter["env"]}
    assert {
        f"{ENV_PREFIX}BOOTSTRAP_SERVERS",
        f"{ENV_PREFIX}REQUESTS_TOPIC",
        "SCORE_LAG_EXPORTER_GROUPS",
    } <= names


def test_the_gateway_matches_its_command_and_the_workers_topics(objects: list[dict[str, Any]]) -> None:
    """Its variables are the gateway's own, its probes are routes it serves, its grace period outlasts a
    call's deadline, and its reply topic (named under the results topic) is one the workers allow."""
    from worker.environment import GatewaySettings
    from worker.gateway.bridge import default_reply_topic
    from worker.gateway.command import ENV_VARS

    deployment = one(objects, "Deployment", "score-gateway")
    gateway = container(deployment, "gateway")
    assert gateway["args"] == ["gateway"]
    env = {e["name"]: e for e in gateway["env"]}
    cli_variables = {f"{ENV_PREFIX}LOG_LEVEL", f"{ENV_PREFIX}LOG_FORMAT"}  # read by the command line itself
    assert set(env) <= set(ENV_VARS) | cli_variables
    port = int(env[f"{ENV_PREFIX}GATEWAY_PORT"]["value"])
    assert _port(gateway, "http") == port
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/metrics"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    timeout_s = GatewaySettings.model_fields["gateway_timeout_s"].default
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout_s + 1
    assert env[f"{ENV_PREFIX}GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"]["optional"] is True
    data = settings_of(objects)
    for name in ("BOOTSTRAP_SERVERS", "REQUESTS_TOPIC", "RESULTS_TOPIC"):
        assert env[f"{ENV_PREFIX}{name}"]["valueFrom"]["configMapKeyRef"]["key"] in data
    pattern = data.get(
        f"{ENV_PREFIX}REPLY_TOPIC_PATTERN", WorkerSettings.model_fields["reply_topic_pattern"].default
    )
    assert re.fullmatch(pattern, default_reply_topic(data[f"{ENV_PREFIX}RESULTS_TOPIC"]))
    service = one(objects, "Service", "score-gateway")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_keda_scales_the_workers_on_their_own_group_and_topic(objects: list[dict[str, Any]]) -> None:
    data = settings_of(objects)
    scaled = one(objects, "ScaledObject", "score-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (
        "StatefulSet",
        one(objects, "StatefulSet", "score-worker")["metadata"]["name"],
    )
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert all(isinstance(value, str) for value in meta.values()), "KEDA's trigger metadata is strings"
    assert meta["bootstrapServers"] == data[f"{ENV_PREFIX}BOOTSTRAP_SERVERS"]
    assert meta["consumerGroup"] == data[f"{ENV_PREFIX}GROUP_ID"]
    assert meta["topic"] == data[f"{ENV_PREFIX}REQUESTS_TOPIC"]
    assert int(meta["lagThreshold"]) > 0 and meta["allowIdleConsumers"] == "false"
    # Every worker process of every replica can own a partition: the replicas times the processes of one
    # pod stay at or below the partitions.
    partitions = int(data[f"{ENV_PREFIX}TOPIC_PARTITIONS"])
    per_pod = processes_per_pod(objects)
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["maxReplicaCount"] * per_pod <= partitions, (spec["maxReplicaCount"], per_pod, partitions)
    if "authenticationRef" in trigger:
        auth = one(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        parameters = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
        assert parameters <= {"sasl", "username", "password", "tls", "ca", "cert", "key", "keyPassword"}


def processes_per_pod(objects: list[dict[str, Any]]) -> int:
    """Worker processes one pod runs: one per GPU it is given under SCORE_WORKER_GPUS, else one."""
    data = settings_of(objects)
    choice = data.get(f"{ENV_PREFIX}GPUS", "")
    if not choice:
        return 1
    limits = container(one(objects, "StatefulSet", "score-worker"), "worker")["resources"]["limits"]
    gpus = int(limits.get("nvidia.com/gpu", 0))
    assert gpus > 0, "SCORE_WORKER_GPUS is set but the pod asks for no GPU"
    group = int(data.get(f"{ENV_PREFIX}TENSOR_PARALLEL", "1"))
    return len(
        plan_slots(choice, data.get(f"{ENV_PREFIX}DEVICE", "auto"), [str(i) for i in range(gpus)], group)
    )


def test_the_pod_monitor_scrapes_the_named_ports(tmp_path: Path) -> None:
    objects = render("gpu", ("prometheus-operator",), tmp_path)
    monitor = one(objects, "PodMonitor", "score-worker")
    endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints == {("metrics", "/metrics"), ("http", "/metrics")}
    selected = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    for kind, name, box, port in (
        ("StatefulSet", "score-worker", "worker", "metrics"),
        ("Deployment", "score-lag-exporter", "lag-exporter", "metrics"),
        ("Deployment", "score-gateway", "gateway", "http"),  # its metrics are on its HTTP port
    ):
        workload = one(objects, kind, name)
        assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] in selected
        assert any(p["name"] == port for p in container(workload, box)["ports"])


def test_the_secure_component_reaches_every_kafka_client(tmp_path: Path) -> None:
    objects = render("cpu", ("secure",), tmp_path)
    for kind, name, box in (
        ("StatefulSet", "score-worker", "worker"),
        ("Deployment", "score-lag-exporter", "lag-exporter"),
        ("Deployment", "score-gateway", "gateway"),
    ):
        spec = container(one(objects, kind, name), box)
        assert {"secretRef": {"name": "score-worker-kafka"}} in spec["envFrom"], f"{kind}/{name}"
        assert any(m["mountPath"] == "/etc/score-worker/tls" for m in spec["volumeMounts"]), f"{kind}/{name}"
    assert settings_of(objects)[f"{ENV_PREFIX}SSL_CAFILE"].startswith("/etc/score-worker/tls/")


def _walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)


def test_no_secret_value_is_in_the_manifests(objects: list[dict[str, Any]]) -> None:
    assert not any(o["kind"] == "Secret" for o in objects)
    for obj in objects:
        for node in _walk(obj):
            if isinstance(node, dict) and "name" in node and "value" in node:
                assert "PASSWORD" not in str(node["name"]).upper(), node["name"]
