"""Minimal JSON schemas for the custom resources the Kubernetes schema does not cover.

ServiceMonitor and PrometheusRule are Prometheus Operator CRDs (monitoring.coreos.com/v1);
kubernetes-validate bundles only the core API. These schemas hold the fields our
manifests use, with their upstream types, and reject unknown fields (so a typo such as
``interval`` under the wrong key fails), plus the Kustomization's few fields. They are
deliberately partial: valid upstream fields we do not use are rejected too, so adding one
means adding it here (see the CRDs in prometheus-operator's example/prometheus-operator-crd).
"""

from __future__ import annotations

from typing import Any

_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)(y|w|d|h|m|s|ms))+)$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                   "namespace": {"type": "string"}, "labels": _STRING_MAP,
                   "annotations": _STRING_MAP},
    "additionalProperties": False,
}


def _resource(kind: str, api_version: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                       "metadata": _METADATA, "spec": spec},
        "additionalProperties": False,
    }


SERVICE_MONITOR = _resource("ServiceMonitor", "monitoring.coreos.com/v1", {
    "type": "object",
    "required": ["selector", "endpoints"],
    "properties": {
        "jobLabel": {"type": "string"},
        "selector": {"type": "object", "properties": {"matchLabels": _STRING_MAP},
                     "additionalProperties": False},
        "namespaceSelector": {"type": "object"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["port"],
            "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                           "scheme": {"enum": ["http", "https"]},
                           "interval": _DURATION, "scrapeTimeout": _DURATION,
                           "honorLabels": {"type": "boolean"}},
            "additionalProperties": False}},
    },
    "additionalProperties": False,
})

_RULE = {
    "type": "object",
    "required": ["expr"],
    "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                   "expr": {"type": ["string", "integer"]}, "for": _DURATION,
                   "keep_firing_for": _DURATION, "labels": _STRING_MAP,
                   "annotations": _STRING_MAP},
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "additionalProperties": False,
}

PROMETHEUS_RULE = _resource("PrometheusRule", "monitoring.coreos.com/v1", {
    "type": "object",
    "required": ["groups"],
    "properties": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "required": ["name", "rules"],
        "properties": {"name": {"type": "string"}, "interval": _DURATION,
                       "rules": {"type": "array", "minItems": 1, "items": _RULE}},
        "additionalProperties": False}}},
    "additionalProperties": False,
})

KUSTOMIZATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "resources"],
    "properties": {
        "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
        "kind": {"const": "Kustomization"},
        "namespace": {"type": "string"},
        "resources": {"type": "array", "items": {"type": "string"}},
        "images": {"type": "array", "items": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "newName": {"type": "string"},
                           "newTag": {"type": "string"}, "digest": {"type": "string"}},
            "additionalProperties": False}},
    },
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": SERVICE_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
    "Kustomization": KUSTOMIZATION,
}
