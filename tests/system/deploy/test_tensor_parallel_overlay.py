"""deploy/k8s-tensor-parallel (an overlay of deploy/k8s: kustomize refuses one inside its
base): the base Deployment with the overlay's JSON patches applied
(by the small applier below, or ``kubectl kustomize`` where installed) passes the
Kubernetes schema and the CLI, and asks for as many GPUs as it starts ranks."""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.system.deploy.cli import parse_serve
from tests.system.deploy.support import K8S, k8s_manifests, load_yaml, require_module

OVERLAY = K8S.parent / "k8s-tensor-parallel"


def _apply(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add`` / ``replace`` (all the overlay uses)."""
    out = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [p.replace("~1", "/").replace("~0", "~")
                          for p in op["path"].lstrip("/").split("/")]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            if last == "-":
                node.append(op["value"])
            else:
                node.insert(int(last), op["value"]) if op["op"] == "add" else \
                    node.__setitem__(int(last), op["value"])
        else:
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = op["value"]
    return out


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    kustomization = load_yaml(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["../k8s"]
    [patch] = kustomization["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "model-executor"}
    return _apply(k8s_manifests()["Deployment"], yaml.safe_load(patch["patch"]))


def test_the_patched_deployment_starts_as_many_ranks_as_it_has_gpus(
        deployment: dict[str, Any]) -> None:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args, _, _ = parse_serve(container["args"], "deploy/k8s-tensor-parallel")
    assert args.tensor_parallel_size == 2
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] \
        == args.tensor_parallel_size
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_the_patched_deployment_passes_the_kubernetes_schema(
        deployment: dict[str, Any]) -> None:
    kubernetes_validate = require_module("kubernetes_validate",
                                         "pip install kubernetes-validate")
    kubernetes_validate.validate(deployment, "1.27.0", strict=True)


def test_kustomize_builds_the_same_deployment(deployment: dict[str, Any]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the patch applier above stands in for it)")
    built = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True,
                           text=True, check=True).stdout
    [ours] = [d for d in yaml.safe_load_all(built) if d["kind"] == "Deployment"]
    assert ours == deployment
