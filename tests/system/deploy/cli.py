"""The real CLI parser, applied to the arguments the deployment files pass to the image."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Mapping

import pytest

from executor.config import ExecutorConfig
from service.cli import build_configs, build_parser
from service.config import ServerConfig


def parse_serve(argv: list[str], where: str, env: Mapping[str, str] | None = None
                ) -> tuple[argparse.Namespace, ExecutorConfig, ServerConfig]:
    """Parse ``model-executor <argv>`` as ``service.cli.main`` would, then build the configs
    (which validates values); fail with argparse's message if either step refuses. ``env``:
    the environment the container would have (default: this process's)."""
    assert argv and argv[0] == "serve", f"{where}: expected `serve ...`, got {argv}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv)
            executor_config, server_config = build_configs(args, env)
    except SystemExit:
        pytest.fail(f"{where}: the CLI rejects {argv}: {stderr.getvalue().strip()}")
    except ValueError as exc:
        pytest.fail(f"{where}: invalid configuration {argv}: {exc}")
    return args, executor_config, server_config
