"""Loaded by every Python process started with this folder first on ``PYTHONPATH`` (the
interpreter imports ``sitecustomize`` at start-up): with ``MODEL_EXECUTOR_TP_TRACE`` set,
it traces the tensor-parallel step path of that process (``bench.profile.tp_trace``)."""

import os

if os.environ.get("MODEL_EXECUTOR_TP_TRACE"):
    from bench.profile.tp_trace.hook import arm

    arm(os.environ["MODEL_EXECUTOR_TP_TRACE"])
