"""The kubelet's probes over plain HTTP on the metrics endpoint (ZTATE_METRICS_LISTEN):
``GET /readyz`` is the service's grpc.health.v1 status, ``GET /livez`` whether its event
loop still runs, asked over real HTTP of a real service on real Postgres
(docs/operations.md, "Health over HTTP")."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from tests.integration.test_metrics_scrape import scrape
from ztate.services.runtime.config import Settings
from ztate.services.runtime.scrape import LIVE_TIMEOUT_SECONDS, ScrapeEndpoint
from ztate.transition_service.app import start


def get(url: str) -> tuple[int, str]:
    """Status and body of ``GET url``; every probe answer is short plain text."""
    assert url.startswith("http://127.0.0.1:")
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 (checked above)
            status, kind, body = reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as refused:
        status, kind, body = refused.code, refused.headers["Content-Type"], refused.read()
    assert kind == "text/plain; charset=utf-8"
    return status, body.decode()


async def test_readyz_follows_the_health_status_and_livez_stays_live_while_not_serving(
    settings: Settings, database_dsn: str
) -> None:
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}),
        dsn=database_dsn,
    )
    try:
        base = f"http://127.0.0.1:{running.telemetry.metrics_port}"
        assert await asyncio.to_thread(get, f"{base}/readyz") == (200, "ok")
        assert await asyncio.to_thread(get, f"{base}/livez") == (200, "live")
        # what DatabaseHealth reports after two failed pings (test_database_health.py):
        # the watchdog is stopped first so that its next good ping cannot undo it
        await running.database_health.stop()
        await running.health.set_serving(False)
        assert await asyncio.to_thread(get, f"{base}/readyz") == (503, "not serving")
        # the database being down is no reason to restart: still live
        assert await asyncio.to_thread(get, f"{base}/livez") == (200, "live")
        await running.health.set_serving(True)
        assert await asyncio.to_thread(get, f"{base}/readyz") == (200, "ok")
        # a graceful shutdown takes the replica out of its Service at once
        await running.health.enter_graceful_shutdown()
        assert await asyncio.to_thread(get, f"{base}/readyz") == (503, "not serving")
        assert await asyncio.to_thread(get, f"{base}/livez") == (200, "live")
        assert (await asyncio.to_thread(scrape, f"{base}/readyz/x"))[0] == 404
        assert (await asyncio.to_thread(scrape, f"{base}/healthz"))[0] == 404
    finally:
        await running.stop(grace=1.0)


async def test_livez_is_503_while_the_event_loop_is_blocked_and_200_once_released(
    settings: Settings, database_dsn: str
) -> None:
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}),
        dsn=database_dsn,
    )
    try:
        url = f"http://127.0.0.1:{running.telemetry.metrics_port}/livez"
        answers: list[tuple[int, str]] = []
        answered = threading.Event()

        def probe() -> None:
            answers.append(get(url))
            answered.set()

        prober = threading.Thread(target=probe)
        prober.start()
        # the loop (the service's: this test runs on it) waits synchronously for the
        # answer: it runs no callback until the probe has given up on it
        assert answered.wait(10 * LIVE_TIMEOUT_SECONDS)
        prober.join()
        assert answers == [(503, "not live")]
        assert await asyncio.to_thread(get, url) == (200, "live")  # released: live again
        assert running.health.serving_now()  # blocked is not unhealthy: readiness unchanged
    finally:
        await running.stop(grace=1.0)


def test_before_a_service_attaches_its_health_and_loop_both_probes_are_503() -> None:
    endpoint = ScrapeEndpoint("127.0.0.1:0", CollectorRegistry())
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        assert get(f"{base}/readyz") == (503, "not serving")
        assert get(f"{base}/livez") == (503, "not live")
    finally:
        endpoint.stop()
