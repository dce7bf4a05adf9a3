"""model-executor's gRPC process: server bootstrap, servicer, errors, metrics, logs, CLI."""

from __future__ import annotations

from importlib import metadata


def _version() -> str:
    try:
        return metadata.version("model-executor")
    except metadata.PackageNotFoundError:  # running from a source tree
        from executor import __version__

        return __version__


__version__ = _version()
