"""Operator commands of the `kvstore` CLI, one module per command, imported only when that command runs.

Every command that talks to a server takes the same credentials:
`add_connection_arguments` adds them to its parser, `client_options` turns them
into `kvstore.Client` keyword arguments (the token defaults to KVSTORE_TOKEN).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

#: The environment variable a command's token defaults to.
TOKEN_ENV = "KVSTORE_TOKEN"


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--token and the TLS flags of a command that connects to a server."""
    parser.add_argument("--token", default=None,
                        help=f"API token (`kvstore tenant create`); default ${TOKEN_ENV}")
    parser.add_argument("--tls", action="store_true", help="speak TLS, checking the server against the system's CAs")
    parser.add_argument("--tls-ca", default="", help="CA certificates (PEM) the server's certificate chains to "
                        "(implies --tls)")
    parser.add_argument("--tls-cert", default="", help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key", default="", help="client private key (PEM) for mutual TLS")
    parser.add_argument("--tls-server-name", default="",
                        help="name to check the server's certificate against, when the target's is not in it")


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """`token=` and `tls=` for kvstore.Client from the flags `add_connection_arguments` added.

    The environment is read here, at the entry point, and nowhere in the client.
    """
    from kvstore.client.connection import TlsOptions

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    wants_tls = args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name
    tls = TlsOptions(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                     server_name=args.tls_server_name) if wants_tls else None
    return {"token": token, "tls": tls}
