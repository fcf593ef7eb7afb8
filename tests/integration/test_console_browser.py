"""``ztate console`` in a real browser: headless Chromium (Debian's chromium and
chromium-driver, driven by selenium through the system chromedriver) against a live
control plane: the transition service, the approval service as its own process, real
Postgres and real mTLS. The consoles run as ``ztate console`` processes with the
person's certificates, as a person starts them.

Selenium blocks; the transition service runs on this test's event loop, so every
browser call goes through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import asyncpg
import pytest
import pytest_asyncio
from selenium.webdriver.common.by import By

from tests.integration import test_approvals
from tests.integration.test_approvals import OTHER_USER, World, eventually
from ztate.services.runtime.identity import Role

# both services as separate processes on a fresh database (test_approvals.py's fixture)
world = test_approvals.world

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"
SCREENSHOTS = os.environ.get("ZTATE_CONSOLE_SCREENSHOTS")  # a folder: the docs' images
T = TypeVar("T")


# --- a sentinel: the address the planted script would call ----------------------------


@dataclass
class Sentinel:
    port: int
    hits: list[bytes]


@pytest_asyncio.fixture(scope="module")
async def sentinel() -> AsyncIterator[Sentinel]:
    hits: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(await reader.readline())
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield Sentinel(port, hits)
    server.close()
    await server.wait_closed()


def payload(sentinel: Sentinel, where: str) -> str:
    """Hostile agent output: script, event handlers and markup, each of which would
    call the sentinel, retitle the page or mark the DOM if it ran."""
    base = f"http://127.0.0.1:{sentinel.port}/{where}"
    return (
        f"</pre></td><script>document.title='pwned';fetch('{base}/script')</script>"
        f'<img src="{base}/img" onerror="document.body.dataset.pwned=\'{where}\'">'
        f'<svg onload="alert(\'{where}\')"></svg>"\'><b id="planted">bold</b>'
    )


def as_json(text: str) -> str:
    """How a string shows inside a JSON value on the page."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


# --- the browser ----------------------------------------------------------------------


