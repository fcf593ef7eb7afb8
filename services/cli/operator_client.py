"""The operator side of the CLI: a gRPC client authenticated by an operator certificate.

Operators query the ledger with ``ztate ledger ...``. The client reads its
certificate, key and CA from flags or, by default, the development layout
(``$ZTATE_HOME/certs/operator-admin.*``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

from ztate.services.runtime import tls

DEFAULT_TARGET = "127.0.0.1:7443"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="host:port of the service")
    parser.add_argument("--cert", help="operator certificate (PEM)")
    parser.add_argument("--key", help="operator private key (PEM)")
    parser.add_argument("--ca", help="CA certificate (PEM)")
    parser.add_argument("--server-name", help="expected server name, if not the target host")


def operator_channel(args: argparse.Namespace, home: Path) -> grpc.aio.Channel:
    certs = home / "certs"
    return tls.client_channel(
        args.target,
        Path(args.cert) if args.cert else certs / "operator-admin.crt",
        Path(args.key) if args.key else certs / "operator-admin.key",
        Path(args.ca) if args.ca else certs / "ca.crt",
        server_name=args.server_name,
    )
