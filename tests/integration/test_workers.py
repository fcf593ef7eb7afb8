"""``ztate serve --workers N``: N processes of the service share one port, and only they.

Real processes on the session's database: a supervisor and its workers, each a whole
service binding the port with SO_REUSEPORT. The port stays the service's own: a second
service on it, with workers or without, is refused (exit 2, nothing served), as the
single-process service's refusal is tested in test_start_failures.py. A supervisor killed
with SIGKILL takes its workers with it, so the port is free again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.error
from pathlib import Path

import pytest

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from tests.integration.test_http_probes import get
from tests.integration.test_metrics_scrape import scrape
from tests.integration.test_run_command import free_port
from tests.integration.test_scale_out import ZTATE, Replica, replica_env, wait_serving
from ztate.transition_service.cli import MAX_WORKERS
from ztate.transition_service.workers import metrics_listens, port_is_free

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


@pytest.mark.parametrize("workers", ["-1", "65", "100000", "9" * 40, "two"])
async def test_a_worker_count_out_of_bounds_is_a_usage_error(workers: str) -> None:
    """0 (one per core) to MAX_WORKERS; anything else is exit 2 naming the bound, before
    any configuration is read or a worker started (without DATABASE_URL here, so that a
    count that got through would stop on that instead, with another message)."""
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "serve",
        f"--workers={workers}",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), DEADLINE)
    assert process.returncode == 2
    said = stderr.decode()
    expected = "'two' is not a whole number" if workers == "two" else f"must be 0 to {MAX_WORKERS}"
    assert f"argument --workers: {expected}" in said, said


def probe(url: str) -> tuple[int, str] | None:
    """``GET url`` (status, body), or None while nothing listens there."""
    try:
        return get(url)
    except urllib.error.URLError as failed:
        if isinstance(failed, urllib.error.HTTPError):
            raise
        return None


def two_free_ports() -> int:
    """A port that is free, with the next one free too."""
    while True:
        port = free_port()
        if port < 65535 and port_is_free(f"127.0.0.1:{port + 1}"):
            return port


async def test_each_worker_answers_scrapes_and_probes_on_a_port_of_its_own(
    database_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path: Path,
    service: object,
) -> None:
    """With ZTATE_METRICS_LISTEN, worker k of ``--workers N`` serves its metrics and the
    kubelet's probes on the configured port + k: each process has its own counters and
    health. (All on one port, the second worker could not bind it and the whole group
    stopped.)"""
    env = replica_env(database_dsn, pki, keyring_file, policy_dir, tmp_path)
    port, metrics = free_port(), two_free_ports()
    group = await serve(
        dict(env, ZTATE_METRICS_LISTEN=f"127.0.0.1:{metrics}"), port, "--workers", str(WORKERS)
    )
    try:
        await wait_serving(group, pki)
        for number in range(WORKERS):
            base = f"http://127.0.0.1:{metrics + number}"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while (ready := await asyncio.to_thread(probe, f"{base}/readyz")) != (200, "ok"):
                assert group.process.returncode is None, "the group stopped"
                assert loop.time() < deadline, (number, ready)
                await asyncio.sleep(0.05)  # the polling interval of a deadline-bounded wait
            assert await asyncio.to_thread(get, f"{base}/livez") == (200, "live")
            status, _, body = await asyncio.to_thread(scrape, f"{base}/metrics")
            assert status == 200
            assert "# TYPE" in body
    finally:
        if group.process.returncode is None:
            group.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(group.process.wait(), DEADLINE)
    assert group.process.stderr is not None
    stderr = (await group.process.stderr.read()).decode(errors="replace")
    for number in range(WORKERS):
        assert f"worker {number}: metrics and probes on 127.0.0.1:{metrics + number}" in stderr


def test_worker_metrics_ports_are_counted_from_the_configured_one() -> None:
    assert metrics_listens(None, 2) == [None, None]
    assert metrics_listens("127.0.0.1:9464", 3) == [
        "127.0.0.1:9464",
        "127.0.0.1:9465",
        "127.0.0.1:9466",
    ]
    assert metrics_listens("[::1]:9464", 2) == ["[::1]:9464", "[::1]:9465"]
    assert metrics_listens("0.0.0.0:0", 2) == ["0.0.0.0:0", "0.0.0.0:0"]  # each picks one
    with pytest.raises(ValueError, match="pass 65535"):
        metrics_listens("127.0.0.1:65535", 2)


async def test_each_worker_runs_with_the_supervisors_flags(
    database_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path: Path,
    service: object,
) -> None:
    """``--log-level warning`` reaches the workers: none logs its informational start-up
    line (they ran with the default, info, when only the supervisor had the flag)."""
    env = replica_env(database_dsn, pki, keyring_file, policy_dir, tmp_path)
    env.pop("ZTATE_LOG_LEVEL", None)
    port = free_port()
    group = await serve(env, port, "--workers", str(WORKERS), "--log-level", "warning")
    try:
        await wait_serving(group, pki)
        await until(lambda: len(children(group.process.pid)) == WORKERS, "workers")
    finally:
        if group.process.returncode is None:
            group.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(group.process.wait(), DEADLINE)
    assert group.process.stderr is not None
    stderr = (await group.process.stderr.read()).decode(errors="replace")
    assert "transition service listening" not in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("listen", ["foo", "127.0.0.1:abc", "127.0.0.1:99999"])
async def test_a_malformed_listen_address_is_refused_at_start(listen: str, tmp_path: Path) -> None:
    """ZTATE_LISTEN is checked with the settings: one message naming it, exit 2, never a
    traceback (``serve --workers`` split it by hand and raised)."""
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "serve",
        "--workers",
        "2",
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")},
            "ZTATE_HOME": str(tmp_path),
            "ZTATE_LISTEN": listen,
            "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        },
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), DEADLINE)
    assert process.returncode == 2
    text = stderr.decode(errors="replace")
    assert "Traceback" not in text
    assert "listen" in text.lower()