class Browser:
    """One headless Chromium for the module; every call off the event loop."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (
            "--headless=new",
            "--no-sandbox",  # CI runs as root
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--window-size=1280,900",
            "--no-first-run",
            "--disable-background-networking",
        ):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(
            service=Service(executable_path=str(CHROMEDRIVER)), options=options
        )
        self.driver.set_page_load_timeout(30)

    async def run(self, call: Callable[[], T]) -> T:
        return await asyncio.to_thread(call)

    async def get(self, url: str) -> str:
        await self.run(lambda: self.driver.get(url))
        return await self.text()

    async def text(self) -> str:

        found: str = await self.run(lambda: self.driver.find_element(By.TAG_NAME, "body").text)
        return found

    async def click(self, css: str) -> str:
        """Click and wait for the page it leads to."""

        await self.script("window.__before = 1")
        await self.run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).click())
        return await self.next_page()

    async def next_page(self, within: float = 30.0) -> str:
        """The text of the page that replaced the one marked ``window.__before``."""

        async def probe() -> bool | None:
            try:
                done = await self.script(
                    "return window.__before === undefined && document.readyState === 'complete'"
                )
            except Exception:  # mid-navigation
                return None
            return True if done else None

        await eventually(probe, within)
        return await self.text()

    async def script(self, source: str, *args: Any) -> Any:
        return await self.run(lambda: self.driver.execute_script(source, *args))

    async def post_form(self, action: str, fields: dict[str, str]) -> str:
        """Submit a form the console did not render (a forged or hand-made request)."""
        await self.script(
            "const f = document.createElement('form'); f.method = 'post';"
            "f.action = arguments[0];"
            "for (const [k, v] of Object.entries(arguments[1])) {"
            "  const i = document.createElement('input'); i.type = 'hidden';"
            "  i.name = k; i.value = v; f.appendChild(i); }"
            "document.body.appendChild(f); window.__before = 1; f.submit();",
            action,
            fields,
        )
        return await self.next_page()

    async def wait_for_text(self, ok: Callable[[str], bool], within: float = 20.0) -> str:
        async def probe() -> str | None:
            try:
                text = await self.text()
            except Exception:  # mid-navigation
                return None
            return text if ok(text) else None

        return await eventually(probe, within)

    async def assert_nothing_ran(self, sentinel: Sentinel, title: str) -> None:
        """No alert, no retitled page, no marked DOM, no planted element, no request."""
        from selenium.common.exceptions import NoAlertPresentException

        def no_alert() -> None:
            with pytest.raises(NoAlertPresentException):
                _ = self.driver.switch_to.alert.text

        await self.run(no_alert)
        state = await self.script(
            "return [document.title, document.body.dataset.pwned || null,"
            " document.scripts.length, document.querySelectorAll('img, svg, #planted').length]"
        )
        assert state == [title, None, 0, 0]
        logs = await self.run(lambda: self.driver.get_log("browser"))
        assert not [entry for entry in logs if "pwned" in entry["message"]]
        assert sentinel.hits == []

    async def screenshot(self, name: str) -> None:
        if SCREENSHOTS:
            path = Path(SCREENSHOTS) / f"console-{name}.png"
            await self.run(lambda: self.driver.save_screenshot(str(path)))

    def quit(self) -> None:
        self.driver.quit()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(f"the console's browser tests need Chromium and its driver: {INSTALL}")
    opened = Browser()
    yield opened
    opened.quit()


# --- the consoles ---------------------------------------------------------------------


@dataclass
class Console:
    process: asyncio.subprocess.Process
    url: str  # with the one-time token

    @property
    def origin(self) -> str:
        return self.url.split("/?", 1)[0]

    @property
    def port(self) -> int:
        return int(self.origin.rsplit(":", 1)[1])

    @property
    def token(self) -> str:
        return self.url.split("token=", 1)[1]


async def start_console(world: World, reviewer: tuple[Path, Path], keyring: Path) -> Console:
    operator = world.pki.operator()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        DATABASE_URL=world.dsn,
        ZTATE_HOME=str(world.root / "console-home"),
        ZTATE_TRUST_DOMAIN="ztate.test",
        ZTATE_HMAC_KEYRING_FILE=str(keyring),
        ZTATE_APPROVAL_PUBLIC_KEYS_FILE=str(world.public_keys),
        ZTATE_POLICY_PATH=str(world.root / "policies"),
    )
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        "console",
        *("--target", world.target, "--approval-target", world.approval_target),
        *("--cert", str(operator.cert), "--key", str(operator.key), "--ca", str(operator.ca)),
        *("--reviewer-cert", str(reviewer[0]), "--reviewer-key", str(reviewer[1])),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
    found = re.search(r"(http://[0-9a-f]{32}\.localhost:\d+/\?token=[A-Za-z0-9_-]{43})", line)
    if not found:  # no console to hand back: none left running either
        process.kill()
        await process.wait()
        pytest.fail(f"ztate console printed no URL: {line!r}")
    return Console(process, found.group(1))


async def stop_console(console: Console) -> str:
    console.process.terminate()
    _, err = await asyncio.wait_for(console.process.communicate(), 30)
    assert console.process.returncode == 0
    return err.decode()


@pytest_asyncio.fixture(scope="module")
async def alice_console(world: World, keyring_file: Path) -> AsyncIterator[Console]:
    alice = world.pki.identity(Role.REVIEWER, "alice")
    console = await start_console(world, (alice.cert, alice.key), keyring_file)
    yield console
    logged = await stop_console(console)
    assert console.token not in logged  # no secret in its output


@pytest_asyncio.fixture(scope="module")
async def node_console(world: World, keyring_file: Path) -> AsyncIterator[Console]:
    """A console started with a node's certificate in the reviewer's place."""
    node = world.pki.node("approval-gate")
    console = await start_console(world, (node.cert, node.key), keyring_file)
    yield console
    await stop_console(console)


def raw_request(
    console: Console, method: str, path: str, headers: dict[str, str], body: str = ""
) -> tuple[int, dict[str, str], str]:
    """One HTTP request as a non-browser (or a rebinding page) would send it."""
    connection = http.client.HTTPConnection("127.0.0.1", console.port, timeout=10)
    try:
        connection.putrequest(method, path, skip_host=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        data = body.encode()
        connection.putheader("Content-Length", str(len(data)))
        connection.endheaders(data)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        connection.close()


# --- the tests ------------------------------------------------------------------------


async def test_the_one_time_token_opens_one_session_and_is_dead_after(
    alice_console: Console, browser: Browser
) -> None:
    wrong = alice_console.url[:-4] + ("AAAA" if not alice_console.url.endswith("AAAA") else "BBBB")
    assert "Token refused" in await browser.get(wrong)
    assert "Not signed in" in await browser.get(f"{alice_console.origin}/reviews")

    text = await browser.get(alice_console.url)
    assert "Reviews" in text
    assert await browser.run(lambda: browser.driver.current_url) == (
        f"{alice_console.origin}/reviews"  # the token left the address bar
    )
    [cookie] = await browser.run(browser.driver.get_cookies)
    assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")
    assert await browser.script("return document.cookie") == ""

    await browser.run(browser.driver.delete_all_cookies)
    assert "Token refused" in await browser.get(alice_console.url)  # used: dead
    assert "Not signed in" in await browser.get(f"{alice_console.origin}/reviews")
    await browser.run(lambda: browser.driver.add_cookie(cookie))
    assert "Reviews" in await browser.get(f"{alice_console.origin}/reviews")


async def test_the_session_cookie_reaches_no_other_local_listener(
    world: World, keyring_file: Path, browser: Browser
) -> None:
    """Cookies tell hosts apart, not ports: under 127.0.0.1 the browser sent the
    console's session cookie to any local listener it was led to (another user's, or
    an agent's), which could then act as the console. Under the console's own random
    ``*.localhost`` name, no other listener receives it."""
    heads: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    alice = world.pki.identity(Role.REVIEWER, "alice")
    console = await start_console(world, (alice.cert, alice.key), keyring_file)
    listener = await asyncio.start_server(record, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        assert "Reviews" in await browser.get(console.url)  # signed in: the token spent
        [cookie] = [
            c
            for c in await browser.run(browser.driver.get_cookies)
            if c["name"] == f"ztate_console_{console.port}"
        ]
        for url in (f"http://127.0.0.1:{port}/steal", f"http://localhost:{port}/steal"):
            await browser.get(url)
    finally:
        listener.close()
        await listener.wait_closed()
        await stop_console(console)
    assert any(head.startswith(b"GET /steal ") for head in heads)
    assert not [head for head in heads if cookie["value"].encode() in head]


async def test_headers_host_and_origin_checks(alice_console: Console, browser: Browser) -> None:
    await browser.get(f"{alice_console.origin}/reviews")
    [cookie] = await browser.run(browser.driver.get_cookies)
    session = f"{cookie['name']}={cookie['value']}"
    host = alice_console.origin.removeprefix("http://")

    status, headers, body = await asyncio.to_thread(
        raw_request, alice_console, "GET", "/reviews", {"Host": host, "Cookie": session}
    )
    assert status == 200
    csp = headers["Content-Security-Policy"]
    for directive in (
        "default-src 'none'",
        "style-src 'self'",
        "frame-ancestors 'none'",
        "form-action 'self'",
    ):
        assert directive in csp
    # no script of any origin, the console's own included: it has none
    assert "script-src" not in csp
    assert "connect-src" not in csp
    assert "unsafe" not in csp
    assert headers["Server"] == "ztate-console"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert headers["Cache-Control"] == "no-store"

    # DNS rebinding: a page of another name that resolves to 127.0.0.1
    port = alice_console.port
    for other in (f"rebind.example:{port}", f"localhost:{port}", f"127.0.0.1:{port}"):
        status, _, body = await asyncio.to_thread(
            raw_request, alice_console, "GET", "/reviews", {"Host": other, "Cookie": session}
        )
        assert (status, "Wrong host" in body) == (421, True)

    # a state-changing request from another origin, even with the session and a token
    form = "csrf=whatever&digest=" + "0" * 64 + "&decision=approve"
    status, _, body = await asyncio.to_thread(
        raw_request,
        alice_console,
        "POST",
        f"/reviews/{'0' * 64}/decide",
        {
            "Host": host,
            "Cookie": session,
            "Origin": "http://rebind.example",
            "Content-Type": "application/x-www-form-urlencoded",
        },
        form,
    )
    assert (status, "Cross-origin request refused" in body) == (403, True)


async def test_a_reviewer_approves_in_the_browser_and_the_parked_transition_commits(
    world: World, alice_console: Console, browser: Browser, sentinel: Sentinel
) -> None:
    thread_id = await world.thread()
    hostile = payload(sentinel, "review")
    parked = await world.park(
        thread_id,
        target_user_id=OTHER_USER,
        pending_transition={"action": "refund", "order_id": "A-42", "reason": hostile},
    )
    await world.review(parked.digest)
    before = await world.ledger.snapshot(thread_id)

    listing = await browser.get(f"{alice_console.origin}/reviews")
    assert thread_id in listing
    await browser.screenshot("reviews")
    page = await browser.click(f"a[href='/reviews/{parked.digest}']")
    assert parked.digest in page
    assert "target-user-change" in page
    assert "0 of 1; 1 still needed" in page
    assert as_json(hostile) in page  # shown as text (JSON), every character of it
    await browser.assert_nothing_ran(sentinel, f"Review {parked.digest[:12]} · ztate console")
    await browser.screenshot("review")
    assert await world.ledger.snapshot(thread_id) == before  # nothing yet

    done = await browser.click("#approve")
    assert "You decided: approve" in done

    async def committed() -> bool | None:
        return True if await world.pending_status(parked.digest) == "committed" else None

    await eventually(committed)  # the console waits 10 s for it; a loaded machine may not
    done = await browser.get(f"{alice_console.origin}/reviews/{parked.digest}")
    outcome = await browser.run(lambda: browser.driver.find_element(By.ID, "outcome").text)
    assert outcome == "committed"
    assert "approve by spiffe://ztate.test/reviewer/alice; nonce" in done  # the receipt
    record = await world.ledger.record(thread_id, 1)
    assert record["node_id"] == "spiffe://ztate.test/node/planner"
    assert record["patch"]["target_user_id"] == OTHER_USER
    assert record["patch"]["pending_transition"]["reason"] == hostile
    assert await world.pending_status(parked.digest) == "committed"
    assert await world.ledger.verify(thread_id) == 2

    # the committed hostile value, in the thread's timeline
    timeline = await browser.get(f"{alice_console.origin}/threads/{quote(thread_id)}")
    assert as_json(hostile) in timeline
    assert "target_user_id, pending_transition" in timeline or "pending_transition" in timeline
    await browser.assert_nothing_ran(sentinel, f"Thread {thread_id} · ztate console")
    await browser.screenshot("thread")


async def test_characters_a_reviewer_cannot_see_are_shown_as_escapes(
    world: World, alice_console: Console, browser: Browser
) -> None:
    """A right-to-left override made Chromium show the new value "\u202e6789-TNUOCCA" as
    "ACCOUNT-9876": the reviewer approved a value they never saw. Every character a
    reader cannot see (bidi controls, zero-width, C1 controls) is now its escape, on
    the review and in the thread's timeline."""
    thread_id = await world.thread()
    reversed_ = "\u202e6789-TNUOCCA\u200b\x9b"
    parked = await world.park(
        thread_id,
        target_user_id=OTHER_USER,
        pending_transition={"action": "refund", "order_id": "A-42", "reason": reversed_},
    )
    await world.review(parked.digest)

    page = await browser.get(f"{alice_console.origin}/reviews/{parked.digest}")

    shown = "\\u202e6789-TNUOCCA\\u200b\\x9b"
    assert shown in page
    assert not any(char in page for char in "\u202e\u200b\x9b")


