"""The review notifier against a real HTTP server on 127.0.0.1.

The receiver is an asyncio HTTP/1.1 server that records every request and answers
from a script (a status, or misbehaviour: hang, reset, close, garbage, hold).
Tests synchronise on its arrival queue and release event, and count requests after
``close()``, which waits for in-flight deliveries, so the counts are exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

import pytest
import pytest_asyncio

from tests.harness import Pki
from ztate.approval_service.notifier import (
    Notifier,
    NullNotifier,
    ReviewEvent,
    WebhookNotifier,
    verify_signature,
)
from ztate.services.runtime.identity import Role

SECRET = b"webhook-secret-for-the-tests-0123456789"
DIGEST = "ab" * 32
LOGGER = "ztate.approval.notifier"
EVENT = ReviewEvent(
    kind="review.opened",
    digest=DIGEST,
    thread_id="thread-7",
    risk_rules=("admin-flag", "règle-€"),
    occurred_at=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
)
# RFC 8785: members sorted, no whitespace, non-ASCII as raw UTF-8.
EXPECTED_BODY = (
    b'{"delivery_id":"review.opened:' + DIGEST.encode() + b'",'
    b'"digest":"' + DIGEST.encode() + b'",'
    b'"kind":"review.opened",'
    b'"occurred_at":"2025-01-02T03:04:05Z",'
    b'"risk_rules":["admin-flag","r\xc3\xa8gle-\xe2\x82\xac"],'
    b'"thread_id":"thread-7"}'
)

# A scripted answer: an HTTP status, or one of the misbehaviours in Receiver._act.
Action = int | str


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


async def read_request(reader: asyncio.StreamReader) -> Request:
    method, target, _ = (await reader.readuntil(b"\r\n")).decode("ascii").split(" ", 2)
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("utf-8").partition(":")
        assert name.lower() not in headers, f"duplicate header {name}"
        headers[name.lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return Request(method, target, headers, body)


def response(status: int) -> bytes:
    return f"HTTP/1.1 {status} Scripted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()


class Receiver:
    """A real webhook receiver; answers 200 once its script runs out."""

    def __init__(self) -> None:
        self.script: deque[Action] = deque()
        self.requests: list[Request] = []
        self.arrivals: asyncio.Queue[Request] = asyncio.Queue()
        self.release = asyncio.Event()
        self.in_progress = 0
        self.max_in_progress = 0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()

    async def start(self, tls: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self.release.set()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            request = await read_request(reader)
            self.requests.append(request)
            self.in_progress += 1
            self.max_in_progress = max(self.max_in_progress, self.in_progress)
            self.arrivals.put_nowait(request)
            await self._act(self.script.popleft() if self.script else 200, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    async def _act(
        self, action: Action, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if action == "hang":  # never answer; wait for the client to give up
            await reader.read()
        elif action == "hold":  # answer 200 once the test sets `release`
            await self.release.wait()
        elif action == "reset":  # RST instead of an answer
            self.in_progress -= 1
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        elif action == "close":  # FIN instead of an answer
            self.in_progress -= 1
            return
        elif action == "garbage":
            self.in_progress -= 1
            writer.write(b"SSH-2.0-not-http\r\n\r\n")
            await writer.drain()
            return
        elif action == "early-hints":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n")
        # Counted out before the answer is written, so before the client can see it.
        self.in_progress -= 1
        writer.write(response(action if isinstance(action, int) else 200))
        await writer.drain()

    async def next_arrival(self) -> Request:
        return await asyncio.wait_for(self.arrivals.get(), 5.0)


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = Receiver()
    await server.start()
    yield server
    await server.stop()


Factory = Callable[..., WebhookNotifier]


@pytest_asyncio.fixture
async def webhook() -> AsyncIterator[Factory]:
    """Notifiers with tiny backoffs, all closed at teardown."""
    made: list[WebhookNotifier] = []

    def make(
        url: str,
        *,
        max_attempts: int = 6,
        timeout: float = 2.0,
        concurrency: int = 8,
        close_timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> WebhookNotifier:
        notifier = WebhookNotifier(
            url,
            SECRET,
            max_attempts=max_attempts,
            first_backoff=0.01,
            max_backoff=0.02,
            timeout=timeout,
            concurrency=concurrency,
            close_timeout=close_timeout,
            ssl_context=ssl_context,
        )
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        await notifier.close()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name == LOGGER]


def mac(secret: bytes, timestamp: str, body: bytes) -> str:
    """The documented recipe, written out independently of the module."""
    digest = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def signed(request: Request) -> bool:
    return verify_signature(
        SECRET,
        request.headers["x-ztate-timestamp"],
        request.body,
        request.headers["x-ztate-signature"],
        now=time.time(),
    )


def event(n: int = 0, kind: str = "review.opened") -> ReviewEvent:
    return ReviewEvent(
        kind=kind,
        digest=f"{n:064x}",
        thread_id=f"thread-{n}",
        risk_rules=("r",),
        occurred_at=datetime.now(UTC),
    )


async def test_delivery_is_canonical_json_with_signed_headers(
    receiver: Receiver, webhook: Factory
) -> None:
    notifier = webhook(receiver.url + "/hooks/ztate?tenant=a")
    await notifier.notify(EVENT)
    request = await receiver.next_arrival()
    await notifier.close()

    assert request.method == "POST"
    assert request.target == "/hooks/ztate?tenant=a"
    assert request.body == EXPECTED_BODY
    headers = request.headers
    assert headers["host"] == receiver.url.removeprefix("http://")
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(EXPECTED_BODY))
    assert headers["x-ztate-event"] == "review.opened"
    assert headers["x-ztate-delivery"] == f"review.opened:{DIGEST}"
    timestamp = headers["x-ztate-timestamp"]
    assert timestamp.isdigit()
    assert abs(int(timestamp) - time.time()) < 5
    assert headers["x-ztate-signature"] == mac(SECRET, timestamp, EXPECTED_BODY)
    assert signed(request)
    assert len(receiver.requests) == 1


async def test_signature_binds_secret_body_and_time(receiver: Receiver, webhook: Factory) -> None:
    notifier = webhook(receiver.url)
    await notifier.notify(EVENT)
    request = await receiver.next_arrival()
    await notifier.close()
    timestamp = request.headers["x-ztate-timestamp"]
    header = request.headers["x-ztate-signature"]
    sent = int(timestamp)

    assert verify_signature(SECRET, timestamp, request.body, header, now=sent)
    assert not verify_signature(
        b"another-secret-of-enough-length-000", timestamp, request.body, header, now=sent
    )
    assert not verify_signature(SECRET, timestamp, request.body + b" ", header, now=sent)
    assert not verify_signature(
        SECRET, timestamp, request.body.replace(b"7", b"8"), header, now=sent
    )
    assert not verify_signature(SECRET, str(sent + 1), request.body, header, now=sent)
    # Stale and future timestamps, at the edge of the tolerance.
    assert verify_signature(SECRET, timestamp, request.body, header, now=sent + 300)
    assert not verify_signature(SECRET, timestamp, request.body, header, now=sent + 301)
    assert not verify_signature(SECRET, timestamp, request.body, header, now=sent - 301)
    assert not verify_signature(
        SECRET, timestamp, request.body, header, now=sent + 31, tolerance=30
    )


@pytest.mark.parametrize(
    ("timestamp", "header"),
    [
        ("+1700000000", None),
        (" 1700000000", None),
        ("1700000000\n", None),
        ("1_700_000_000", None),
        ("", None),
        (None, "sha1=" + "0" * 40),
        (None, "SHA256={upper}"),
        (None, "{sig}\n"),
        (None, "{sig}0"),
        (None, "sha256=" + "é" * 64),
        (None, ""),
    ],
)
def test_malformed_signature_inputs_are_refused(timestamp: str | None, header: str | None) -> None:
    good_ts = "1700000000"
    body = b"{}"
    sig = mac(SECRET, good_ts, body)
    upper = sig.removeprefix("sha256=").upper()
    assert verify_signature(SECRET, good_ts, body, sig, now=1_700_000_000)
    ts = good_ts if timestamp is None else timestamp
    value = sig if header is None else header.format(sig=sig, upper=upper)
    assert not verify_signature(SECRET, ts, body, value, now=1_700_000_000)


@pytest.mark.parametrize("failure", [500, 502, 503, 429, "reset", "close", "garbage"])
async def test_transient_failure_is_retried(
    receiver: Receiver, webhook: Factory, failure: Action, logs: Callable[[], list[str]]
) -> None:
    receiver.script.extend([failure, 200])
    notifier = webhook(receiver.url)
    await notifier.notify(EVENT)
    await notifier.close()

    assert len(receiver.requests) == 2
    assert all(r.body == EXPECTED_BODY for r in receiver.requests)
    assert all(signed(r) for r in receiver.requests)
    assert any("attempt 2/6" in m and "delivered" in m for m in logs())


async def test_retries_keep_the_delivery_id(
    receiver: Receiver, webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    receiver.script.extend([500, 503, 429, "reset", 200])
    notifier = webhook(receiver.url)
    await notifier.notify(EVENT)
    await notifier.close()

    assert len(receiver.requests) == 5
    assert {r.headers["x-ztate-delivery"] for r in receiver.requests} == {f"review.opened:{DIGEST}"}
    assert {r.body for r in receiver.requests} == {EXPECTED_BODY}
    assert all(signed(r) for r in receiver.requests)
    messages = logs()
    for status in ("HTTP 500", "HTTP 503", "HTTP 429"):
        assert any(status in m and "retrying" in m for m in messages)
    assert any("attempt 5/6" in m and "HTTP 200, delivered" in m for m in messages)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422, 301, 302])
async def test_client_errors_and_redirects_are_final(
    receiver: Receiver, webhook: Factory, status: int, logs: Callable[[], list[str]]
) -> None:
    receiver.script.extend([status, 200])
    notifier = webhook(receiver.url)
    await notifier.notify(EVENT)
    await notifier.close()

    assert len(receiver.requests) == 1
    assert any(f"HTTP {status}, not retrying" in m for m in logs())


async def test_gives_up_after_max_attempts_without_raising(
    receiver: Receiver, webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    receiver.script.extend([500] * 10)
    notifier = webhook(receiver.url, max_attempts=4)
    await notifier.notify(EVENT)  # no exception, although nothing gets through
    await notifier.close()

    assert len(receiver.requests) == 4
    assert [m for m in logs() if "giving up" in m] == [
        f"webhook review.opened:{DIGEST}: attempt 4/4 to {receiver.url}: HTTP 500, giving up"
    ]


async def test_unreachable_receiver_is_retried_then_abandoned(
    webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    notifier = webhook(f"http://127.0.0.1:{port}/", max_attempts=3)
    await notifier.notify(EVENT)
    await notifier.close()

    messages = logs()
    assert sum("ConnectionRefusedError" in m for m in messages) == 3
    assert any("attempt 3/3" in m and "giving up" in m for m in messages)


async def test_timeout_is_retried(
    receiver: Receiver, webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    receiver.script.extend(["hang", 200])
    notifier = webhook(receiver.url, timeout=0.2)
    await notifier.notify(EVENT)
    await notifier.close()

    assert len(receiver.requests) == 2
    messages = logs()
    assert any("attempt 1/6" in m and "TimeoutError" in m and "retrying" in m for m in messages)
    assert any("attempt 2/6" in m and "delivered" in m for m in messages)


async def test_interim_responses_are_skipped(receiver: Receiver, webhook: Factory) -> None:
    receiver.script.append("early-hints")
    notifier = webhook(receiver.url)
    await notifier.notify(EVENT)
    await notifier.close()
    assert len(receiver.requests) == 1


async def test_notify_returns_at_once_and_close_waits_for_in_flight(
    receiver: Receiver, webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    receiver.script.append("hold")
    notifier = webhook(receiver.url)
    await asyncio.wait_for(notifier.notify(EVENT), 1.0)  # the receiver has not answered
    await receiver.next_arrival()

    closing = asyncio.create_task(notifier.close())
    done, _ = await asyncio.wait({closing}, timeout=0.05)
    assert not done, "close() returned while a delivery was in flight"
    receiver.release.set()
    await asyncio.wait_for(closing, 5.0)

    assert any("HTTP 200, delivered" in m for m in logs())
    await notifier.notify(event(1))  # after close: dropped, no request
    assert len(receiver.requests) == 1
    assert any("notifier closed, dropped" in m for m in logs())


async def test_close_cancels_what_outlives_its_bound(
    receiver: Receiver, webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    receiver.script.append("hang")
    notifier = webhook(receiver.url, timeout=30.0, close_timeout=0.05)
    await notifier.notify(EVENT)
    await receiver.next_arrival()
    started = time.monotonic()
    await asyncio.wait_for(notifier.close(), 5.0)

    assert time.monotonic() - started < 2.0
    assert len(receiver.requests) == 1
    messages = logs()
    assert any("cancelled, not delivered" in m for m in messages)
    assert any("abandoned 1 undelivered" in m for m in messages)
    assert not any("delivered to" in m or "HTTP" in m for m in messages)


async def test_concurrent_deliveries_are_bounded(receiver: Receiver, webhook: Factory) -> None:
    receiver.script.extend(["hold"] * 5)
    notifier = webhook(receiver.url, concurrency=2)
    for n in range(5):
        await notifier.notify(event(n))
    await receiver.next_arrival()
    await receiver.next_arrival()
    with pytest.raises(TimeoutError):  # a third waits for a slot
        await asyncio.wait_for(receiver.arrivals.get(), 0.1)
    receiver.release.set()
    await notifier.close()

    assert len(receiver.requests) == 5
    assert receiver.max_in_progress == 2


async def test_same_delivery_in_flight_is_sent_once(receiver: Receiver, webhook: Factory) -> None:
    receiver.script.append("hold")
    notifier = webhook(receiver.url)
    await notifier.notify(EVENT)
    await receiver.next_arrival()
    await notifier.notify(EVENT)
    await notifier.notify(
        ReviewEvent("review.decided", DIGEST, "thread-7", (), EVENT.occurred_at)
    )  # another kind is another delivery
    receiver.release.set()
    await notifier.close()

    assert sorted(r.headers["x-ztate-delivery"] for r in receiver.requests) == [
        f"review.decided:{DIGEST}",
        f"review.opened:{DIGEST}",
    ]


async def test_logs_name_the_delivery_never_secrets(
    receiver: Receiver, webhook: Factory, logs: Callable[[], list[str]]
) -> None:
    receiver.script.extend([503, 200])
    notifier = webhook(receiver.url + "/hooks/T0KEN-IN-PATH?key=T0KEN-IN-QUERY")
    await notifier.notify(EVENT)
    await notifier.close()

    text = "\n".join(logs()) + repr(notifier)
    assert f"review.opened:{DIGEST}" in text
    assert "attempt 1/6" in text
    assert "HTTP 503" in text
    signatures = [r.headers["x-ztate-signature"] for r in receiver.requests]
    for forbidden in [
        SECRET.decode(),
        SECRET.hex(),
        EXPECTED_BODY.decode(),
        "thread-7",
        "T0KEN-IN-PATH",
        "T0KEN-IN-QUERY",
        *signatures,
    ]:
        assert forbidden not in text


async def test_https_with_a_private_ca(pki: Pki, webhook: Factory) -> None:
    creds = pki.identity(Role.SERVICE, "transition")  # SANs: localhost, 127.0.0.1
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(creds.cert, creds.key)
    server = Receiver()
    await server.start(tls)
    try:
        trusted = webhook(server.url, ssl_context=ssl.create_default_context(cafile=creds.ca))
        await trusted.notify(EVENT)
        await trusted.close()
        assert len(server.requests) == 1
        assert server.requests[0].body == EXPECTED_BODY
        assert signed(server.requests[0])

        system_trust = webhook(server.url, max_attempts=2)  # does not know the private CA
        await system_trust.notify(event(1))
        await system_trust.close()
        assert len(server.requests) == 1
    finally:
        await server.stop()


async def test_null_notifier_does_nothing() -> None:
    notifier: Notifier = NullNotifier()  # satisfies the protocol (checked by mypy)
    await notifier.notify(EVENT)
    await notifier.close()


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://hooks.example/T0KEN", "http or https, not 'ftp'"),
        ("hooks.example/T0KEN", "http or https, not 'no scheme'"),
        ("http:///T0KEN", "no host"),
        ("https://user:T0KEN@hooks.example/", "must not carry credentials"),
        ("http://hooks.example:99999/T0KEN", "invalid port"),
        ("http://hooks.example/T0KEN path", "without spaces or control characters"),
        ("http://hooks.example/T0KEN\r\nX-Evil: 1", "without spaces or control characters"),
        ("http://hôoks.example/T0KEN", "ASCII"),
    ],
)
def test_bad_urls_are_refused_without_echoing_them(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="webhook URL") as caught:
        WebhookNotifier(url, SECRET)
    assert fragment in str(caught.value)
    assert "T0KEN" not in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"secret": b"short"}, "at least 32 bytes"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"first_backoff": -1.0}, "backoffs"),
        ({"first_backoff": 5.0, "max_backoff": 1.0}, "backoffs"),
        ({"timeout": 0.0}, "timeout"),
        ({"close_timeout": -1.0}, "close_timeout"),
        ({"concurrency": 0}, "concurrency"),
        ({"ssl_context": ssl.create_default_context()}, "http:// webhook URL"),
    ],
)
def test_bad_settings_are_refused(overrides: dict[str, object], fragment: str) -> None:
    options: dict[str, object] = {"secret": SECRET, **overrides}
    with pytest.raises(ValueError, match=fragment):
        WebhookNotifier("http://hooks.example/", **options)  # type: ignore[arg-type]


def test_http_and_https_urls_are_accepted() -> None:
    assert repr(WebhookNotifier("http://127.0.0.1:8080/x?k=T0KEN", SECRET)) == (
        "WebhookNotifier(http://127.0.0.1:8080)"
    )
    assert repr(WebhookNotifier("HTTPS://[::1]/T0KEN", SECRET)) == "WebhookNotifier(https://[::1])"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"kind": "review.closed"}, "event kind"),
        ({"digest": DIGEST.upper()}, "64 lower-case hex"),
        ({"digest": DIGEST[:-1]}, "64 lower-case hex"),
        ({"digest": DIGEST + "\n"}, "64 lower-case hex"),
        ({"occurred_at": datetime(2025, 1, 2, 3, 4, 5)}, "timezone-aware"),
    ],
)
def test_malformed_events_are_refused(changes: dict[str, object], fragment: str) -> None:
    fields: dict[str, object] = {
        "kind": "review.opened",
        "digest": DIGEST,
        "thread_id": "t",
        "risk_rules": (),
        "occurred_at": EVENT.occurred_at,
        **changes,
    }
    with pytest.raises(ValueError, match=fragment):
        ReviewEvent(**fields)  # type: ignore[arg-type]


def test_occurred_at_is_written_in_utc_with_z() -> None:
    plus_two = timezone(timedelta(hours=2))
    moment = datetime(2025, 1, 2, 5, 4, 5, 123456, tzinfo=plus_two)
    body = ReviewEvent("review.expired", DIGEST, "t", (), moment).body()
    assert b'"occurred_at":"2025-01-02T03:04:05.123456Z"' in body
    assert b'"delivery_id":"review.expired:' in body
