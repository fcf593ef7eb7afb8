"""`ztate run` on a fresh home: dev certificates, keys, embedded Postgres, and serving;
a second run reuses them and finds the data of the first."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.harness import USER
from ztate.worker_sdk import AwaitingApproval, ZtateClient

START_TIMEOUT_SECONDS = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def start_run(home: Path, port: int, approval_port: int) -> asyncio.subprocess.Process:
    """``ztate run`` as a new user starts it: quiet (the banner on stdout, nothing on
    stderr), so readiness comes from ``ztate health`` of both services, not from logs."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL"}}
    env.update(
        ZTATE_HOME=str(home),
        ZTATE_LISTEN=f"127.0.0.1:{port}",
        ZTATE_APPROVAL_LISTEN=f"127.0.0.1:{approval_port}",
    )
    ztate = Path(sys.executable).with_name("ztate")
    process = await asyncio.create_subprocess_exec(
        str(ztate), "run", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )

    async def serving(*flags: str) -> bool:
        probe = await asyncio.create_subprocess_exec(
            str(ztate), "health", *flags, "--timeout", "2", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        return await asyncio.wait_for(probe.wait(), 30) == 0

    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_SECONDS
    while not (await serving() and await serving("--approval")):
        assert process.returncode is None, "ztate run exited before it served"
        assert loop.time() < deadline, "ztate run never served"
        await asyncio.sleep(0.2)  # polling both services' health, with a deadline
    return process


async def stop(process: asyncio.subprocess.Process) -> int:
    """SIGTERM; the exit status, once stderr (empty: the first run is quiet) is read."""
    process.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert stderr == b"", stderr.decode(errors="replace")
    assert process.returncode is not None
    return process.returncode


def connect(home: Path, port: int, identity: str) -> ZtateClient:
    certs = home / "certs"
    return ZtateClient.from_files(
        f"localhost:{port}",
        cert=certs / f"{identity}.crt",
        key=certs / f"{identity}.key",
        ca=certs / "ca.crt",
    )


async def review_digest(home: Path, approval_port: int, thread_id: str) -> str:
    """The digest of the thread's open review, as a reviewer finds it (``ztate approvals
    list``) once the outbox has delivered it: the proposing node is not told digests."""
    env = dict(os.environ, ZTATE_HOME=str(home))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("ztate")),
            *("approvals", "list", "--json", "--thread", thread_id, "--reviewer", "alice"),
            *("--target", f"localhost:{approval_port}"),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, stderr.decode()
        reviews = [json.loads(line) for line in stdout.decode().splitlines()]
        if reviews:
            digest: str = reviews[0]["digest"]
            return digest
        assert loop.time() < deadline, "the review never reached the approval service"
        await asyncio.sleep(0.1)  # polling a real condition, with a deadline


async def approve_with_the_cli(home: Path, approval_port: int, digest: str) -> str:
    env = dict(os.environ, ZTATE_HOME=str(home))
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        "approvals",
        "approve",
        digest,
        "--reviewer",
        "alice",
        "--target",
        f"localhost:{approval_port}",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    return stdout.decode()


async def test_run_sets_up_serves_and_keeps_data(tmp_path: Path) -> None:
    home, port, approval_port = tmp_path / "ztate-home", free_port(), free_port()
    process = await start_run(home, port, approval_port)
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
        # both services run: a risky change is parked, approved by a reviewer, committed
        async with connect(home, port, "node-planner") as planner:
            with pytest.raises(AwaitingApproval) as parked:
                await planner.propose("demo", 1, {"target_user_id": USER})
            digest = await review_digest(home, approval_port, "demo")
            said = await approve_with_the_cli(home, approval_port, digest)
            assert "approved" in said
            outcome = await planner.wait_for_outcome(parked.value, within=30)
        assert outcome.status == "committed"
    finally:
        assert await stop(process) == 0

    assert (home / "ca" / "ca.key").exists()
    assert not (home / "certs" / "ca.key").exists()  # the CA key never sits beside the certs
    assert (home / "keys" / "hmac-keyring.json").stat().st_mode & 0o077 == 0

    process = await start_run(home, port, approval_port)
    try:
        async with connect(home, port, "node-planner") as planner:
            view = await planner.get_view("demo")
        assert view.version == 2
        assert view.state == {
            "requested_action": {"action": "none"},
            "authority": {"tenant": "t"},
            "target_user_id": USER,
        }
    finally:
        assert await stop(process) == 0


def descendants(pid: int) -> set[int]:
    """The processes under ``pid`` now, from /proc (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
async def test_run_stops_cleanly_and_a_second_run_says_so(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    """From a fresh home: serving; a second ``ztate run`` on the same ports is one line
    and exit 2, and the first one still serves; SIGINT or SIGTERM stops it with exit 0,
    nothing on stderr, and neither its approval process nor its Postgres left behind."""
    home, port, approval_port = tmp_path / "ztate-home", free_port(), free_port()
    process = await start_run(home, port, approval_port)
    try:
        children = descendants(process.pid)
        assert children, "ztate run started no approval process"
        postgres = int((home / "pg" / "postmaster.pid").read_text().split()[0])
        assert alive(postgres)

        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update(
            ZTATE_HOME=str(home),
            ZTATE_LISTEN=f"127.0.0.1:{port}",
            ZTATE_APPROVAL_LISTEN=f"127.0.0.1:{approval_port}",
        )
        second = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("ztate")), "run", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(second.communicate(), 60)
        assert (second.returncode, out) == (2, b""), err.decode(errors="replace")
        assert err.decode().splitlines() == [f"ztate: cannot start: 127.0.0.1:{port} is in use"]
        assert alive(postgres)  # the first run's database is untouched
        async with connect(home, port, "operator-admin") as operator:
            await operator.create_thread("still", {"authority": {"tenant": "t"}})
    finally:
        process.send_signal(stop_signal)
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode(errors="replace")
    assert stderr == b"", stderr.decode(errors="replace")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while left := [pid for pid in (*children, postgres) if alive(pid)]:
        assert loop.time() < deadline, f"left running after ztate run stopped: {left}"
        await asyncio.sleep(0.1)  # polling /proc for a condition, with a deadline
