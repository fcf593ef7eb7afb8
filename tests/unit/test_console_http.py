"""The console's HTTP guard without a browser or a service: the token, the session,
CSRF, the origin and Host checks, and the headers on every answer, including refusals.

The backend here records the calls the pages make (it stands for the gRPC services, which
the browser test, tests/integration/test_console_browser.py, runs for real), so each
refusal can assert that nothing was called.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.harness import ConsoleClient, Pki, console_session, serving_console
from ztate.services.console.app import CSP
from ztate.services.console.backend import Backend, Identity
from ztate.services.runtime.identity import Role

DIGEST = "ab" * 32
NOBODY = Identity("127.0.0.1:1", Path("none"), Path("none"), Path("none"))


class Recording(Backend):
    """Pages' calls recorded; a decision answers as an approved review would."""

    def __init__(self) -> None:
        super().__init__(NOBODY, NOBODY)
        self.calls: list[tuple[str, Any]] = []

    async def reviews(self, status: str) -> list[dict[str, Any]]:
        self.calls.append(("reviews", status))
        return []

    async def decide(self, digest: str, decision: str) -> dict[str, Any]:
        self.calls.append(("decide", (digest, decision)))
        return {}

    async def rejections(self, thread_id: str | None) -> list[dict[str, Any]]:
        self.calls.append(("rejections", thread_id))
        return []


@pytest_asyncio.fixture
async def console() -> AsyncIterator[ConsoleClient]:
    async with serving_console(Recording()) as running:
        yield running


def csrf_of(console: ConsoleClient) -> str:
    [csrf] = console.guard.sessions.values()
    return csrf


async def test_the_token_opens_one_session_once(console: ConsoleClient) -> None:
    token = console.guard.token
    assert token is not None
    assert len(token) >= 43  # 256 bits, URL-safe base64
    async with console.session.get(f"{console.base}/reviews") as got:
        assert got.status == 401
    wrong = ("y" if token[0] == "x" else "x") + token[1:]  # one character off, never equal
    async with console.session.get(f"{console.base}/?token={wrong}") as got:
        assert (got.status, console.guard.token) == (403, token)  # a wrong one spends nothing
    cookie = await console.sign_in()
    assert console.guard.token is None
    [session] = console.guard.sessions
    assert cookie.startswith(f"{console.guard.cookie}={session};")
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= {a.strip() for a in cookie.split(";")}
    async with (
        console_session() as other,
        other.get(f"{console.base}/?token={token}") as got,
    ):
        assert got.status == 403
        assert "Token refused" in await got.text()
    assert len(console.guard.sessions) == 1


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "no Origin, no Sec-Fetch-Site"),
        ({"Origin": "http://evil.example"}, "another origin"),
        ({"Origin": "null"}, "null origin without Sec-Fetch-Site"),
        ({"Origin": "null", "Sec-Fetch-Site": "cross-site"}, "cross-site"),
        ({"Origin": "ORIGIN", "Sec-Fetch-Site": "same-site"}, "a sibling site"),
    ],
)
async def test_a_post_from_elsewhere_decides_nothing(
    console: ConsoleClient, headers: dict[str, str], why: str
) -> None:
    await console.sign_in()
    headers = {k: v.replace("ORIGIN", console.base) for k, v in headers.items()}
    form = {"csrf": csrf_of(console), "digest": DIGEST, "decision": "approve"}
    status, text = await console.post(f"/reviews/{DIGEST}/decide", form, **headers)
    assert (status, "Cross-origin request refused" in text) == (403, True), why
    assert console.backend.calls == []


async def test_the_csrf_token_is_required_and_compared(console: ConsoleClient) -> None:
    await console.sign_in()
    path = f"/reviews/{DIGEST}/decide"
    for form in (
        {"digest": DIGEST, "decision": "approve"},
        {"csrf": "", "digest": DIGEST, "decision": "approve"},
        {"csrf": csrf_of(console)[:-1] + "_", "digest": DIGEST, "decision": "approve"},
    ):
        status, text = await console.post(path, form, Origin=console.base)
        assert (status, "CSRF token missing or wrong" in text) == (403, True)
    assert console.backend.calls == []
    # with it, from this origin (or null with same-origin, as Chromium sends): decided
    form = {"csrf": csrf_of(console), "digest": DIGEST, "decision": "approve"}
    status, _ = await console.post(path, form, Origin=console.base)
    assert status == 303
    status, _ = await console.post(
        path, form, **{"Origin": "null", "Sec-Fetch-Site": "same-origin"}
    )
    assert status == 303
    assert console.backend.calls == [("decide", (DIGEST, "approve"))] * 2


