"""The committed generated code is exactly what the pinned generator makes of the .proto,
and it asks no more of the runtime than GPU images have (protobuf 5.29+, grpcio 1.71+)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from service.gen.model_executor.v1 import executor_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "service" / "gen" / "model_executor" / "v1"


def test_regenerating_gives_no_diff() -> None:
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_generated_code_asks_for_old_enough_runtimes() -> None:
    pb2 = (GEN / "executor_pb2.py").read_text()
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    assert gencode is not None
    assert tuple(int(g) for g in gencode.groups()) <= (5, 29, 0)
    grpc_file = (GEN / "executor_pb2_grpc.py").read_text()
    version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_file)
    assert version is not None
    assert tuple(int(p) for p in version.group(1).split(".")) <= (1, 71, 0)


def test_every_rpc_and_field_has_a_doc_comment() -> None:
    lines = (ROOT / "proto" / "model_executor" / "v1" / "executor.proto").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        code = line.strip()
        declares = (code.startswith(("rpc ", "message ", "enum ", "service "))
                    or re.match(r"^(optional |repeated )?[\w.]+ \w+ = \d+;", code)
                    or re.match(r"^[A-Z_]+ = \d+;", code))
        if declares and not lines[i - 1].strip().startswith("//"):
            undocumented.append(code)
    assert not undocumented


def test_service_surface() -> None:
    service = pb.DESCRIPTOR.services_by_name["Executor"]
    assert service.full_name == "model_executor.v1.Executor"
    assert set(service.methods_by_name) == {"Prefill", "Decode", "Release", "Capture", "Health",
                                            "Session", "Truncate", "Fork", "UpdateWeights",
                                            "InitWeightTransfer", "DestroyWeightTransfer",
                                            "Sleep", "WakeUp"}
