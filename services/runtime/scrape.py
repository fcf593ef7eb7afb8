"""The Prometheus scrape endpoint: ``GET /metrics`` and nothing else, opt-in.

Set ``ZTATE_METRICS_LISTEN=host:port`` (the approval service also reads
``ZTATE_APPROVAL_METRICS_LISTEN`` first) and the service's metrics, the same
instruments the OTLP exporter sends (``ztate.services.runtime.telemetry``), are read by
OpenTelemetry's Prometheus exporter into a registry of this service's own (not
``prometheus_client``'s process-wide one) and served here in the Prometheus text format.

What it shows is what the metrics hold: counts and durations labelled by decision,
refusal reason, pool name and check, never a thread id, a caller, a state value or a
secret; so the label sets are bounded by the code, not by traffic. It is plain HTTP
without authentication, as scrapers expect: listen on an address only the scraper
reaches (a pod's port, 127.0.0.1 behind a sidecar). Any other path is 404, any other
method 501; nothing about a request is logged (a path is the caller's text); a
connection idle for ``TIMEOUT_SECONDS`` is closed, and at most ``MAX_CONNECTIONS``
are served at once (more are closed on arrival).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ztate.services.runtime.config import parse_listen

PATH = "/metrics"
TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 8


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Scrape(BaseHTTPRequestHandler):
        timeout = TIMEOUT_SECONDS
        server_version = "ztate"
        sys_version = ""

        def do_GET(self) -> None:  # the name http.server dispatches to
            if self.path.partition("?")[0] != PATH:
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
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
    """``GET /metrics`` of ``registry`` on ``listen``, served by a thread of its own."""

    def __init__(self, listen: str, registry: CollectorRegistry) -> None:
        host, port = parse_listen(listen)
        kind = _Server6 if ":" in host else _Server
        self._server = kind((host, port), _handler(registry))  # binds now: fails at start-up
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
