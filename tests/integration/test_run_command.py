"""`ztate run` on a fresh home: dev certificates, keys, embedded Postgres, and serving;
a second run reuses them and finds the data of the first."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from pathlib import Path

from worker_sdk import ZtateClient

LISTENING = re.compile(rb"transition service listening on port (\d+)")
START_TIMEOUT_SECONDS = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def start_run(home: Path, port: int) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL"}}
    env.update(ZTATE_HOME=str(home), ZTATE_LISTEN=f"127.0.0.1:{port}")
    ztate = Path(sys.executable).with_name("ztate")
    process = await asyncio.create_subprocess_exec(
        str(ztate), "run", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert process.stderr is not None

    async def wait_until_listening() -> None:
        assert process.stderr is not None
        while True:
            line = await process.stderr.readline()
            assert line, "ztate run exited before it listened"
            if LISTENING.search(line):
                return

    await asyncio.wait_for(wait_until_listening(), START_TIMEOUT_SECONDS)
    return process


async def stop(process: asyncio.subprocess.Process) -> int:
    process.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(process.wait(), 30)


def connect(home: Path, port: int, identity: str) -> ZtateClient:
    certs = home / "certs"
    return ZtateClient.from_files(
        f"localhost:{port}",
        cert=certs / f"{identity}.crt",
        key=certs / f"{identity}.key",
        ca=certs / "ca.crt",
    )


async def test_run_sets_up_serves_and_keeps_data(tmp_path: Path) -> None:
    home, port = tmp_path / "ztate-home", free_port()
    process = await start_run(home, port)
    try:
        stdout = await asyncio.wait_for(process.stdout.readline(), 5)  # type: ignore[union-attr]
        assert b"ztate control plane" in stdout
        async with connect(home, port, "operator-admin") as operator:
            await operator.create_thread(
                "demo", {"raw_text": "hello", "authority": {"tenant": "t"}}
            )
        async with connect(home, port, "node-input-parser") as parser:
            committed = await parser.propose("demo", 0, {"requested_action": {"action": "none"}})
        assert committed.version == 1
    finally:
        assert await stop(process) == 0

    assert (home / "ca" / "ca.key").exists()
    assert not (home / "certs" / "ca.key").exists()  # the CA key never sits beside the certs
    assert (home / "keys" / "hmac-keyring.json").stat().st_mode & 0o077 == 0

    process = await start_run(home, port)
    try:
        async with connect(home, port, "node-planner") as planner:
            view = await planner.get_view("demo")
        assert view.version == 1
        assert view.state == {"requested_action": {"action": "none"}, "authority": {"tenant": "t"}}
    finally:
        assert await stop(process) == 0
