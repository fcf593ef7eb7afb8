"""A transition service as its own operating-system process, for the tests that
kill it, stop it with a signal, or take its database away.

The process is ``ztate serve``, configured through the environment exactly as
a deployment would configure it. Its health is read over the real gRPC health
protocol (``grpc.health.v1``), so tests wait on the status the service reports,
never on a fixed delay.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness import TRUST_DOMAIN, Credentials, Pki

ZTATE = Path(sys.executable).with_name("ztate")
LISTENING = b"transition service listening on port"
START_TIMEOUT_SECONDS = 60.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def secure_channel(target: str, creds: Credentials) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        target,
        grpc.ssl_channel_credentials(
            creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
        ),
    )


class ServedProcess:
    """``ztate serve`` on a loopback port, started and stopped by the test."""

    def __init__(
        self, *, home: Path, dsn: str, pki: Pki, policy: Path, keyring: Path, **settings: str
    ) -> None:
        self.port = free_port()
        self.pki = pki
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
        self.env.update(
            DATABASE_URL=dsn,
            ZTATE_HOME=str(home),
            ZTATE_LISTEN=f"127.0.0.1:{self.port}",
            ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
            ZTATE_TLS_CERT=str(pki.certs / "service-transition.crt"),
            ZTATE_TLS_KEY=str(pki.certs / "service-transition.key"),
            ZTATE_TLS_CA=str(pki.certs / "ca.crt"),
            ZTATE_POLICY_PATH=str(policy),
            ZTATE_HMAC_KEYRING_FILE=str(keyring),
        )
        self.env.update({f"ZTATE_{k.upper()}": v for k, v in settings.items()})
        self.process: asyncio.subprocess.Process | None = None
        self.log: list[bytes] = []
        self._drain: asyncio.Task[None] | None = None

    @property
    def target(self) -> str:
        return f"localhost:{self.port}"

    async def start(self) -> None:
        """Launch the service and return once it listens (it reports SERVING by then)."""
        self.process = await asyncio.create_subprocess_exec(
            str(ZTATE),
            "serve",
            env=self.env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        stderr = self.process.stderr
        assert stderr is not None

        async def listening() -> None:
            while LISTENING not in (line := await stderr.readline()):
                assert line, b"".join(self.log).decode(errors="replace")
                self.log.append(line)

        await asyncio.wait_for(listening(), START_TIMEOUT_SECONDS)
        self._drain = asyncio.get_running_loop().create_task(self._keep_reading(stderr))

    async def _keep_reading(self, stderr: asyncio.StreamReader) -> None:
        """Read the log to its end, so that logging never blocks on a full pipe."""
        while line := await stderr.readline():
            self.log.append(line)

    def logged(self, text: str) -> bool:
        return any(text.encode() in line for line in self.log)

    async def kill(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed or finished."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(self.process.wait(), 10) == -signal.SIGKILL
        await self._finish()

    async def terminate(self, within: float = 30.0) -> int:
        """SIGTERM, and the exit status once the process is gone."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.process.wait(), within)
        await self._finish()
        return code

    async def _finish(self) -> None:
        if self._drain is not None:
            await asyncio.wait_for(self._drain, 10)
            self._drain = None
        self.process = None

    async def ensure_stopped(self) -> None:
        if self.process is not None and self.process.returncode is None:
            await self.kill()

    @asynccontextmanager
    async def health(self) -> AsyncIterator[health_pb2_grpc.HealthStub]:
        async with secure_channel(self.target, self.pki.operator()) as channel:
            yield health_pb2_grpc.HealthStub(channel)


async def wait_for_status(
    health: health_pb2_grpc.HealthStub, status: int, *, service: str = "", within: float = 20.0
) -> None:
    """Follow the health Watch stream until ``service`` reports ``status``."""

    async def watch() -> None:
        async for update in health.Watch(health_pb2.HealthCheckRequest(service=service)):
            if update.status == status:
                return
        raise AssertionError("the health stream ended before the status was reported")

    await asyncio.wait_for(watch(), within)


async def run_ztate(*args: str, env: dict[str, str], within: float = 60.0) -> tuple[int, str]:
    """Run one ``ztate`` command; its exit status and its combined output."""
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), within)
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")