async def test_a_hostile_rejection_row_renders_as_text(
    world: World, alice_console: Console, browser: Browser, sentinel: Sentinel
) -> None:
    from ztate.worker_sdk import PermissionDenied

    thread_id = await world.thread()
    hostile = payload(sentinel, "rejection")
    async with world.worker("input-parser") as parser:
        with pytest.raises(PermissionDenied):
            await parser.propose(thread_id, 0, {hostile: "x"})
    [row] = await world.ledger.rejections(thread_id)
    assert hostile not in str(dict(row))  # the service keeps a digest of a refused key name
    # a row carrying hostile text all the same (an older version, a future bug), planted
    conn = await asyncpg.connect(world.dsn)
    try:
        await conn.execute(
            "INSERT INTO ztate.rejections (method, node_id, thread_id, base_version, reason,"
            " keys, message) VALUES ('ProposeTransition', $1, $2, 0, $1, $3, $1)",
            hostile,
            thread_id,
            [hostile, "plain"],
        )
    finally:
        await conn.close()

    page = await browser.get(f"{alice_console.origin}/rejections?thread={quote(thread_id)}")
    assert page.count(hostile) == 4  # node, reason, key and message, as text
    assert "sha256:" in page
    await browser.assert_nothing_ran(sentinel, "Rejections · ztate console")
    await browser.screenshot("rejections")
    page = await browser.get(f"{alice_console.origin}/threads")
    assert thread_id in page
    page = await browser.get(f"{alice_console.origin}/threads?thread={quote(thread_id)}")
    assert f"Thread {thread_id}" in page  # the "open a thread" form's target
    await browser.get(f"{alice_console.origin}/threads")
    await browser.screenshot("threads")


