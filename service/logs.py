"""Logging setup: structlog JSON lines on stdout (or a readable console format), with the
stdlib loggers of grpc, torch and transformers routed through the same renderer.

Request context (request_id, rpc, peer, ...) is bound with structlog's contextvars by the
interceptor, so every line logged while a call runs carries it, also lines logged by the
executor on its worker thread (the worker copies the context). Named ``logs`` and not
``logging`` so it never shadows the standard library.

Tracebacks are logged without the frames' local variables: those hold request bodies
(prompt token ids) and request metadata, which must not reach the logs, and rendering them
(tensors, modules) takes seconds per error.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import Processor

LogFormat = Literal["json", "console"]

# Third-party loggers that are chatty at INFO.
_QUIET = {"urllib3": logging.WARNING, "filelock": logging.WARNING}


def configure_logging(fmt: LogFormat = "json", level: str | int = "INFO",
                      stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger once, at start-up."""
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.stdlib.ExtraAdder(),
    ]
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        final: list[Processor] = [tracebacks, renderer]
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback)
        final = [renderer]

    structlog.configure(
        # Dropped first when below the level: a probe's DEBUG summary line costs nothing.
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    for name, quiet_level in _QUIET.items():
        logging.getLogger(name).setLevel(quiet_level)
    logging.captureWarnings(True)