async def test_a_decision_must_name_the_page_digest(console: ConsoleClient) -> None:
    await console.sign_in()
    csrf = csrf_of(console)
    for form in (
        {"csrf": csrf, "digest": "cd" * 32, "decision": "approve"},
        {"csrf": csrf, "digest": DIGEST, "decision": "approve-all"},
        {"csrf": csrf, "decision": "reject"},
    ):
        status, text = await console.post(f"/reviews/{DIGEST}/decide", form, Origin=console.base)
        assert (status, "nothing was decided" in text) == (400, True)
    status, _ = await console.post(
        "/reviews/not-hex/decide", {"csrf": csrf, "digest": "not-hex"}, Origin=console.base
    )
    assert status == 404
    assert console.backend.calls == []


async def test_another_host_is_refused_and_every_answer_has_the_headers(
    console: ConsoleClient,
) -> None:
    await console.sign_in()
    for host, status in (
        (f"localhost:{console.guard.port}", 421),
        (f"rebind.example:{console.guard.port}", 421),
        (f"127.0.0.1:{console.guard.port}", 421),  # its cookie would reach other ports
        (console.guard.host, 200),
    ):
        async with console.session.get(f"{console.base}/reviews", headers={"Host": host}) as got:
            assert got.status == status
            assert got.headers["Content-Security-Policy"] == CSP
            assert got.headers["X-Content-Type-Options"] == "nosniff"
            assert got.headers["Referrer-Policy"] == "no-referrer"
            assert got.headers["Cache-Control"] == "no-store"
            assert got.headers["X-Frame-Options"] == "DENY"
            assert got.headers["Server"] == "ztate-console"  # not aiohttp and its version
    assert "script-src" not in CSP  # default-src 'none' refuses every script
    assert "connect-src" not in CSP
    assert console.backend.calls == [("reviews", "open")]
    for path in ("/static/console.css", "/no-such-page", f"/threads/{'x' * 300}"):
        async with console.session.get(f"{console.base}{path}") as got:
            assert got.headers["Content-Security-Policy"] == CSP, path
            assert got.headers["Server"] == "ztate-console", path
    async with console.session.get(f"{console.base}/static/console.css") as got:
        assert (got.status, got.content_type) == (200, "text/css")
    async with console.session.get(f"{console.base}/static/../app.py") as got:
        assert got.status in (403, 404)


async def test_a_large_form_is_refused(console: ConsoleClient) -> None:
    await console.sign_in()
    form = {"csrf": csrf_of(console), "digest": DIGEST, "padding": "x" * 100_000}
    status, _ = await console.post(f"/reviews/{DIGEST}/decide", form, Origin=console.base)
    assert status == 413
    assert console.backend.calls == []


