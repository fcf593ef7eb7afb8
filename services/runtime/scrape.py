"""The Prometheus scrape endpoint and the probes: ``GET /metrics``, ``/readyz``, ``/livez``.

Set ``ZTATE_METRICS_LISTEN=host:port`` (the approval service also reads
``ZTATE_APPROVAL_METRICS_LISTEN`` first) and the service's metrics, the same
instruments the OTLP exporter sends (``ztate.services.runtime.telemetry``), are read by
OpenTelemetry's Prometheus exporter into a registry of this service's own (not
``prometheus_client``'s process-wide one) and served here in the Prometheus text format.

What it shows is what the metrics hold: counts and durations labelled by decision,
refusal reason, pool name and check, never a thread id, a caller, a state value or a
secret; so the label sets are bounded by the code, not by traffic. It is plain HTTP
without authentication, as scrapers expect: listen on an address only the scraper
reaches (a pod's port, 127.0.0.1 behind a sidecar).

The same endpoint answers the kubelet's ``httpGet`` probes, which cost the pod only
this thread's work (an exec probe of ``ztate health`` is a Python start-up and an mTLS
handshake, about 0.45 s of CPU each; docs/operations.md, "Health over HTTP"):

- ``GET /readyz``: 200 ``ok`` while the service's ``grpc.health.v1`` status of the
  whole server (``""``) is SERVING, 503 ``not serving`` otherwise; read from the
  status dict the event loop writes (one dict read, atomic under the GIL).
- ``GET /livez``: 200 ``live`` while the service's event loop still runs callbacks:
  a no-op is scheduled with ``call_soon_threadsafe`` and must run within
  ``LIVE_TIMEOUT_SECONDS``; 503 ``not live`` for a blocked, wedged, stopped or closed
  loop. NOT_SERVING (the database is down) is still live: a restart would not help.

Until a service ``attach``-es its health and loop (both services do so as they start
the endpoint, before the gRPC server starts), ``/readyz`` and ``/livez`` are 503.
The bodies are fixed short strings. Any other path is 404, any other
method 501; nothing about a request is logged (a path is the caller's text); a
connection idle for ``TIMEOUT_SECONDS`` is closed, and at most ``MAX_CONNECTIONS``
are served at once (more are closed on arrival).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ztate.services.runtime.config import parse_listen

PATH = "/metrics"
READY_PATH = "/readyz"
LIVE_PATH = "/livez"
TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 8
LIVE_TIMEOUT_SECONDS = 1.0
"""How long ``/livez`` waits for the event loop to run its no-op."""

Serving = Callable[[], bool]
"""Whether the service reports SERVING now; called from the endpoint's threads, so it
must only read (``HealthReport.serving_now``)."""


class Probes:
    """What ``/readyz`` and ``/livez`` ask: the service's health and its event loop,
    attached once the service has them (until then both answer 503)."""

    def __init__(self) -> None:
        self._serving: Serving | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, serving: Serving, loop: asyncio.AbstractEventLoop) -> None:
        self._serving, self._loop = serving, loop

    def ready(self) -> bool:
        serving = self._serving
        return serving is not None and serving()

    def live(self, timeout: float = LIVE_TIMEOUT_SECONDS) -> bool:
        """True if the loop ran a no-op within ``timeout`` seconds (called off the loop)."""
        loop = self._loop
        if loop is None:
            return False
        ran = threading.Event()
        try:
            loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # the loop is closed
            return False
        return ran.wait(timeout)


def _handler(registry: CollectorRegistry, probes: Probes) -> type[BaseHTTPRequestHandler]:
    class Scrape(BaseHTTPRequestHandler):
        timeout = TIMEOUT_SECONDS
        server_version = "ztate"
        sys_version = ""

        def do_GET(self) -> None:  # the name http.server dispatches to
            path = self.path.partition("?")[0]
            if path == READY_PATH:
                self._plain(*((200, b"ok") if probes.ready() else (503, b"not serving")))
                return
            if path == LIVE_PATH:
                self._plain(*((200, b"live") if probes.live() else (503, b"not live")))
                return
            if path != PATH:
                self.send_error(404)
                return
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))

        def _plain(self, status: int, body: bytes) -> None:
            self._send(status, "text/plain; charset=utf-8", body)

        def _send(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # a request line is the caller's text: not logged

    return Scrape


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most ``MAX_CONNECTIONS`` at once: a connection
    beyond them is closed at once (a scraper makes one at a time)."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class ScrapeEndpoint:
    """``GET /metrics`` of ``registry``, ``/readyz`` and ``/livez`` on ``listen``, served
    by a thread of its own."""

    def __init__(self, listen: str, registry: CollectorRegistry) -> None:
        host, port = parse_listen(listen)
        kind = _Server6 if ":" in host else _Server
        self.probes = Probes()
        self._server = kind(
            (host, port), _handler(registry, self.probes)
        )  # binds now: fails at start-up
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="ztate-metrics", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, for port 0)."""
        return int(self._server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(TIMEOUT_SECONDS)
