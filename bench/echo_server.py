"""The ceiling's server: a unary echo behind the transition service's mTLS set-up.

Run as ``python -m bench.echo_server PORT CERT KEY CA``. It is what
``ztate.transition_service.app`` builds (grpc.aio, uvloop, the same server options and
``ssl_server_credentials(require_client_auth=True)``) with a handler that returns
its request bytes and does nothing else, so no service on this stack can beat it.
It stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import grpc
import uvloop

from bench.environment import Credentials

SERVICE = "ztate.bench.v1.Echo"
METHOD = "Echo"
FULL_METHOD = f"/{SERVICE}/{METHOD}"
SERVER_OPTIONS = [
    # as ztate.transition_service.app configures its server
    ("grpc.max_concurrent_streams", 256),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


async def echo(request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def serve(port: int, credentials: Credentials) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    if server.add_secure_port(f"127.0.0.1:{port}", credentials.server_credentials()) == 0:
        raise SystemExit(f"echo server: cannot listen on 127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_server")
    parser.add_argument("port", type=int)
    parser.add_argument("cert", type=Path)
    parser.add_argument("key", type=Path)
    parser.add_argument("ca", type=Path)
    args = parser.parse_args()
    uvloop.run(serve(args.port, Credentials(args.cert, args.key, args.ca)))


if __name__ == "__main__":
    main()
