"""Kubernetes manifests: every YAML/JSON file parses; core objects validate against the
Kubernetes JSON schema (kubernetes-validate, strict, offline); the Prometheus Operator CRDs
and the Kustomization against tests/system/deploy/crd_schemas.py; and the objects agree with each
other and with the CLI (ports, probes, drain timing, selectors, volumes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from service.health import LIVENESS_SERVICE, READINESS_SERVICE
from tests.system.deploy.cli import parse_serve
from tests.system.deploy.crd_schemas import SCHEMAS
from tests.system.deploy.support import (
    DEPLOY,
    K8S,
    REPO,
    k8s_manifests,
    load_yaml_documents,
    require_module,
)

# grpc probes are GA from 1.27: the oldest version the manifests must pass; the newest
# is whatever kubernetes-validate bundles.
MIN_K8S = "1.27.0"
CORE_KINDS = ("Deployment", "Service", "PersistentVolumeClaim", "NetworkPolicy")
DRAIN_MARGIN_S = 5  # time to exit after the grace period: stop the exporter, threads


def _data_files() -> list[Path]:
    files = [p for p in DEPLOY.rglob("*") if p.suffix in {".yml", ".yaml", ".json"}]
    files += sorted(Path(__file__).resolve().parent.glob("*.yml"))  # alerts_test.yml
    return sorted(files)


@pytest.mark.parametrize("path", _data_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_yaml_and_json_file_parses(path: Path) -> None:
    if path.suffix == ".json":
        assert isinstance(json.loads(path.read_text()), dict)
    else:
        docs = load_yaml_documents(path)
        assert docs and all(isinstance(d, dict) for d in docs), f"{path}: empty or not a map"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    return k8s_manifests()


@pytest.mark.parametrize("version", [MIN_K8S, "latest"])
@pytest.mark.parametrize("kind", CORE_KINDS)
def test_core_objects_validate_against_the_kubernetes_schema(
        objects: dict[str, dict[str, Any]], kind: str, version: str) -> None:
    kubernetes_validate = require_module("kubernetes_validate",
                                         "pip install kubernetes-validate")
    latest = str(kubernetes_validate.utils.latest_version())
    target = latest if version == "latest" else version
    try:
        kubernetes_validate.validate(objects[kind], target, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{kind} fails the Kubernetes {target} schema at {path}: {exc.message}")


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_custom_resources_validate_structurally(objects: dict[str, dict[str, Any]],
                                                kind: str) -> None:
    validator = jsonschema.Draft202012Validator(SCHEMAS[kind])
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(objects[kind])]
    assert not errors, f"{kind}: {errors}"


def test_every_object_is_validated(objects: dict[str, dict[str, Any]]) -> None:
    assert set(objects) == set(CORE_KINDS) | set(SCHEMAS)


def test_kustomization_lists_every_manifest(objects: dict[str, dict[str, Any]]) -> None:
    kustomization = objects["Kustomization"]
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    image = _container(objects)["image"].split(":")[0]
    assert image in {i["name"] for i in kustomization["images"]}


# -- the Deployment against the CLI and the other objects -----------------------------------

def _container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def _port(container: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def test_deployment_args_are_accepted_by_the_cli(objects: dict[str, dict[str, Any]]) -> None:
    container = _container(objects)
    assert "command" not in container, "keep the image's ENTRYPOINT (model-executor)"
    _, executor_config, server = parse_serve(container["args"], "deployment.yaml")
    assert server.host == "0.0.0.0", "the kubelet probes the pod IP: bind all interfaces"
    assert server.port == _port(container, "grpc")
    assert server.metrics_port == _port(container, "metrics")
    assert executor_config.device.startswith("cuda")


def test_probes_use_native_grpc_on_the_health_service(
        objects: dict[str, dict[str, Any]]) -> None:
    container = _container(objects)
    grpc_port = _port(container, "grpc")
    expected = {"startupProbe": READINESS_SERVICE, "readinessProbe": READINESS_SERVICE,
                "livenessProbe": LIVENESS_SERVICE}
    assert READINESS_SERVICE == "model_executor.v1.Executor"
    for probe, service in expected.items():
        spec = container[probe]
        assert set(spec) & {"grpc", "exec", "httpGet", "tcpSocket"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == grpc_port, f"{probe}: numeric port of the gRPC server"
        assert spec["grpc"].get("service", "") == service, probe


def test_termination_grace_covers_prestop_drain_and_grace(
        objects: dict[str, dict[str, Any]]) -> None:
    """Kubernetes counts terminationGracePeriodSeconds from the start of preStop; SIGTERM
    comes after it, then the server drains (--drain-delay) and waits (--grace-period)."""
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = _container(objects)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    _, _, server = parse_serve(container["args"], "deployment.yaml")
    needed = float(command[1]) + server.drain_delay_s + server.grace_period_s + DRAIN_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] > needed
    assert server.drain_delay_s > 0, "report NOT_SERVING before closing the listener"


def test_gpu_and_model_volume(objects: dict[str, dict[str, Any]]) -> None:
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = _container(objects)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert claim == objects["PersistentVolumeClaim"]["metadata"]["name"]
    assert mounts["models"]["readOnly"] is True
    args, _, _ = parse_serve(container["args"], "deployment.yaml")
    assert args.model.startswith(mounts["models"]["mountPath"].rstrip("/") + "/")


def test_non_root_with_writable_caches(objects: dict[str, dict[str, Any]]) -> None:
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = _container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    for name in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert any(env[name] == w or env[name].startswith(w + "/") for w in writable), name
    assert "/tmp" in writable


def test_service_and_service_monitor_select_the_pods(
        objects: dict[str, dict[str, Any]]) -> None:
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = objects["Service"]
    assert service["spec"]["clusterIP"] == "None", "headless: the scheduler needs pod IPs"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert objects["Deployment"]["spec"]["selector"]["matchLabels"].items() \
        <= pod_labels.items()
    container_ports = {p["name"] for p in _container(objects)["ports"]}
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for port in service_ports.values():
        assert port["targetPort"] in container_ports
    monitor = objects["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    for endpoint in monitor["endpoints"]:
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics"


def test_operator_objects_share_the_release_label(objects: dict[str, dict[str, Any]]) -> None:
    labels = [objects[k]["metadata"]["labels"] for k in ("ServiceMonitor", "PrometheusRule")]
    assert labels[0].get("release") == labels[1].get("release") is not None


def test_token_comes_from_a_secret(objects: dict[str, dict[str, Any]]) -> None:
    """Issue 19: the manifests served gRPC with no token; the Deployment now reads the
    service token from a Secret (required: no token, no pod)."""
    env = {e["name"]: e for e in _container(objects)["env"]}
    ref = env["MODEL_EXECUTOR_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "model-executor-token" and ref["key"] == "token"
    assert not ref.get("optional", False)
    _, _, server = parse_serve(_container(objects)["args"], "deployment.yaml",
                               env={"MODEL_EXECUTOR_TOKEN": "from-the-secret"})
    assert server.auth.token is not None


def test_network_policy_admits_only_the_scheduler_and_prometheus(
        objects: dict[str, dict[str, Any]]) -> None:
    """Issue 19: no NetworkPolicy let anything in the cluster reach Capture and steps."""
    policy = objects["NetworkPolicy"]["spec"]
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"} and policy["egress"] == []
    ports = {p["name"] for p in _container(objects)["ports"]}
    for rule in policy["ingress"]:
        assert rule["from"], "an ingress rule without `from` admits everyone"
        assert {p["port"] for p in rule["ports"]} <= ports