def test_the_command_refuses_unreadable_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ztate.services.cli.main import main

    monkeypatch.setenv("ZTATE_HOME", str(tmp_path))
    assert main(["console", "--port", "0"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("ztate console: cannot read ")
    assert str(tmp_path / "certs" / "operator-admin.crt") in said
    assert str(tmp_path / "certs" / "reviewer-alice.key") in said


CONNECTION_ENV = ("ZTATE_ADDRESS", "ZTATE_APPROVAL_ADDRESS", "ZTATE_CERT", "ZTATE_KEY",
                  "ZTATE_CA", "ZTATE_SERVER_NAME", "ZTATE_CONTEXT")  # fmt: skip


def console_said(
    argv: list[str], home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, list[str]]:
    """``ztate console ARGV`` run as the CLI runs it, with no credentials under ``home``
    and nothing from the environment or a context file: its exit code and stderr lines."""
    from ztate.services.cli.main import main

    for name in CONNECTION_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ZTATE_HOME", str(home))
    monkeypatch.setenv("ZTATE_CONFIG", str(home / "no-config.yaml"))
    code = main(["console", "--port", "0", *argv])
    return code, capsys.readouterr().err.splitlines()


def test_reviewer_names_the_approval_side_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--reviewer bob``: the review pages use reviewer-bob.*, the ledger pages still
    the operator's certificate (docs/console.md), as ``ztate ledger`` would."""
    certs = tmp_path / "certs"
    assert console_said(["--reviewer", "bob"], tmp_path, capsys, monkeypatch) == (
        2,
        [
            f"ztate console: cannot read {certs / 'operator-admin.crt'}, "
            f"{certs / 'operator-admin.key'}, {certs / 'reviewer-bob.crt'}, "
            f"{certs / 'reviewer-bob.key'}, {certs / 'ca.crt'}"
        ],
    )


def test_a_certificate_path_too_long_to_ask_about_is_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 300-character file name (stat: ENAMETOOLONG) is a file the console cannot
    read, said as any missing file is: one line, exit 2, no traceback."""
    long_name = "a" * 300
    certs = tmp_path / "certs"
    assert console_said(["--client-cert", long_name], tmp_path, capsys, monkeypatch) == (
        2,
        [
            f"ztate console: cannot read {long_name}, {certs / 'operator-admin.key'}, "
            f"{certs / 'reviewer-alice.crt'}, {certs / 'reviewer-alice.key'}, "
            f"{certs / 'ca.crt'}"
        ],
    )


async def test_a_verification_that_cannot_run_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Verify page's run is ``ztate verify --json``: here without a keyring (exit 2),
    shown as "could not run" with the verifier's own words."""
    from ztate.services.console.verification import run_verify

    monkeypatch.setenv("ZTATE_HOME", str(tmp_path / "home"))
    for name in ("ZTATE_HMAC_KEYRING", "ZTATE_HMAC_KEYRING_FILE", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bundle").mkdir()
    result = await run_verify(tmp_path / "bundle", "t-1")
    assert (result.exit_code, result.verdict, result.summary) == (2, "could not run", None)
    assert result.error is not None
    assert result.error.startswith("ztate verify: cannot verify:")


@pytest.mark.parametrize(
    "hostile",
    ["<script>alert(1)</script>", "a\nb", "t" * 129, "..%2F..%2Fetc", "%00", "é"],
)
async def test_a_hostile_thread_id_is_refused_before_any_call(
    console: ConsoleClient, hostile: str
) -> None:
    """The thread box and the timeline's path take only what the services accept as a
    thread id: anything else is 400 (the box) or 404 (the path), never a call, and never
    echoed into the page."""
    await console.sign_in()
    from urllib.parse import quote

    for url, status in (
        (f"/threads?thread={quote(hostile)}", 400),
        (f"/threads/{quote(hostile, safe='%')}", 404),
    ):
        async with console.session.get(f"{console.base}{url}", allow_redirects=False) as got:
            body = await got.text()
            assert (got.status, body) == (status, "not a thread id"), url
            assert got.headers["Content-Security-Policy"] == CSP
        assert console.backend.calls == []


HOSTILE_THREADS = [
    "t" * 129,  # one past the services' bound
    "t" * 7000,  # long, still inside one request line
    "a\nb",
    "a\rb",
    "a\x00b",
    "\x1b[31mred",
    "\u202eevil",
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "' onmouseover='alert(1)",
    "..%2F..%2Fetc",
    "é",
    "a b",
]


def reflected(body: str, hostile: str) -> bool:
    """Whether ``hostile`` (or any markup) came back in ``body``."""
    return hostile in body or "<" in body or "onerror" in body


@pytest.mark.parametrize("hostile", HOSTILE_THREADS)
async def test_a_hostile_rejections_filter_is_refused_before_any_call(
    console: ConsoleClient, hostile: str
) -> None:
    from urllib.parse import quote

    await console.sign_in()
    async with console.session.get(f"{console.base}/rejections?thread={quote(hostile)}") as got:
        body = await got.text()
        assert (got.status, body) == (400, "not a thread id")
        assert got.headers["Content-Security-Policy"] == CSP
    assert not reflected(body, hostile)
    assert console.backend.calls == []


MARK = b"zq-hostile-7f3a"  # a value no answer and no log may hold
MALFORMED = [
    pytest.param(
        b"GET /rejections?thread=<script>" + MARK + b"t" * 20_000 + b" HTTP/1.1\r\n"
        b"Host: HOST\r\n\r\n",
        431,
        id="request line past 8190 bytes",
    ),
    pytest.param(
        b"GET /reviews HTTP/1.1\r\nHost: HOST\r\nX-Long: " + MARK + b"v" * 20_000 + b"\r\n\r\n",
        431,
        id="header past 8190 bytes",
    ),
    pytest.param(
        b"GET /reviews HTTP/1.1\r\nHost: HOST\r\nBad Name" + MARK + b": x\r\n\r\n",
        400,
        id="malformed header",
    ),
    pytest.param(b"G<T" + MARK + b" / HTTP/1.1\r\nHost: HOST\r\n\r\n", 400, id="bad method"),
    pytest.param(b"GET /" + MARK + b" HTTP/9" + MARK + b"\r\n\r\n", 400, id="bad version"),
    # answered before any middleware, where aiohttp's own 417 quoted the header with its
    # Server header and no CSP
    pytest.param(
        b"GET /static/console.css HTTP/1.1\r\nHost: HOST\r\nExpect: <b>" + MARK + b"\r\n\r\n",
        417,
        id="unknown expectation",
    ),
]


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as bytes over a real socket; the answer's status, headers, body."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request.replace(b"HOST", f"any.localhost:{port}".encode()))
        answer = b""
        while chunk := conn.recv(65536):  # the console closes after a malformed request
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.fixture(scope="module")
def console_process(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleProcess]:
    """``ztate console`` as a person runs it: its own process, its stderr kept."""
    import os
    import subprocess
    import sys

    pki.operator()
    pki.identity(Role.REVIEWER, "alice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        ZTATE_HOME=str(pki.root),
        ZTATE_CONFIG=str(tmp_path_factory.mktemp("ctx") / "config.yaml"),
        PYTHONUNBUFFERED="1",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "ztate.services.cli.main", "console", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    first = process.stdout.readline().decode()  # blocks until the console listens (or exits)
    found = re.search(r"http://[0-9a-f]{32}\.localhost:(\d+)/", first)
    if found is None:
        process.kill()
        pytest.fail(f"ztate console did not start: {first!r} {process.communicate()[1]!r}")
    running = ConsoleProcess(process, int(found.group(1)))
    yield running
    running.stop()


class ConsoleProcess:
    def __init__(self, process: Any, port: int) -> None:
        self.process, self.port = process, port
        self.stderr: bytes | None = None

    def stop(self) -> bytes:
        """SIGTERM; everything the console wrote on stderr."""
        if self.stderr is None:
            self.process.terminate()
            _, self.stderr = self.process.communicate(timeout=30)
        return self.stderr


@pytest.mark.parametrize(("request_bytes", "status"), MALFORMED)
def test_a_malformed_request_gets_a_fixed_answer_with_the_headers(
    console_process: ConsoleProcess, request_bytes: bytes, status: int
) -> None:
    """What aiohttp's parser refuses (a request line or a header past its 8190-byte bound,
    a malformed header, method or version) is answered by the console: a fixed text, the
    console's headers, nothing of the request echoed, and the connection closed."""
    got, headers, body = raw_exchange(console_process.port, request_bytes)
    assert got == status
    assert headers["content-security-policy"] == CSP
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    assert headers["x-frame-options"] == "DENY"
    assert headers["server"] == "ztate-console"
    assert headers["content-type"].startswith("text/html")
    assert MARK not in body
    assert b"<script>" not in body
    assert len(body) < 2000


def test_nothing_of_a_malformed_request_reaches_the_console_log(
    console_process: ConsoleProcess,
) -> None:
    """Run after the answers above (same console): its stderr, where its logs go, holds
    none of the requests' bytes, and no traceback."""
    for param in MALFORMED:
        raw_exchange(console_process.port, param.values[0])  # type: ignore[arg-type]
    said = console_process.stop()
    assert console_process.process.returncode == 0
    assert MARK not in said
    assert b"Traceback" not in said
    assert b"Error handling request" not in said


async def test_a_valid_rejections_filter_is_asked(console: ConsoleClient) -> None:
    await console.sign_in()
    async with console.session.get(f"{console.base}/rejections?thread=order-42.a:b_c") as got:
        assert got.status == 200
    assert console.backend.calls == [("rejections", "order-42.a:b_c")]


NOT_DIGESTS = [
    "not-hex",
    "AB" * 32,  # digests are lower-case hex
    "ab" * 31,
    "ab" * 33,
    "ab" * 32 + "\n",
    "ab" * 31 + "zz",
    "<script>alert(1)</script>",
    "\x00" * 64,
    "sha256:" + "ab" * 32,
]


@pytest.mark.parametrize("value", NOT_DIGESTS)
async def test_review_paths_take_only_a_digest(console: ConsoleClient, value: str) -> None:
    """A review page and its decision exist only for a transition digest: anything else
    is 404 (no page), with nothing asked, decided or echoed."""
    from urllib.parse import quote

    await console.sign_in()
    path = f"/reviews/{quote(value, safe='')}"
    async with console.session.get(f"{console.base}{path}") as got:
        body = await got.text()
        assert (got.status, body) == (404, "not a transition digest")
        assert got.headers["Content-Security-Policy"] == CSP
    form = {"csrf": csrf_of(console), "digest": value, "decision": "approve"}
    status, body = await console.post(f"{path}/decide", form, Origin=console.base)
    assert (status, body) == (404, "not a transition digest")
    assert not reflected(body, value)
    assert console.backend.calls == []


def verify_ran(console: ConsoleClient) -> bool:
    from ztate.services.console.app import CONSOLE

    return console.app[CONSOLE].last_verify is not None


@pytest.mark.parametrize("hostile", HOSTILE_THREADS[:1] + HOSTILE_THREADS[2:])
async def test_a_verification_of_a_hostile_thread_runs_nothing(
    console: ConsoleClient, hostile: str
) -> None:
    await console.sign_in()
    form = {"csrf": csrf_of(console), "thread": hostile}
    status, body = await console.post("/verify", form, Origin=console.base)
    assert (status, body) == (400, "not a thread id")
    assert not reflected(body, hostile)
    assert not verify_ran(console)


async def test_hostile_verification_bodies_run_nothing(console: ConsoleClient) -> None:
    """A file where the thread box is (not "every thread"), a body past 16 KiB, a JSON
    body, a form without the CSRF token: each a precise 4xx, and no verification ran."""
    from aiohttp import FormData

    await console.sign_in()
    csrf = csrf_of(console)
    upload = FormData()
    upload.add_field("csrf", csrf)
    upload.add_field("thread", b"t-1", filename="thread.txt")
    async with console.session.post(
        f"{console.base}/verify", data=upload, headers={"Origin": console.base}
    ) as got:
        assert (got.status, await got.text()) == (400, "not a thread id")
    status, _ = await console.post(
        "/verify", {"csrf": csrf, "thread": "t-1", "pad": "x" * 20_000}, Origin=console.base
    )
    assert status == 413
    async with console.session.post(
        f"{console.base}/verify",
        json={"csrf": csrf, "thread": "t-1"},
        headers={"Origin": console.base},
    ) as got:
        assert got.status == 403  # no form, so no CSRF token
    status, _ = await console.post("/verify", {"thread": "t-1"}, Origin=console.base)
    assert status == 403
    assert not verify_ran(console)
    assert console.backend.calls == []


async def test_a_service_out_of_reach_is_503_on_every_page(pki: Pki) -> None:
    """The real backend, with real certificates, against an address where nothing
    listens (a port held bound, not listening): every page, and a decision, answer 503
    with the call's status shown, not 502 or 409."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        address = f"127.0.0.1:{held.getsockname()[1]}"
        operator, reviewer = pki.operator(), pki.identity(Role.REVIEWER, "alice")
        backend = Backend(
            Identity(address, operator.cert, operator.key, operator.ca),
            Identity(address, reviewer.cert, reviewer.key, reviewer.ca),
        )
        async with serving_console(backend) as console:
            await console.sign_in()
            form = {"csrf": csrf_of(console), "digest": DIGEST, "decision": "approve"}
            status, body = await console.post(
                f"/reviews/{DIGEST}/decide", form, Origin=console.base
            )
            assert status == 503
            assert "UNAVAILABLE" in body
            for path in ("/reviews", f"/reviews/{DIGEST}", "/threads", "/threads/t-1"):
                async with console.session.get(f"{console.base}{path}") as got:
                    body = await got.text()
                    assert got.status == 503, (path, got.status)
                    assert "UNAVAILABLE" in body, path
            async with console.session.get(f"{console.base}/rejections?thread=t-1") as got:
                assert got.status == 503
    finally:
        held.close()


@pytest.mark.parametrize(
    ("port", "said"),
    [
        ("65536", "argument --port: must be 0 to 65535"),
        ("-1", "argument --port: must be 0 to 65535"),
        ("x", "argument --port: 'x' is not a whole number"),
        ("", "argument --port: '' is not a whole number"),
    ],
)
def test_the_port_is_a_port(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    port: str,
    said: str,
) -> None:
    """``--port`` is the CLI's bounded_int: a usage error (exit 2) naming the flag, from
    argparse, before any credential is read or any socket bound."""
    from ztate.services.cli.main import main

    monkeypatch.setenv("ZTATE_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main(["console", "--port", port])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"ztate console: error: {said}"
    assert "cannot read" not in err


async def test_credentials_are_read_once_and_again_only_when_they_change(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The console reads and parses its certificate, key and CA when it needs them
    first, and keeps them for every page after; renewed files (``ztate ca renew``) are
    read at the next page; a key file gone is 503 CREDENTIALS_UNREADABLE at every page,
    never the old key, until it is back. The real backend against an address where
    nothing listens: every other page is 503 UNAVAILABLE."""
    import shutil
    import socket

    from ztate.services.cli import ca
    from ztate.services.runtime import tls

    reads: list[Path] = []
    checked = tls.checked_files

    def counted(cert: Path, key: Path, ca_file: Path) -> tuple[bytes, bytes, bytes]:
        reads.append(cert)
        return checked(cert, key, ca_file)

    monkeypatch.setattr(tls, "checked_files", counted)
    operator = pki.operator()
    for source in (operator.cert, operator.key):
        shutil.copy(source, tmp_path / source.name)
    cert, key = tmp_path / operator.cert.name, tmp_path / operator.key.name
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    address = f"127.0.0.1:{held.getsockname()[1]}"
    mine = Identity(address, cert, key, operator.ca)

    async def shown(path: str) -> tuple[int, str]:
        async with console.session.get(f"{console.base}{path}") as got:
            body = await got.text()
        return got.status, "UNAVAILABLE" if "UNAVAILABLE" in body else "CREDENTIALS_UNREADABLE"

    try:
        async with serving_console(Backend(mine, mine)) as console:
            await console.sign_in()
            pages = ("/threads", "/threads/t-1", "/rejections", "/reviews", "/threads")
            for path in pages:
                assert await shown(path) == (503, "UNAVAILABLE"), path
            assert reads == [cert]  # once, for every page's channels
            ca.renew(pki.ca_dir, cert)  # a new key pair, both files replaced
            assert await shown("/threads") == (503, "UNAVAILABLE")
            assert reads == [cert, cert]
            key.unlink()
            for path in ("/threads", "/reviews"):
                assert await shown(path) == (503, "CREDENTIALS_UNREADABLE"), path
            ca.renew(pki.ca_dir, cert)  # back
            assert await shown("/threads") == (503, "UNAVAILABLE")
            assert await shown("/reviews") == (503, "UNAVAILABLE")
            assert len(reads) == 5  # the two pages without a key tried once each
    finally:
        held.close()


async def test_a_credential_that_became_a_symlink_loop_is_503_credentials_unreadable(
    pki: Pki, tmp_path: Path
) -> None:
    """A key file replaced by a symlink loop (stat and open: ELOOP) is a credential
    the console cannot read: 503 CREDENTIALS_UNREADABLE at every page, as a file gone
    is, never a 500; the file back is used at the next page."""
    import shutil
    import socket

    operator = pki.operator()
    for source in (operator.cert, operator.key):
        shutil.copy(source, tmp_path / source.name)
    cert, key = tmp_path / operator.cert.name, tmp_path / operator.key.name
    saved = key.read_bytes()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    mine = Identity(f"127.0.0.1:{held.getsockname()[1]}", cert, key, operator.ca)

    async def shown(path: str) -> tuple[int, bool, bool]:
        async with console.session.get(f"{console.base}{path}") as got:
            body = await got.text()
        return got.status, "CREDENTIALS_UNREADABLE" in body, "UNAVAILABLE" in body

    try:
        async with serving_console(Backend(mine, mine)) as console:
            await console.sign_in()
            assert await shown("/threads") == (503, False, True)
            key.unlink()
            key.symlink_to(tmp_path / "loop")
            (tmp_path / "loop").symlink_to(key)
            for path in ("/threads", "/reviews", "/threads"):
                assert await shown(path) == (503, True, False), path
            key.unlink()
            key.write_bytes(saved)
            assert await shown("/threads") == (503, False, True)
    finally:
        held.close()
