"""``ztate health``: the gRPC health check of a running service, over mutual TLS.

Container runtimes need a command that says whether a service is serving.
Kubernetes' built-in ``grpc:`` probe cannot present a client certificate (its
``mode: TLS`` skips verification and sends none), and every ztate port requires
one, so the probe runs inside the container as this command: it calls
``grpc.health.v1.Health/Check`` with the service's own certificate, the same
files the service serves with, read from the service's configuration
(``ZTATE_TLS_*`` or ``ZTATE_APPROVAL_TLS_*``).

Exit codes, as every ``ztate`` command's (docs/cli.md): 0 SERVING; 1 the service
answered but is not serving (starting, shutting down, unknown service name); 2 it
could not be asked for want of configuration (unset or unreadable credentials, bad
settings); 4 it could not be reached (refused, timed out, TLS handshake failed).

``--live`` is the liveness question instead: is the process answering at all?
It exits 0 whatever status the server reports (NOT_SERVING while its database
is down is a live process waiting for it, which a restart would not help) and
2 or 4 when the server cannot be asked. Readiness keeps the serving check.

The probe runs every few seconds in every container, so it imports only what it
uses: gRPC, the health stubs and the settings, nothing of the servers, the policy
engine or the database driver.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

SERVING, NOT_SERVING, CANNOT_ASK, UNREACHABLE = 0, 1, 2, 4
TRANSITION_SERVICE = "ztate.v1.TransitionService"
APPROVAL_SERVICE = "ztate.v1.ApprovalService"

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


class Probe(NamedTuple):
    """Where to ask, about which service, as which identity."""

    target: str
    service: str
    cert: Path
    key: Path
    ca: Path
    server_name: str | None = None
    timeout: float = 3.0


def ask(probe: Probe) -> str:
    """The service's health status name, e.g. ``"SERVING"``; raises ``grpc.RpcError``
    when the call fails and ``OSError`` when a credential file cannot be read.

    A blocking one-off call: no event loop, and the credentials handed to gRPC as read
    (the server checks them; the probe need not parse certificates), which keeps the
    probe's start-up cost to gRPC, its health stubs and the settings."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ztate.contract.files import read_credentials

    cert, key, ca = read_credentials(probe.cert, probe.key, probe.ca)  # bounded
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    options = [("grpc.ssl_target_name_override", probe.server_name)] if probe.server_name else []
    with grpc.secure_channel(probe.target, credentials, options=options) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=probe.service), timeout=probe.timeout
        )
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


async def check(probe: Probe) -> str:
    """``ask``, for callers inside an event loop (it runs on a worker thread)."""
    import asyncio

    return await asyncio.to_thread(ask, probe)


def _local(listen: str) -> str:
    """The loopback address of a ``host:port`` the service listens on."""
    return f"localhost:{listen.rsplit(':', 1)[1]}"


class MissingCredentials(ValueError):
    """The service's configuration names no certificate, key or CA to probe with."""


def probe_from_settings(args: argparse.Namespace) -> Probe:
    """The probe for the service configured in this environment (``--approval``: the
    approval service's settings), with the command line's overrides."""
    from ztate.services.runtime.config import ApprovalSettings, Settings

    if args.approval:
        approval = ApprovalSettings()
        listen, service = approval.listen, APPROVAL_SERVICE
        cert, key, ca = approval.tls_cert, approval.tls_key, approval.tls_ca
    else:
        settings = Settings()
        listen, service = settings.listen, TRANSITION_SERVICE
        cert, key, ca = settings.tls_cert, settings.tls_key, settings.tls_ca
    if cert is None or key is None or ca is None:
        prefix = "ZTATE_APPROVAL_TLS" if args.approval else "ZTATE_TLS"
        raise MissingCredentials(f"{prefix}_CERT, {prefix}_KEY and {prefix}_CA must all be set")
    return Probe(
        target=args.target or _local(listen),
        service=service if args.service is None else args.service,
        cert=cert,
        key=key,
        ca=ca,
        server_name=args.server_name,
        timeout=args.timeout,
    )


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from pydantic import ValidationError

    from ztate.services.runtime.config import describe

    try:
        probe = probe_from_settings(args)
    except ValidationError as exc:
        print(f"ztate health: invalid configuration: {describe(exc)}", file=sys.stderr)
        return CANNOT_ASK
    except MissingCredentials as exc:
        print(f"ztate health: invalid configuration: {exc}", file=sys.stderr)
        return CANNOT_ASK
    try:
        status = ask(probe)
    except grpc.RpcError as error:
        if error.code() is grpc.StatusCode.NOT_FOUND:  # the server knows no such service
            print(f"ztate health: {probe.service!r}: SERVICE_UNKNOWN", file=sys.stderr)
            return SERVING if args.live else NOT_SERVING
        print(f"ztate health: {probe.target}: {error.code().name}", file=sys.stderr)
        return UNREACHABLE
    except OSError as exc:
        print(f"ztate health: cannot read credentials: {exc.strerror}", file=sys.stderr)
        return CANNOT_ASK
    except ValueError as exc:  # FileTooLarge: the message names the file and the bound
        print(f"ztate health: cannot read credentials: {exc}", file=sys.stderr)
        return CANNOT_ASK
    print(f"{probe.service or '(server)'}: {status}")
    return SERVING if args.live or status == "SERVING" else NOT_SERVING


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``health`` to the ``ztate`` command."""
    add_health_command(subparsers)


def add_health_command(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``health`` to the ``ztate`` command."""
    from ztate.services.cli.resources import bounded_float

    health = subparsers.add_parser(
        "health",
        help="gRPC health check of a running service over mTLS (container probes)",
        description="Exit 0: SERVING; 1: answered, not serving; 2: no usable configuration; "
        "4: unreachable. With --live: 0 whenever the server answers (liveness).",
    )
    health.add_argument(
        "--live",
        action="store_true",
        help="liveness: exit 0 if the server answers at all, SERVING or not",
    )
    health.add_argument(
        "--approval", action="store_true", help="probe the approval service (ZTATE_APPROVAL_*)"
    )
    health.add_argument("--target", help="host:port (default: localhost and the listen port)")
    health.add_argument(
        "--service", help="service name to ask about (default: the service's own; '' = server)"
    )
    health.add_argument("--server-name", help="expected server name, if not the target host")
    health.add_argument(
        "--timeout",
        type=bounded_float(0.1, 3600),
        default=3.0,
        help="seconds, 0.1 to 3600 (default 3)",
    )
    health.set_defaults(func=cmd_health)
