"""Ask a server's standard gRPC health service whether it serves: the probe for containers.

Exit 0 when the service answers SERVING, 1 when it answers anything else (NOT_SERVING
while it shuts down, or an unknown service name), 2 when it cannot be asked (down,
refused, a TLS failure). The health check needs no token. Over TLS, give the CA
the server's certificate chains to (--tls-ca) and, for a server demanding mutual
TLS, this probe's certificate and key. Kubernetes' built-in gRPC probe speaks no
TLS, so the manifests in deploy/ run this as an exec probe.

Examples:
  kvstore health --target 127.0.0.1:50051
  kvstore health --target 127.0.0.1:50051 --tls-ca /etc/kvstore/tls/ca.crt --tls-server-name kvstore
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_TARGET = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (the TLS flags are every command's: kvstore.commands)."""
    from kvstore.commands import add_connection_arguments

    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    parser.add_argument("--service", default="kvstore.v1.KVStore",
                        help="service name to ask about ('' : the server as a whole; default kvstore.v1.KVStore)")
    add_connection_arguments(parser)  # --token is accepted and not sent: the health check needs none
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _channel(args: argparse.Namespace) -> Any:
    import grpc

    from kvstore.commands import client_options

    tls = client_options(args)["tls"]
    if tls is None:
        return grpc.insecure_channel(args.target)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(args.target, tls.credentials(), options=options)


def run(args: argparse.Namespace) -> int:
    """Ask, print the answer, exit 0 only on SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.client.connection import status_error

    channel = _channel(args)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise status_error(exc) from None
        status = "SERVICE_UNKNOWN"
    finally:
        channel.close()
    print(json.dumps({"target": args.target, "service": args.service, "status": status}) if args.json
          else f"{args.target} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1
