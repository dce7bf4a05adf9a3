"""Run the reliability suite and print its figures (calls made, errors by code, invariant
checks passed, peak RSS, Health latency under load, drain timings).

    python -m tests.system.reliability.report               # the CI budget
    MODEL_EXECUTOR_SOAK=1 python -m tests.system.reliability.report
    python -m tests.system.reliability.report --out figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.system.reliability.budget import REPORT_ENV

ROOT = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also keep the JSON here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp) / "figures.json"
        env = {**os.environ, REPORT_ENV: str(path)}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not gpu",
                                 "tests/system/reliability", *args.pytest_args], cwd=ROOT, env=env,
                                check=False)
        if path.exists():
            print(json.dumps(json.loads(path.read_text()), indent=2))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
