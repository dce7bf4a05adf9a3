"""The Dockerfile without Docker: it refers only to files that exist and reach the build
context, its stages and user are as documented, and its ENTRYPOINT + CMD are accepted by
the real CLI (``--help`` of the command it runs succeeds). The HEALTHCHECK script is run
against a live server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.system.deploy.cli import parse_serve
from tests.system.deploy.dockerfile import DockerIgnore, Instruction, parse
from tests.system.deploy.support import DEPLOY, REPO, LiveServer, free_port, require_module

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"
BASE_TAG = re.compile(r"^pytorch/pytorch:(?P<torch>\d+\.\d+\.\d+)-cuda(?P<cuda>[\d.]+)"
                      r"-cudnn\d+-(?P<flavor>runtime|devel)$")


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def dockerignore() -> DockerIgnore:
    return DockerIgnore.parse((REPO / ".dockerignore").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    tomllib = require_module("tomllib", "Python >= 3.11")
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text()))


def _final(instructions: list[Instruction], keyword: str) -> Instruction:
    last_stage = max(i.stage for i in instructions)
    found = [i for i in instructions if i.keyword == keyword and i.stage == last_stage]
    assert found, f"no {keyword} in the final stage"
    return found[-1]


def _stage_names(instructions: list[Instruction]) -> list[str]:
    names = []
    for i in instructions:
        if i.keyword == "FROM":
            words = i.args.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"line {i.line}: name stages"
            names.append(words[2])
    return names


def test_multi_stage_on_a_cuda_pytorch_base(instructions: list[Instruction],
                                            pyproject: dict[str, Any]) -> None:
    assert len(_stage_names(instructions)) >= 2
    base = next(i.args.split("=", 1)[1] for i in instructions
                if i.keyword == "ARG" and i.args.startswith("BASE_IMAGE="))
    m = BASE_TAG.match(base)
    assert m, f"BASE_IMAGE {base!r} is not a pytorch/pytorch CUDA image"
    torch_spec = next(d for d in pyproject["project"]["dependencies"]
                      if d.startswith("torch"))
    assert Version(m["torch"]) in SpecifierSet(torch_spec[len("torch"):]), \
        f"base image torch {m['torch']} is outside pyproject's {torch_spec}"
    assert all(i.args == "${BASE_IMAGE} AS " + n for i, n in zip(
        [i for i in instructions if i.keyword == "FROM"], _stage_names(instructions),
        strict=True))


def test_copied_files_exist_and_reach_the_context(instructions: list[Instruction],
                                                  dockerignore: DockerIgnore) -> None:
    stages = _stage_names(instructions)
    copies = [i for i in instructions if i.keyword in {"COPY", "ADD"}]
    assert copies
    for copy in copies:
        assert copy.keyword == "COPY", f"line {copy.line}: prefer COPY to ADD"
        flags, operands = copy.flags_and_operands()
        sources = operands[:-1]
        assert sources, f"line {copy.line}: COPY needs a source and a destination"
        if "from" in flags:
            assert flags["from"] in stages[:copy.stage], f"line {copy.line}: unknown stage"
            continue
        for source in sources:
            path = REPO / source
            assert path.exists(), f"line {copy.line}: {source} does not exist"
            files = [path] if path.is_file() else [p for p in path.rglob("*.py")][:50]
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                assert dockerignore.included(rel), f".dockerignore drops {rel} (line {copy.line})"


def test_every_package_of_the_project_is_copied(instructions: list[Instruction],
                                                pyproject: dict[str, Any]) -> None:
    copied = {op.rstrip("/") for i in instructions if i.keyword == "COPY"
              for op in i.flags_and_operands()[1][:-1]}
    includes = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in REPO.iterdir() if p.is_dir()
                and any(re.fullmatch(g.replace("*", ".*"), p.name) for g in includes)}
    assert packages and packages <= copied, f"not copied: {sorted(packages - copied)}"
    assert "pyproject.toml" in copied


def test_dockerignore_keeps_the_context_small(dockerignore: DockerIgnore) -> None:
    for path in (".venv/bin/python", ".git/HEAD", ".cache/x", "tests/conftest.py",
                 "executor/__pycache__/config.cpython-311.pyc", "bench/e2e/run.py",
                 "deploy/k8s/deployment.yaml"):
        assert not dockerignore.included(path), path
    for path in ("pyproject.toml", "executor/config.py", "service/cli.py",
                 "service/gen/model_executor/v1/executor_pb2.py",
                 "deploy/docker/healthcheck.py"):
        assert dockerignore.included(path), path


def test_runs_as_a_non_root_user(instructions: list[Instruction]) -> None:
    user = _final(instructions, "USER")
    assert user.args.split(":")[0] not in {"0", "root"}
    entrypoint = _final(instructions, "ENTRYPOINT")
    assert user.line < entrypoint.line


def test_c_compiler_for_triton(instructions: list[Instruction]) -> None:
    last_stage = max(i.stage for i in instructions)
    runs = " ".join(i.args for i in instructions if i.keyword == "RUN" and i.stage == last_stage)
    assert re.search(r"apt-get install .*\b(build-essential|gcc)\b", runs)


def test_entrypoint_and_cmd_match_the_cli(instructions: list[Instruction],
                                          pyproject: dict[str, Any]) -> None:
    entrypoint = _final(instructions, "ENTRYPOINT").exec_form()
    assert entrypoint == ["model-executor"]
    assert pyproject["project"]["scripts"]["model-executor"] == "service.cli:main"
    cmd = _final(instructions, "CMD").exec_form()
    _, _, server = parse_serve(cmd, "Dockerfile CMD")
    assert server.host == "0.0.0.0", "inside a container the CLI must bind all interfaces"
    exposed = {int(p.split("/")[0]) for p in _final(instructions, "EXPOSE").args.split()}
    assert {server.port, server.metrics_port} <= exposed


def test_help_of_the_entrypoint_succeeds(pyproject: dict[str, Any]) -> None:
    """Run the console script's target exactly as the installed ``model-executor`` does."""
    module, _, function = pyproject["project"]["scripts"]["model-executor"].partition(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    commands = [[sys.executable, "-c", code, "serve", "--help"]]
    script = Path(sys.executable).parent / "model-executor"
    if script.exists():  # present after `pip install -e .` (scripts/bootstrap.sh)
        commands.append([str(script), "serve", "--help"])
    for command in commands:
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "usage: model-executor serve" in result.stdout
        assert "--grace-period" in result.stdout


def test_healthcheck_matches_the_cli(instructions: list[Instruction]) -> None:
    health = _final(instructions, "HEALTHCHECK")
    command = health.args[health.args.index("CMD") + len("CMD"):]
    argv = Instruction("CMD", command, health.stage, health.line).exec_form()
    copied = {i.flags_and_operands()[1][-1]: i.flags_and_operands()[1][0]
              for i in instructions if i.keyword == "COPY" and i.stage == health.stage}
    assert argv[0] == "python" and copied.get(argv[1]) == "deploy/docker/healthcheck.py"
    _, _, server = parse_serve(_final(instructions, "CMD").exec_form(), "Dockerfile CMD")
    assert argv[argv.index("--target") + 1] == f"127.0.0.1:{server.port}"


def _healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=30)


