"""How much the reliability suite does: a CI budget (minutes on a 2-core machine), or a
soak budget when ``MODEL_EXECUTOR_SOAK=1``. Read once, here."""

from __future__ import annotations

import os
from dataclasses import dataclass

SOAK_ENV = "MODEL_EXECUTOR_SOAK"
REPORT_ENV = "MODEL_EXECUTOR_RELIABILITY_REPORT"


@dataclass(frozen=True)
class Budget:
    name: str
    clients: int  # concurrent clients of the load test
    calls_per_client: int
    fuzz_examples: int  # hypothesis examples per fuzz test
    fuzz_steps: int  # calls per random call sequence
    malformed_per_method: int  # random byte strings sent at each method
    soak_seconds: float  # the steady-load memory test (soak only)
    call_timeout_s: float  # no call may take longer: a hang fails the test


CI = Budget("ci", clients=32, calls_per_client=100, fuzz_examples=80, fuzz_steps=25,
            malformed_per_method=40, soak_seconds=0.0, call_timeout_s=30.0)
SOAK = Budget("soak", clients=64, calls_per_client=1000, fuzz_examples=500, fuzz_steps=60,
              malformed_per_method=1000, soak_seconds=float(os.environ.get(
                  "MODEL_EXECUTOR_SOAK_SECONDS", "600")), call_timeout_s=60.0)

BUDGET = SOAK if os.environ.get(SOAK_ENV, "") not in ("", "0") else CI
