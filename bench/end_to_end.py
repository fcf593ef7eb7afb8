"""(c) ztate end to end: ``ProposeTransition`` to ``ztate serve`` in another process.

The service is the production entry point, configured only by ``ZTATE_*``
variables and ``DATABASE_URL``, with its shipped defaults otherwise (pool size,
head cache, limits). An operator creates one thread per worker first; each worker
then proposes, through its own ``worker_sdk.ZtateClient``, a ~1 KB patch against
the version it last committed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import cpu
from bench.environment import (
    ChildServer,
    Credentials,
    Pki,
    child_server,
    free_port,
    secure_channel,
)
from bench.loadgen import Operation, Sample, closed_loop
from bench.workload import DEFAULT_POLICY, INITIAL_STATE, TRUST_DOMAIN
from ztate.worker_sdk import ZtateClient


def service_environment(
    *,
    dsn: str,
    port: int,
    home: Path,
    pki: Pki,
    keyring_file: Path,
    policy_path: Path = DEFAULT_POLICY,
) -> dict[str, str]:
    """This process's environment without any ztate setting, plus the run's own."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("ZTATE_") and name != "DATABASE_URL"
    }
    return inherited | {
        "DATABASE_URL": dsn,
        "ZTATE_HOME": str(home),
        "ZTATE_LISTEN": f"127.0.0.1:{port}",
        "ZTATE_TRUST_DOMAIN": TRUST_DOMAIN,
        "ZTATE_TLS_CERT": str(pki.server.cert),
        "ZTATE_TLS_KEY": str(pki.server.key),
        "ZTATE_TLS_CA": str(pki.server.ca),
        "ZTATE_POLICY_PATH": str(policy_path),
        "ZTATE_HMAC_KEYRING_FILE": str(keyring_file),
    }


@contextmanager
def ztate_service(
    *,
    dsn: str,
    home: Path,
    pki: Pki,
    keyring_file: Path,
    log: Path,
    policy_path: Path = DEFAULT_POLICY,
    extra_env: Mapping[str, str] | None = None,
    workers: int = 1,
) -> Iterator[ChildServer]:
    """``ztate serve --workers N`` (the console script's module, run by this interpreter);
    with several workers the server's CPU is the supervisor's and its children's."""
    port = free_port()
    env = service_environment(
        dsn=dsn, port=port, home=home, pki=pki, keyring_file=keyring_file, policy_path=policy_path
    ) | dict(extra_env or {})
    argv = ["-m", "ztate.services.cli.main", "serve", "--workers", str(workers)]
    with child_server("ztate serve", argv, port=port, log=log, env=env) as child:
        yield child


def sdk_client(target: str, credentials: Credentials) -> ZtateClient:
    return ZtateClient.from_files(
        target, cert=credentials.cert, key=credentials.key, ca=credentials.ca
    )


async def health_check(target: str, credentials: Credentials) -> None:
    """One mTLS health Check RPC; raises ``AioRpcError`` while the server is not up."""
    channel = secure_channel(target, credentials)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    finally:
        await channel.close(None)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"service health is {reply.status}")


class Proposer:
    """One agent worker: proposes on its own thread from the version it last committed."""

    def __init__(self, client: ZtateClient, thread_id: str, patch_json: bytes) -> None:
        self._client = client
        self._thread_id = thread_id
        self._patch_json = patch_json
        self._version = 0

    async def propose(self) -> None:
        committed = await self._client.propose(self._thread_id, self._version, self._patch_json)
        self._version = committed.version


async def create_threads(target: str, operator: Credentials, count: int) -> list[str]:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    thread_ids = [f"{prefix}-{n}" for n in range(count)]
    async with sdk_client(target, operator) as client:
        for thread_id in thread_ids:
            await client.create_thread(thread_id, INITIAL_STATE)
    return thread_ids


async def measure_ztate(
    service: ChildServer,
    pki: Pki,
    patch_json: bytes,
    *,
    concurrency: int,
    warmup: float,
    duration: float,
    meters: Mapping[str, cpu.CpuMeter],
) -> Sample:
    """One closed-loop run of proposals, one client and one fresh thread per worker."""
    thread_ids = await create_threads(service.target, pki.operator, concurrency)
    async with AsyncExitStack() as stack:
        operations: list[Operation] = []
        for thread_id in thread_ids:
            client = await stack.enter_async_context(sdk_client(service.target, pki.worker))
            operations.append(Proposer(client, thread_id, patch_json).propose)
        return await closed_loop(
            "ztate: ProposeTransition", operations, warmup=warmup, duration=duration, meters=meters
        )
