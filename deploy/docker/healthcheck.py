"""Exit 0 if the executor's standard gRPC health service reports SERVING, else 1.

The image's HEALTHCHECK (and docker-compose's ``depends_on: service_healthy``) run this:
grpcurl and grpc_health_probe are not in the image, but grpcio and its health stubs are.

    python healthcheck.py                                   # readiness on 127.0.0.1:50051
    python healthcheck.py --service ""                      # liveness
    python healthcheck.py --target 10.0.0.7:50051 --timeout 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READINESS_SERVICE = "model_executor.v1.Executor"


def check(target: str, service: str, timeout: float) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) or the gRPC error code name."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name  # type: ignore[attr-defined]
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    parser.add_argument("--service", default=READINESS_SERVICE,
                        help="health service name: '' (liveness) or "
                        f"{READINESS_SERVICE} (readiness)")
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds")
    args = parser.parse_args(argv)
    status = check(args.target, args.service, args.timeout)
    print(f"{args.target} {args.service or '(liveness)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
