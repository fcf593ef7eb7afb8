"""Telling reviewers that a review is waiting: a pluggable notifier and a signed webhook.

The approval service must never block a reviewer's call, or lose a decision, because
a chat bridge or pager is slow or down. So ``Notifier.notify`` only schedules a
delivery and never raises for delivery failures: a notification is a hint to look
at the queue, not the record. The record is the approval service's own database.

``WebhookNotifier`` POSTs the RFC 8785 canonical JSON of::

    {"delivery_id": "<kind>:<digest>", "digest": "<64 hex>", "kind": "review.opened",
     "occurred_at": "2025-01-02T03:04:05Z", "risk_rules": ["..."], "thread_id": "..."}

with the headers ``Content-Type: application/json``, ``X-Ztate-Event: <kind>``,
``X-Ztate-Delivery: <delivery_id>``, ``X-Ztate-Timestamp: <unix seconds>`` and
``X-Ztate-Signature: sha256=<hex>``. The delivery id is the same on every attempt
and after a restart, so a receiver de-duplicates on it: deliveries are at least
once, and idempotent at a receiver that remembers the ids it has handled.

Verifying a delivery (what ``verify_signature`` does; any language can do it)::

    1. Read the raw request body bytes; do not parse and re-serialise them.
    2. t = the X-Ztate-Timestamp header (decimal unix seconds). Refuse the delivery
       if |now - t| > 300 seconds: a captured request cannot be replayed later.
    3. expected = "sha256=" + hex(HMAC-SHA256(secret, t + "." + body))
    4. Compare expected with X-Ztate-Signature in constant time
       (hmac.compare_digest, crypto.timingSafeEqual, subtle.ConstantTimeCompare).
    5. Only then parse the body, and skip it if its delivery_id was seen before.

The timestamp (and so the signature) is fresh on every attempt, so a retry after a
long backoff still passes the freshness check; the body is byte-identical.

Retries: connection errors, timeouts, malformed responses, HTTP 429 and 5xx, with
exponential backoff and full jitter, up to ``max_attempts``. 2xx is delivered. Any
other status is final: 4xx means the receiver refused this request, and a redirect
is not followed, since it would send a signed payload somewhere not configured.

Logs name the delivery id, the attempt and the status, and the receiver only as
scheme, host and port: never the secret, the signature, the body, or the URL's path
and query (chat webhook URLs often carry a token there). HTTP is a minimal
HTTP/1.1 client over asyncio streams, so a hung receiver is cancelled cleanly.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import re
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Protocol
from urllib.parse import urlsplit

from ztate.contract.canonical import canonical_bytes

log = logging.getLogger("ztate.approval.notifier")

EVENT_KINDS: Final = frozenset({"review.opened", "review.decided", "review.expired"})
DIGEST = re.compile(r"[0-9a-f]{64}")
SIGNATURE_PREFIX: Final = "sha256="
MIN_SECRET_BYTES: Final = 32
DEFAULT_TOLERANCE: Final = 300
# Deliveries waiting for a connection slot or a retry; beyond this new ones are
# dropped (and logged), so a dead receiver cannot grow the service's memory.
MAX_PENDING: Final = 1024

_USER_AGENT: Final = "ztate-notifier/1"
_MAX_HEADER_LINES: Final = 100
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_SIGNATURE = re.compile(r"sha256=[0-9a-f]{64}")


@dataclass(frozen=True)
class ReviewEvent:
    """Something a reviewer should hear about, keyed by the transition digest."""

    kind: str
    digest: str
    thread_id: str
    risk_rules: tuple[str, ...]
    occurred_at: datetime

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {sorted(EVENT_KINDS)}, not {self.kind!r}")
        if not DIGEST.fullmatch(self.digest):
            raise ValueError("event digest must be 64 lower-case hex characters")
        if self.occurred_at.utcoffset() is None:
            raise ValueError("event occurred_at must be timezone-aware (UTC)")

    @property
    def delivery_id(self) -> str:
        """Stable across retries and restarts: the receiver's idempotency key."""
        return f"{self.kind}:{self.digest}"

    def body(self) -> bytes:
        """The canonical JSON the webhook carries."""
        return canonical_bytes(
            {
                "kind": self.kind,
                "digest": self.digest,
                "thread_id": self.thread_id,
                "risk_rules": list(self.risk_rules),
                "occurred_at": rfc3339(self.occurred_at),
                "delivery_id": self.delivery_id,
            }
        )


