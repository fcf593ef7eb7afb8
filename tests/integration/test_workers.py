"""``ztate serve --workers N``: N processes of the service share one port, and only they.

Real processes on the session's database: a supervisor and its workers, each a whole
service binding the port with SO_REUSEPORT. The port stays the service's own: a second
service on it, with workers or without, is refused (exit 2, nothing served), as the
single-process service's refusal is tested in test_start_failures.py. A supervisor killed
with SIGKILL takes its workers with it, so the port is free again.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from tests.integration.test_run_command import free_port
from tests.integration.test_scale_out import ZTATE, Replica, replica_env, wait_serving
from ztate.transition_service.workers import port_is_free

WORKERS = 2
DEADLINE = 30.0


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


async def serve(env: dict[str, str], port: int, *extra: str) -> Replica:
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "serve",
        *extra,
        env=dict(env, ZTATE_LISTEN=f"127.0.0.1:{port}"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    return Replica(port, process)


async def until(condition: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)  # the polling interval of a deadline-bounded wait


async def test_workers_share_the_port_and_refuse_a_second_service(
    database_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path: Path,
    service: object,
) -> None:
    env = replica_env(database_dsn, pki, keyring_file, policy_dir, tmp_path)
    port = free_port()
    group = await serve(env, port, "--workers", str(WORKERS))
    try:
        await wait_serving(group, pki)
        await until(lambda: len(children(group.process.pid)) == WORKERS, "workers")
        # each worker is serving on the one port: proposals commit through it
        thread_id = new_thread_id()
        async with client(f"localhost:{port}", pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        async with client(f"localhost:{port}", pki.node("input-parser")) as parser:
            committed = await parser.propose(thread_id, 0, {"requested_action": act("w")})
        assert committed.version == 1

        for extra in (("--workers", str(WORKERS)), ()):
            second = await serve(env, port, *extra)
            code = await asyncio.wait_for(second.process.wait(), DEADLINE)
            assert second.process.stderr is not None
            stderr = (await second.process.stderr.read()).decode(errors="replace")
            assert code != 0, extra
            if extra:
                assert f"127.0.0.1:{port} is in use" in stderr
        assert group.process.returncode is None  # the first service serves on
    finally:
        workers = children(group.process.pid)
        if group.process.returncode is None:
            group.process.send_signal(signal.SIGKILL)  # a crash of the supervisor
        await asyncio.wait_for(group.process.wait(), DEADLINE)
    # the workers die with their supervisor, and the port is free again
    await until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), "orphans")
    await until(lambda: port_is_free(f"127.0.0.1:{port}"), "the port freed")


@pytest.mark.parametrize("workers", ["-1"])
async def test_a_negative_worker_count_is_a_usage_error(workers: str) -> None:
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "serve",
        "--workers",
        workers,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert await asyncio.wait_for(process.wait(), DEADLINE) == 2