async def test_a_post_without_the_csrf_token_decides_nothing(
    world: World, alice_console: Console, browser: Browser
) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    await world.review(parked.digest)
    before = await world.ledger.snapshot(thread_id)
    await browser.get(f"{alice_console.origin}/reviews/{parked.digest}")
    action = f"/reviews/{parked.digest}/decide"
    fields = {"digest": parked.digest, "decision": "approve"}
    for forged in (fields, {**fields, "csrf": "not-the-token"}):
        text = await browser.post_form(action, forged)
        assert "CSRF token missing or wrong" in text
    assert await world.pending_status(parked.digest) == "pending"
    review = await world.review(parked.digest)
    assert list(review.approvers) == []
    assert await world.ledger.snapshot(thread_id) == before


async def test_a_node_certificate_cannot_approve(
    world: World, node_console: Console, browser: Browser
) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    await world.review(parked.digest)
    before = await world.ledger.snapshot(thread_id)

    await browser.run(browser.driver.delete_all_cookies)
    listing = await browser.get(node_console.url)
    assert "PERMISSION_DENIED" in listing
    # the decision, made by hand with this session's own CSRF token: still refused
    verify_page = await browser.get(f"{node_console.origin}/verify")
    assert "Run verification" in verify_page, verify_page
    csrf = await browser.run(
        lambda: browser.driver.find_element(By.NAME, "csrf").get_attribute("value")
    )
    await browser.get(f"{node_console.origin}/reviews/{parked.digest}")
    text = await browser.post_form(
        f"/reviews/{parked.digest}/decide",
        {"csrf": csrf, "digest": parked.digest, "decision": "approve"},
    )
    error = await browser.run(lambda: browser.driver.find_element(By.ID, "error").text)
    assert error.startswith("PERMISSION_DENIED ROLE_FORBIDDEN"), (error, text)
    assert await world.pending_status(parked.digest) == "pending"
    assert await world.ledger.snapshot(thread_id) == before


async def test_the_verify_page_shows_the_verifier_result(
    world: World, keyring_file: Path, browser: Browser
) -> None:
    """``ztate verify`` over the database, as the console's environment names it, from a
    session of its own (a console of its own: one token opens one session)."""
    node = world.pki.node("approval-gate")
    console = await start_console(world, (node.cert, node.key), keyring_file)
    try:
        await browser.run(browser.driver.delete_all_cookies)
        await browser.get(console.url)
        await browser.get(f"{console.origin}/verify")
        text = await browser.click("#run-verify")
        text = await browser.wait_for_text(lambda t: "Result of" in t, within=120)
        assert "verified:" in text, text
        await browser.screenshot("verify")
    finally:
        await stop_console(console)
