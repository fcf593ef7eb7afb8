"""(b) The ceiling: a 1 KB mTLS echo RPC to a server in another process; and (e) the
structural ceiling: the same RPC whose handler runs the store's one-statement commit.

Each worker gets its own channel built as ``worker_sdk.ZtateClient`` builds one
(same credentials and options), so this and the end-to-end measurement differ
only in what the server does with a call and in the SDK's own work per call.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import asyncpg
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
from bench.floor import CommitPayload, HeadWriter
from bench.loadgen import Operation, Sample, closed_loop
from bench.structural_server import FULL_METHOD as STRUCTURAL_METHOD
from bench.structural_server import request_bytes

TIMEOUT_SECONDS = 10.0
STRUCTURAL_LABEL = "structural: mTLS RPC + commit"


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


@contextmanager
def structural_server(
    pki: Pki, log: Path, *, dsn: str, role: str, pool_size: int, keyring_file: Path
) -> Iterator[ChildServer]:
    """(e) ``bench.structural_server``: one mTLS RPC whose handler runs the store's commit."""
    port = free_port()
    server = pki.server
    argv = ["-m", "bench.structural_server", str(port), str(server.cert), str(server.key)]
    argv += [str(server.ca), dsn, role, str(pool_size), str(keyring_file)]
    with child_server("structural server", argv, port=port, log=log) as child:
        yield child


class StructuralWriter:
    """One worker of (e): one head, one RPC per commit from the version it last committed."""

    def __init__(self, channel: grpc.aio.Channel, head: HeadWriter, patch_json: bytes) -> None:
        self._call = channel.unary_unary(
            STRUCTURAL_METHOD, request_serializer=None, response_deserializer=None
        )
        self._head = head
        self._patch_json = patch_json
        self._version = 0

    async def commit(self) -> None:
        request = request_bytes(self._head.thread_id, self._version, self._patch_json)
        reply: bytes = await self._call(request, timeout=TIMEOUT_SECONDS)
        self._version = int(reply)


async def measure_structural(
    server: ChildServer,
    credentials: Credentials,
    dsn: str,
    payload: CommitPayload,
    patch_json: bytes,
    *,
    role: str,
    concurrency: int,
    warmup: float,
    duration: float,
    meters: Mapping[str, cpu.CpuMeter],
) -> Sample:
    """One closed-loop run of (e): heads created first (straight through asyncpg), then one
    channel and one head per worker."""
    connection = await asyncpg.connect(dsn, server_settings={"role": role})
    prefix = f"structural-{uuid.uuid4().hex[:8]}"
    heads = [HeadWriter(connection, f"{prefix}-{n}", payload) for n in range(concurrency)]
    try:
        for head in heads:
            await head.create()
    finally:
        await connection.close()
    async with AsyncExitStack() as stack:
        operations = []
        for head in heads:
            channel = secure_channel(server.target, credentials)
            stack.push_async_callback(channel.close, None)
            operations.append(StructuralWriter(channel, head, patch_json).commit)
        return await closed_loop(
            STRUCTURAL_LABEL, operations, warmup=warmup, duration=duration, meters=meters
        )


async def structural_once(target: str, credentials: Credentials) -> None:
    """The readiness probe of (e): a commit on a thread that does not exist is refused."""
    channel = secure_channel(target, credentials)
    try:
        call = channel.unary_unary(STRUCTURAL_METHOD)
        try:
            await call(request_bytes("no-such-thread", 0, b""), timeout=TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.ABORTED:
                raise
    finally:
        await channel.close(None)
