"""The Prometheus scrape endpoint (ZTATE_METRICS_LISTEN), scraped over real HTTP after
real commits: the commit counter is there, labelled by decision only; no thread id, no
state value; any other path is 404 (docs/operations.md, "Metrics")."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable

import pytest

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from ztate.services.runtime.config import Settings
from ztate.services.runtime.scrape import MAX_CONNECTIONS
from ztate.transition_service.app import start


def scrape(url: str, method: str = "GET") -> tuple[int, str, str]:
    assert url.startswith("http://127.0.0.1:")
    request = urllib.request.Request(url, method=method)  # noqa: S310 (checked above)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers["Content-Type"] or "", ""


def sample(body: str, name: str, labels: str) -> float:
    found = re.search(rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", body, re.M)
    assert found is not None, body
    return float(found[1])


async def test_the_scrape_endpoint_counts_commits_and_names_no_thread(
    settings: Settings, database_dsn: str, pki: Pki
) -> None:
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}),
        dsn=database_dsn,
    )
    try:
        assert running.telemetry.metrics_port is not None
        base = f"http://127.0.0.1:{running.telemetry.metrics_port}"
        target = f"localhost:{running.port}"
        thread_id = new_thread_id()
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        async with client(target, pki.node("input-parser")) as worker:
            await worker.propose(thread_id, 0, {"requested_action": act("one")})
            await worker.propose(thread_id, 1, {"requested_action": act("two")})
        status, kind, body = await asyncio.to_thread(scrape, f"{base}/metrics")
        assert status == 200
        assert kind.startswith("text/plain; version=")
        assert sample(body, "ztate_proposals_total", 'ztate_decision="committed"') == 2.0
        assert "ztate_commit_duration_seconds_bucket" in body
        assert "ztate_db_pool_connections" in body
        assert thread_id not in body
        assert "spiffe://" not in body
        assert INITIAL["raw_text"] not in body
        assert (await asyncio.to_thread(scrape, f"{base}/"))[0] == 404
        assert (await asyncio.to_thread(scrape, f"{base}/metrics/../x"))[0] == 404
        assert (await asyncio.to_thread(scrape, f"{base}/metrics", "POST"))[0] == 501
    finally:
        await running.stop(grace=1.0)
    with pytest.raises(urllib.error.URLError, match="Connection refused"):  # stopped with it
        await asyncio.to_thread(scrape, f"{base}/metrics")


def test_a_listen_address_that_is_not_host_port_is_refused(settings: Settings) -> None:
    for bad in ("9464", ":9464", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="is not host:port"):
            Settings(**{**settings.model_dump(), "metrics_listen": bad})


async def test_connections_beyond_the_bound_are_closed_and_the_endpoint_recovers(
    settings: Settings, database_dsn: str
) -> None:
    """Idle connections cannot pile up threads: beyond MAX_CONNECTIONS a connection is
    closed on arrival, and scraping works again once they go."""
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}),
        dsn=database_dsn,
    )
    try:
        port = running.telemetry.metrics_port
        assert port is not None
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
        try:
            # each idle connection holds a slot once accepted: wait until one is refused
            def refused() -> bool:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
                    extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                    try:
                        return extra.recv(1) == b""
                    except ConnectionResetError:
                        return True

            assert await until(lambda: asyncio.to_thread(refused))
        finally:
            for connection in idle:
                connection.close()
        base = f"http://127.0.0.1:{port}/metrics"

        async def scraped() -> bool:
            try:
                return (await asyncio.to_thread(scrape, base))[0] == 200
            except OSError:
                return False

        assert await until(scraped)
    finally:
        await running.stop(grace=1.0)


async def until(check: Callable[[], Awaitable[bool]], within: float = 10.0) -> bool:
    """``check`` until it holds, for at most ``within`` seconds (a condition with a deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await check():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