def test_healthcheck_script_against_a_live_server(live_server: LiveServer) -> None:
    ready = _healthcheck("--target", live_server.target)
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert "SERVING" in ready.stdout
    assert _healthcheck("--target", live_server.target, "--service", "").returncode == 0
    unknown = _healthcheck("--target", live_server.target, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout
    down = _healthcheck("--target", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stdout


# -- issue 19: layering, labels, a lean compiler, DL3008 justified ----------------------------

def test_dependencies_install_before_the_sources_are_copied(
        instructions: list[Instruction]) -> None:
    """A source edit must reuse the dependency layer: pyproject is copied and the
    requirements installed before any package's sources are copied."""
    build = [i for i in instructions if i.stage == 0]
    copies = {i.flags_and_operands()[1][0]: i.line for i in build if i.keyword == "COPY"}
    first_source = min(copies[p] for p in ("proto", "executor", "service"))
    installs = [i for i in build if i.keyword == "RUN" and "-r /tmp/requirements.txt" in i.args]
    assert installs and copies["pyproject.toml"] < installs[0].line < first_source
    project = [i for i in build if i.keyword == "RUN" and "pip install --no-deps" in i.args]
    assert project and project[0].line > first_source


def test_oci_labels(instructions: list[Instruction]) -> None:
    labels = " ".join(i.args for i in instructions if i.keyword == "LABEL")
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key


def test_only_a_c_compiler_and_dl3008_justified() -> None:
    text = DOCKERFILE.read_text()
    assert "build-essential" not in re.sub(r"#.*", "", text)
    before = text[: text.index("# hadolint ignore=DL3008")].splitlines()
    assert "archive" in " ".join(before[-4:]), "say why apt versions are not pinned"
