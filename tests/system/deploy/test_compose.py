"""docker-compose, checked without Docker: the executor runs the CPU profile on ``tiny``
with flags the CLI accepts, every mounted file exists, and the pieces point at each other
(Prometheus -> executor, Grafana -> Prometheus, provider -> dashboard mount)."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from service.cli import build_parser
from tests.system.deploy.cli import parse_serve
from tests.system.deploy.support import COMPOSE, DASHBOARD, GRAFANA, PROMETHEUS, REPO, load_yaml


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return dict(load_yaml(COMPOSE / "docker-compose.yml")["services"])


def _published(service: dict[str, Any]) -> set[int]:
    return {int(str(p).split(":")[-1]) for p in service.get("ports", [])}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path, for bind mounts (short or long syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            out[volume["target"]] = volume["source"]
        else:
            host, container = volume.split(":")[:2]
            out[container] = host
    return out


def test_executor_runs_the_cpu_profile_on_tiny(services: dict[str, Any]) -> None:
    executor = services["executor"]
    args, executor_config, server = parse_serve(executor["command"], "docker-compose executor")
    assert args.model == "tiny" and executor_config.device == "cpu"
    assert server.host == "0.0.0.0"
    assert {server.port, server.metrics_port} <= _published(executor)
    build = executor["build"]
    assert (COMPOSE / build["context"]).resolve() == REPO
    assert (REPO / build["dockerfile"]).is_file()


def test_gpu_overlay(services: dict[str, Any]) -> None:
    overlay = load_yaml(COMPOSE / "docker-compose.gpu.yml")["services"]["executor"]
    _, executor_config, server = parse_serve(overlay["command"], "docker-compose.gpu.yml")
    assert executor_config.device.startswith("cuda")
    _, _, cpu_server = parse_serve(services["executor"]["command"], "docker-compose executor")
    assert (server.port, server.metrics_port) == (cpu_server.port, cpu_server.metrics_port)
    devices = overlay["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    model = overlay["volumes"][0]
    assert model["type"] == "bind" and model["read_only"] is True
    assert model["source"].startswith("${MODEL_DIR:?")
    assert executor_config.model.source == model["target"]


def test_bind_mounts_exist(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for container, host in _mounts(service).items():
            if host.startswith("${"):
                continue  # set by the operator (MODEL_DIR)
            assert (COMPOSE / host).exists(), f"{name}: {host} (for {container}) is missing"


def test_prometheus_scrapes_the_executor(services: dict[str, Any]) -> None:
    _, _, server = parse_serve(services["executor"]["command"], "docker-compose executor")
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    targets = [t for job in config["scrape_configs"] for s in job["static_configs"]
               for t in s["targets"]]
    assert targets == [f"executor:{server.metrics_port}"]
    assert "/etc/prometheus/prometheus.yml" in _mounts(services["prometheus"])


def test_loadgen_uses_the_client_cli(services: dict[str, Any]) -> None:
    loadgen = services["loadgen"]
    assert loadgen["image"] == services["executor"]["image"]
    assert loadgen["depends_on"]["executor"]["condition"] == "service_healthy"
    script = loadgen["command"][0]
    words = shlex.split(script.split("model-executor", 1)[1].split(">", 1)[0])
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args: argparse.Namespace = build_parser().parse_args(words)
    except SystemExit:
        pytest.fail(f"the CLI rejects `model-executor {' '.join(words)}`: {stderr.getvalue()}")
    _, _, server = parse_serve(services["executor"]["command"], "docker-compose executor")
    assert args.command == "client" and args.target == f"executor:{server.port}"


def test_grafana_is_provisioned_with_no_clicks(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    url = urlparse(datasources["datasources"][0]["url"])
    assert url.hostname == "prometheus" and url.port in _published(services["prometheus"])
    assert datasources["datasources"][0]["isDefault"] is True
    provider = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "model-executor.yml").read_text())
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert (COMPOSE / mounts[dashboards_dir]).resolve() == DASHBOARD.parent
    for kind in ("datasources", "dashboards"):
        assert (COMPOSE / mounts[f"/etc/grafana/provisioning/{kind}"]).resolve() \
            == GRAFANA / "provisioning" / kind
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
