"""(b) The ceiling: a 1 KB mTLS echo RPC to a server in another process.

Each worker gets its own channel built as ``worker_sdk.ZtateClient`` builds one
(same credentials and options), so this and the end-to-end measurement differ
only in what the server does with a call and in the SDK's own work per call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import grpc

from bench import cpu
from bench.echo_server import FULL_METHOD
from bench.environment import (
    ChildServer,
    Credentials,
    Pki,
    child_server,
    free_port,
    secure_channel,
)
from bench.loadgen import Operation, Sample, closed_loop

TIMEOUT_SECONDS = 10.0


@contextmanager
def echo_server(pki: Pki, log: Path) -> Iterator[ChildServer]:
    port = free_port()
    server = pki.server
    argv = ["-m", "bench.echo_server", str(port), str(server.cert), str(server.key), str(server.ca)]
    with child_server("echo server", argv, port=port, log=log) as child:
        yield child


def echo_operation(channel: grpc.aio.Channel, payload: bytes) -> Operation:
    # no serializers: the request and the reply are raw bytes
    call = channel.unary_unary(FULL_METHOD, request_serializer=None, response_deserializer=None)

    async def operation() -> bytes:
        reply: bytes = await call(payload, timeout=TIMEOUT_SECONDS)
        return reply

    return operation


async def measure_ceiling(
    server: ChildServer,
    credentials: Credentials,
    payload: bytes,
    *,
    concurrency: int,
    warmup: float,
    duration: float,
    meters: Mapping[str, cpu.CpuMeter],
) -> Sample:
    """One closed-loop run of echoes, one channel per worker."""
    async with AsyncExitStack() as stack:
        operations = []
        for _ in range(concurrency):
            channel = secure_channel(server.target, credentials)
            stack.push_async_callback(channel.close, None)
            operations.append(echo_operation(channel, payload))
        return await closed_loop(
            "ceiling: mTLS echo", operations, warmup=warmup, duration=duration, meters=meters
        )


async def echo_once(target: str, credentials: Credentials) -> None:
    """One echo on a fresh channel: the readiness probe."""
    channel = secure_channel(target, credentials)
    try:
        await echo_operation(channel, b"ready?")()
    finally:
        await channel.close(None)
