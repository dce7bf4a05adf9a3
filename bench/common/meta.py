"""What a result records about its run: the commit measured and the device."""

from __future__ import annotations

import os
import platform
import subprocess


def git_commit() -> str:
    """The commit measured. The GPU machine gets a copy of the working tree whose .git (if
    any) may be stale, so the caller's ``MODEL_EXECUTOR_COMMIT`` wins over git there."""
    commit = os.environ.get("MODEL_EXECUTOR_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            commit = ""
    return commit or "unknown"


def device_name() -> str:
    """The CUDA device's name, or ``CPU (<processor>)`` on a machine without CUDA."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def driver() -> str:
    """The NVIDIA driver version (``nvidia-smi``), or ``unknown``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"