def rfc3339(moment: datetime) -> str:
    """``moment`` in UTC with a ``Z``; fractional seconds only when it has them."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


class Notifier(Protocol):
    """How the approval service tells reviewers about reviews."""

    async def notify(self, event: ReviewEvent) -> None:
        """Schedule a notification; never raises for delivery failures."""
        ...

    async def close(self) -> None:
        """Finish or abandon what is in flight; later notifications are dropped."""
        ...


class NullNotifier:
    """Tells nobody: the default when no webhook is configured."""

    async def notify(self, event: ReviewEvent) -> None:
        return None

    async def close(self) -> None:
        return None


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """The ``X-Ztate-Signature`` value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, timestamp.encode("ascii") + b"." + body, hashlib.sha256)
    return SIGNATURE_PREFIX + mac.hexdigest()


def verify_signature(
    secret: bytes,
    timestamp: str,
    body: bytes,
    header: str,
    *,
    now: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> bool:
    """Whether ``header`` signs ``body`` at ``timestamp``, within ``tolerance`` of ``now``.

    ``timestamp`` and ``header`` are the raw ``X-Ztate-Timestamp`` and
    ``X-Ztate-Signature`` values, ``now`` is unix seconds. Anything malformed is
    simply ``False``; the comparison is constant-time.
    """
    if not _TIMESTAMP.fullmatch(timestamp) or abs(now - int(timestamp)) > tolerance:
        return False
    if not _SIGNATURE.fullmatch(header):
        return False
    return hmac.compare_digest(sign(secret, timestamp, body).encode(), header.encode())


@dataclass(frozen=True)
class _Endpoint:
    https: bool
    host: str
    port: int
    host_header: str
    target: str

    @property
    def display(self) -> str:
        """Safe to log: no path or query, which may hold a token."""
        return f"{'https' if self.https else 'http'}://{self.host_header}"


def _parse_url(url: str) -> _Endpoint:
    """The parts of a webhook URL; errors never echo it, as it may hold a token."""
    if not url.isascii() or any(ch <= " " or ch == "\x7f" for ch in url):
        raise ValueError(
            "webhook URL must be ASCII without spaces or control characters "
            "(percent-encode the path, use the punycode form of the host)"
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"webhook URL must use http or https, not {scheme or 'no scheme'!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("webhook URL must not carry credentials; the HMAC secret authenticates")
    if not parts.hostname:
        raise ValueError("webhook URL has no host")
    try:
        explicit_port = parts.port
    except ValueError:
        raise ValueError("webhook URL has an invalid port") from None
    https = scheme == "https"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Endpoint(
        https=https,
        host=parts.hostname,
        port=explicit_port or (443 if https else 80),
        host_header=parts.netloc,
        target=target,
    )


class _BadResponse(Exception):
    """The receiver's answer was not HTTP/1.x; treated like a dropped connection."""


async def _read_status(reader: asyncio.StreamReader) -> int:
    """The final status code, skipping interim (1xx) responses and all headers."""
    while True:
        line = await reader.readuntil(b"\r\n")
        fields = line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise _BadResponse("not an HTTP/1.x status line")
        status = int(fields[1])
        if not 100 <= status <= 599:
            raise _BadResponse("status code out of range")
        for _ in range(_MAX_HEADER_LINES):
            if await reader.readuntil(b"\r\n") == b"\r\n":
                break
        else:
            raise _BadResponse("too many header lines")
        if status >= 200:
            return status


# Worth another attempt: refused, reset or timed-out connections and TLS failures
# (OSError, TimeoutError), a receiver that hung up early (EOFError, from
# asyncio.IncompleteReadError), an oversized header line, or a non-HTTP answer.
_TRANSIENT: Final = (OSError, TimeoutError, EOFError, asyncio.LimitOverrunError, _BadResponse)


def _is_retryable(status: int) -> bool:
    return status == 429 or status >= 500


class WebhookNotifier:
    """Signed, idempotent HTTP webhook deliveries, in the background, with retries."""

    def __init__(
        self,
        url: str,
        secret: bytes,
        *,
        max_attempts: int = 6,
        first_backoff: float = 0.5,
        max_backoff: float = 30.0,
        timeout: float = 5.0,
        concurrency: int = 8,
        close_timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Check every setting now; nothing connects before the first ``notify``.

        ``timeout`` bounds each attempt (connect, send, response status);
        ``close_timeout`` bounds how long ``close`` waits for in-flight deliveries;
        ``ssl_context`` replaces the system trust store for https (a private CA).
        """
        self._endpoint = _parse_url(url)
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"webhook secret must be at least {MIN_SECRET_BYTES} bytes")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if first_backoff < 0 or max_backoff < first_backoff:
            raise ValueError("backoffs must satisfy 0 <= first_backoff <= max_backoff")
        if timeout <= 0 or close_timeout < 0:
            raise ValueError("timeout must be positive and close_timeout not negative")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if ssl_context is not None and not self._endpoint.https:
            raise ValueError("ssl_context given for an http:// webhook URL")
        self._secret = secret
        self._max_attempts = max_attempts
        self._first_backoff = first_backoff
        self._max_backoff = max_backoff
        self._timeout = timeout
        self._close_timeout = close_timeout
        self._ssl: ssl.SSLContext | None = None
        if self._endpoint.https:
            self._ssl = ssl_context or ssl.create_default_context()
        self._slots = asyncio.Semaphore(concurrency)
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def __repr__(self) -> str:
        return f"WebhookNotifier({self._endpoint.display})"

    async def notify(self, event: ReviewEvent) -> None:
        """Schedule the delivery of ``event`` and return at once.

        A delivery of the same id still in flight is not duplicated.
        """
        delivery_id = event.delivery_id
        if self._closed:
            log.warning("webhook %s: notifier closed, dropped", delivery_id)
            return
        if delivery_id in self._pending:
            return
        if len(self._pending) >= MAX_PENDING:
            log.error("webhook %s: %d deliveries pending, dropped", delivery_id, MAX_PENDING)
            return
        task = asyncio.get_running_loop().create_task(
            self._deliver(event), name=f"webhook {delivery_id}"
        )
        self._pending[delivery_id] = task
        task.add_done_callback(lambda done: self._forget(delivery_id, done))

    def _forget(self, delivery_id: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(delivery_id) is task:
            del self._pending[delivery_id]

    async def close(self) -> None:
        """Wait up to ``close_timeout`` for in-flight deliveries, then cancel the rest."""
        self._closed = True
        tasks = set(self._pending.values())
        if not tasks:
            return
        _, unfinished = await asyncio.wait(tasks, timeout=self._close_timeout)
        if not unfinished:
            return
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        log.warning("webhook: abandoned %d undelivered notifications at close", len(unfinished))

    async def _deliver(self, event: ReviewEvent) -> None:
        delivery_id = event.delivery_id
        try:
            await self._attempts(event, delivery_id)
        except asyncio.CancelledError:
            log.warning("webhook %s: cancelled, not delivered", delivery_id)
            raise
        except Exception as unexpected:
            # A bug here must not surface as an unretrieved task exception.
            log.exception("webhook %s: delivery failed: %s", delivery_id, type(unexpected).__name__)

    async def _attempts(self, event: ReviewEvent, delivery_id: str) -> None:
        body = event.body()
        target = self._endpoint.display
        for attempt in range(1, self._max_attempts + 1):
            step = f"attempt {attempt}/{self._max_attempts} to {target}"
            try:
                async with self._slots:
                    status = await self._post(event.kind, delivery_id, body)
            except _TRANSIENT as failure:
                outcome = f"failed ({type(failure).__name__})"
            else:
                outcome = f"HTTP {status}"
                if 200 <= status < 300:
                    log.info("webhook %s: %s: %s, delivered", delivery_id, step, outcome)
                    return
                if not _is_retryable(status):
                    log.error("webhook %s: %s: %s, not retrying", delivery_id, step, outcome)
                    return
            if attempt == self._max_attempts:
                log.error("webhook %s: %s: %s, giving up", delivery_id, step, outcome)
                return
            delay = self._backoff(attempt)
            log.warning("webhook %s: %s: %s, retrying in %.2fs", delivery_id, step, outcome, delay)
            await asyncio.sleep(delay)

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max_backoff, first_backoff * 2^(attempt-1))]."""
        ceiling = min(self._max_backoff, self._first_backoff * 2.0 ** min(attempt - 1, 60))
        return random.uniform(0.0, ceiling)

    async def _post(self, kind: str, delivery_id: str, body: bytes) -> int:
        """One attempt: the final HTTP status, or an exception on transport failure."""
        endpoint = self._endpoint
        timestamp = str(int(time.time()))
        head = (
            f"POST {endpoint.target} HTTP/1.1\r\n"
            f"Host: {endpoint.host_header}\r\n"
            f"User-Agent: {_USER_AGENT}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n"
            f"X-Ztate-Event: {kind}\r\n"
            f"X-Ztate-Delivery: {delivery_id}\r\n"
            f"X-Ztate-Timestamp: {timestamp}\r\n"
            f"X-Ztate-Signature: {sign(self._secret, timestamp, body)}\r\n"
            "\r\n"
        )
        async with asyncio.timeout(self._timeout):
            reader, writer = await asyncio.open_connection(
                endpoint.host,
                endpoint.port,
                ssl=self._ssl,
                server_hostname=endpoint.host if self._ssl is not None else None,
            )
            try:
                writer.write(head.encode("ascii") + body)
                await writer.drain()
                return await _read_status(reader)
            finally:
                writer.close()
