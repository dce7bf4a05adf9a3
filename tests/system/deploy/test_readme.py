"""deploy/README.md names only files that exist, and its Kubernetes numbers are the
manifests' (so the operator's guide cannot drift from what ships)."""

from __future__ import annotations

import re

from tests.system.deploy.support import DEPLOY, REPO, k8s_manifests

README = DEPLOY / "README.md"


def test_paths_in_the_readme_exist() -> None:
    text = README.read_text()
    paths = set(re.findall(r"(?<![\w/])((?:deploy|tests/system/deploy)/[\w./-]*\w)", text))
    assert paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"deploy/README.md names missing files: {missing}"


def test_drain_numbers_match_the_deployment() -> None:
    text = README.read_text()
    pod = k8s_manifests()["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert f"terminationGracePeriodSeconds: {pod['terminationGracePeriodSeconds']}" in text
    assert f"sleeps {container['lifecycle']['preStop']['exec']['command'][1]} s" in text
    for flag in ("--drain-delay", "--grace-period"):
        value = next(a for a in container["args"] if a.startswith(flag + "="))
        assert f"`{value}`" in text, value
