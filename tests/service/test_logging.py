"""Logs: JSON lines with the request context, stdlib loggers through the same renderer."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from service.logs import configure_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    yield
    root.handlers, root.level = handlers, level
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()


@pytest.mark.usefixtures("restore_logging")
def test_structlog_and_stdlib_share_one_json_renderer() -> None:
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream)
    structlog.contextvars.bind_contextvars(request_id="r-1", rpc="Executor/Prefill")
    structlog.get_logger("service.test").info("step", items=2)
    logging.getLogger("grpc._server").warning("from %s", "grpc")
    try:
        raise ValueError("boom")
    except ValueError:
        structlog.get_logger("service.test").exception("failed")
    logging.getLogger("quiet").debug("not shown at INFO")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["step", "from grpc", "failed"]
    assert all(line["request_id"] == "r-1" for line in lines)  # stdlib lines get it too
    assert lines[0]["items"] == 2 and lines[0]["level"] == "info" and "timestamp" in lines[0]
    assert lines[1]["logger"] == "grpc._server" and lines[1]["level"] == "warning"
    assert lines[2]["exception"][0]["exc_type"] == "ValueError"


@pytest.mark.usefixtures("restore_logging")
def test_console_format_is_readable() -> None:
    stream = io.StringIO()
    configure_logging("console", "INFO", stream=stream)
    structlog.get_logger("service.test").info("serving", grpc="127.0.0.1:50051")
    text = stream.getvalue()
    assert "serving" in text and "grpc=127.0.0.1:50051" in text and not text.startswith("{")
