"""The console's web application (aiohttp, Jinja2 with autoescaping everywhere).

Security, in one place (docs/console.md):

- It answers only to ``Host: <random>.localhost:<port>`` (a DNS-rebinding page names
  another host; a page on another port of 127.0.0.1 never receives its cookie).
- The URL printed at start holds a one-time token; the first visit exchanges it for a
  session cookie (HttpOnly, SameSite=Strict) and the token is dead from then on.
- Every state-changing request is a POST that must carry the session's CSRF token
  (synchronizer token, compared in constant time) and come from this origin (``Origin``).
- Every response has a strict Content-Security-Policy (no inline script, no eval, no
  framing, forms only to itself), ``nosniff``, ``no-referrer`` and ``no-store``.
- State values and rejection texts are hostile agent output: the templates escape every
  value (autoescape, never ``|safe``) and the pages carry no script of their own.
- Nothing secret is logged: no access log (URLs carry the token), and errors show
  status, reason and message only.
- What aiohttp's parser refuses before any handler runs (a request line or a header
  past 8190 bytes, a malformed header, method or version) is answered by the console
  too (``ConsoleRunner``): a fixed text with the headers above, nothing of the request
  echoed or logged, where aiohttp would answer with the start of the line and log it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from ztate.contract.record import printable
from ztate.services.console.backend import CREDENTIALS_UNREADABLE, DIGEST, Backend, CallFailed
from ztate.services.console.verification import VerifyResult, run_verify
from ztate.services.runtime.thread_ids import THREAD_ID

# The console runs no script at all: every page is HTML and one stylesheet, so what
# default-src 'none' leaves out (scripts, connections, images, frames) is refused.
CSP = (
    "default-src 'none'; style-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    # aiohttp would name itself and its version (a fingerprint for an attacker's map)
    "Server": "ztate-console",
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Pragma": "no-cache",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
LOG = logging.getLogger("ztate.console")
MAX_FORM_BYTES = 16 * 1024
STATIC = Path(__file__).with_name("static")
REVIEW_STATUSES = ("open", "approved", "rejected", "expired")

# The HTTP status of a page whose gRPC call failed, by the call's status code: the one
# mapping (the services map their errors to gRPC in services/runtime/rpc_errors.py).
# The service out of reach is 503, whatever the page; a code not named here is 502.
CALL_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 403,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "FAILED_PRECONDITION": 409,
    "ABORTED": 409,
    # a query the service would not run to the end (QUERY_TOO_COSTLY: narrow it), a
    # limit of the service's reached: gRPC's own HTTP mapping (Google's AIP-193)
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    CREDENTIALS_UNREADABLE: 503,  # the console's own files went away: it cannot call
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Guard:
    """The one-time token and the sessions it opened (in memory: a restart logs out)."""

    port: int
    token: str | None = field(default_factory=lambda: secrets.token_urlsafe(32))
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> CSRF token
    # The console's own host name, <128 random bits>.localhost (browsers resolve every
    # *.localhost to this machine): cookies tell hosts apart but not ports, so under
    # 127.0.0.1 any local listener the browser was sent to received the session cookie
    name: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def host(self) -> str:
        return f"{self.name}.localhost:{self.port}"

    @property
    def cookie(self) -> str:
        """The session cookie's name: cookies do not tell ports apart, consoles do."""
        return f"ztate_console_{self.port}"

    @property
    def origin(self) -> str:
        return f"http://{self.host}"

    def exchange(self, offered: str) -> str | None:
        """A new session id for the one-time token (once), else None."""
        token = self.token
        if token is None or not hmac.compare_digest(offered.encode(), token.encode()):
            return None
        self.token = None  # dead from now on, used or not by this browser
        session = secrets.token_urlsafe(32)
        self.sessions[session] = secrets.token_urlsafe(32)
        return session

    def csrf_of(self, request: web.Request) -> str | None:
        """The CSRF token of the request's session, or None without a valid session."""
        session = request.cookies.get(self.cookie, "")
        for known, csrf in self.sessions.items():
            if hmac.compare_digest(session.encode(), known.encode()):
                return csrf
        return None


@dataclass
class Console:
    backend: Backend
    guard: Guard
    bundle: Path | None = None
    last_verify: VerifyResult | None = None
    verifying: asyncio.Lock = field(default_factory=asyncio.Lock)  # one run at a time


CONSOLE = web.AppKey("console", Console)


@functools.cache
def _templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("ztate.services.console", "templates"),
        autoescape=True,  # every template, every value
        undefined=jinja2.StrictUndefined,
        finalize=_visible,
    )


def _visible(value: Any) -> Any:
    """Every value a page shows, with the characters a reader cannot see written as
    their escapes: a right-to-left override showed a reviewer "ACCOUNT-9876" for the
    account number 6789-TNUOCCA, reversed; zero-width characters, C1 and other
    controls likewise (``printable``, as the CLI shows them)."""
    return printable(value) if isinstance(value, str) else value


def refused(status: int, title: str, text: str) -> web.Response:
    body = _templates().get_template("refused.html").render(title=title, text=text)
    return web.Response(status=status, text=body, content_type="text/html", charset="utf-8")


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """A request's ``Expect`` header, answered before any handler or middleware runs:
    ``100-continue`` as aiohttp does; any other value with the console's fixed 417 and
    its headers. aiohttp's own answer (a 417 quoting the header) skips the middlewares,
    so it went out with aiohttp's ``Server`` header and no CSP."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None
    response = refused(417, "Expectation failed", "The console takes no such Expect header.")
    response.headers.update(HEADERS)
    response.force_close()  # its body may follow, unread: the connection is not reused
    return response


@web.middleware
async def security_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers.update(HEADERS)  # a 404 of the router or of a handler
        raise
    except Exception as exc:
        # the type only: a message could hold a hostile value or a path
        LOG.error("console page %s failed: %s", request.method, type(exc).__name__)
        response = refused(500, "Internal error", "The console failed on this page.")
    for name, value in HEADERS.items():
        response.headers[name] = value
    return response


def same_origin(request: web.Request, guard: Guard) -> bool:
    """Whether a POST comes from the console's own pages.

    ``Origin`` must be this origin. Under ``Referrer-Policy: no-referrer`` Chromium sends
    ``Origin: null`` for a form post; then ``Sec-Fetch-Site`` (set by the browser, which no
    page can forge) must say ``same-origin``. Any other ``Sec-Fetch-Site`` is refused.
    """
    origin = request.headers.get("Origin")
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site != "same-origin":
        return False
    if origin == guard.origin:
        return True
    return origin == "null" and fetch_site == "same-origin"


def guard_middleware(guard: Guard) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.headers.get("Host") != guard.host:
            return refused(421, "Wrong host", f"The console answers only to {guard.host}.")
        if request.path.startswith("/static/"):
            return await handler(request)
        if request.path == "/" and "token" in request.query:
            return await handler(request)  # the exchange checks it
        csrf = guard.csrf_of(request)
        if csrf is None:
            return refused(
                401,
                "Not signed in",
                "Open the URL that ztate console printed (its token works once), "
                "or restart ztate console for a new one.",
            )
        if request.method not in ("GET", "HEAD"):
            if request.method != "POST":
                return refused(405, "Method not allowed", "Only GET and POST are served.")
            if not same_origin(request, guard):
                return refused(403, "Cross-origin request refused", "Nothing was done.")
            form = await request.post()
            offered = form.get("csrf")
            if not isinstance(offered, str) or not hmac.compare_digest(
                offered.encode(), csrf.encode()
            ):
                return refused(
                    403, "CSRF token missing or wrong", "The form was refused; nothing was done."
                )
        return await handler(request)

    return check


def _page(request: web.Request, template: str, code: int = 200, **values: Any) -> web.Response:
    console: Console = request.app[CONSOLE]
    body = (
        _templates()
        .get_template(template)
        .render(csrf=console.guard.csrf_of(request) or "", bundle=console.bundle, **values)
    )
    return web.Response(status=code, text=body, content_type="text/html", charset="utf-8")


def call_status(failed: CallFailed) -> int:
    """The HTTP status of a page whose call failed (``CALL_STATUS``, else 502)."""
    return CALL_STATUS.get(failed.code, 502)


def _see(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


async def index(request: web.Request) -> web.StreamResponse:
    guard: Guard = request.app[CONSOLE].guard
    if "token" in request.query:
        if guard.csrf_of(request) is not None:
            return _see("/reviews")  # already signed in (the token was spent here)
        session = guard.exchange(request.query["token"])
        if session is None:
            return refused(
                403,
                "Token refused",
                "This token is wrong or was already used. Restart ztate console for a new one.",
            )
        response = _see("/reviews")
        response.set_cookie(guard.cookie, session, httponly=True, samesite="Strict", path="/")
        return response
    return _see("/reviews")


async def reviews(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    status = request.query.get("status", "open")
    if status not in REVIEW_STATUSES:
        status = "open"
    try:
        rows = await console.backend.reviews(status)
    except CallFailed as failed:
        return _page(
            request, "reviews.html", call_status(failed), status=status, rows=[], error=failed
        )
    return _page(request, "reviews.html", status=status, rows=rows, error=None)


def _digest(request: web.Request) -> str:
    digest = request.match_info["digest"]
    if not DIGEST.fullmatch(digest):
        raise web.HTTPNotFound(text="not a transition digest")
    return digest


async def review(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    digest = _digest(request)
    decided = request.query.get("decided")
    try:
        found = await console.backend.review(digest)
    except CallFailed as failed:
        return _page(
            request,
            "review.html",
            call_status(failed),
            digest=digest,
            review=None,
            error=failed,
            decided=None,
        )
    return _page(
        request,
        "review.html",
        digest=digest,
        review=found,
        error=None,
        decided=decided if decided in ("approve", "reject") else None,
    )


async def decide(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    digest = _digest(request)
    form = await request.post()
    decision = form.get("decision")
    if form.get("digest") != digest or decision not in ("approve", "reject"):
        return refused(
            400, "Decision refused", "The form does not name this digest; nothing was decided."
        )
    try:
        await console.backend.decide(digest, str(decision))
    except CallFailed as failed:
        try:
            found: dict[str, Any] | None = await console.backend.review(digest)
        except CallFailed:
            found = None
        return _page(
            request,
            "review.html",
            call_status(failed),
            digest=digest,
            review=found,
            error=failed,
            decided=None,
        )
    return _see(f"/reviews/{digest}?decided={decision}")


async def threads(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    wanted = _thread_field(request.query.get("thread"))
    if wanted is not None:
        return _see(f"/threads/{quote(wanted, safe='')}")
    try:
        rows = await console.backend.threads()
    except CallFailed as failed:
        return _page(request, "threads.html", call_status(failed), rows=[], error=failed)
    return _page(request, "threads.html", rows=rows, error=None)


def _thread_field(text: str | None) -> str | None:
    """A thread id given in a query or a form (empty: none): anything the services would
    refuse as a thread id is a bad request (400), never a call, never echoed."""
    if text is None or text == "":
        return None
    if not THREAD_ID.fullmatch(text):  # the services' one rule: nothing else is asked for
        raise web.HTTPBadRequest(text="not a thread id")
    return text


def _thread_path(request: web.Request) -> str:
    """The thread id of a page's path: no such page (404) for anything else."""
    text = request.match_info["thread_id"]
    if not THREAD_ID.fullmatch(text):
        raise web.HTTPNotFound(text="not a thread id")
    return text


async def thread(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    thread_id = _thread_path(request)
    try:
        rows = await console.backend.timeline(thread_id)
        refusals = await console.backend.rejections(thread_id)
    except CallFailed as failed:
        return _page(
            request,
            "thread.html",
            call_status(failed),
            thread_id=thread_id,
            rows=[],
            refusals=[],
            error=failed,
        )
    return _page(
        request, "thread.html", thread_id=thread_id, rows=rows, refusals=refusals, error=None
    )


async def rejections(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    thread_id = _thread_field(request.query.get("thread"))
    try:
        rows = await console.backend.rejections(thread_id)
    except CallFailed as failed:
        return _page(
            request,
            "rejections.html",
            call_status(failed),
            thread_id=thread_id,
            rows=[],
            error=failed,
        )
    return _page(request, "rejections.html", thread_id=thread_id, rows=rows, error=None)


async def verify_page(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    return _page(request, "verify.html", result=console.last_verify, error=None)


async def verify_run(request: web.Request) -> web.StreamResponse:
    console: Console = request.app[CONSOLE]
    form = await request.post()
    offered = form.get("thread", "")
    if not isinstance(offered, str):  # a file where the form has a text box
        raise web.HTTPBadRequest(text="not a thread id")
    thread_id = _thread_field(offered)
    async with console.verifying:
        console.last_verify = await run_verify(console.bundle, thread_id)
    return _see("/verify")


def make_app(backend: Backend, port: int, *, bundle: Path | None = None) -> web.Application:
    """The console for ``backend``, answering at 127.0.0.1:``port``."""
    guard = Guard(port)
    app = web.Application(
        middlewares=[security_headers, guard_middleware(guard)], client_max_size=MAX_FORM_BYTES
    )
    app[CONSOLE] = Console(backend, guard, bundle)
    for method, path, handler in (
        ("GET", "/", index),
        ("GET", "/reviews", reviews),
        ("GET", r"/reviews/{digest}", review),
        ("POST", r"/reviews/{digest}/decide", decide),
        ("GET", "/threads", threads),
        ("GET", r"/threads/{thread_id}", thread),
        ("GET", "/rejections", rejections),
        ("GET", "/verify", verify_page),
        ("POST", "/verify", verify_run),
    ):
        app.router.add_route(method, path, handler, expect_handler=expect_handler)
    app.router.add_static(
        "/static/", STATIC, show_index=False, follow_symlinks=False, expect_handler=expect_handler
    )
    return app


class _ConsoleProtocol(web.RequestHandler):
    """aiohttp's HTTP/1.1 connection, with the console's answer to what its parser
    refuses. aiohttp answers those itself, outside the application and its middlewares
    (aio-libs/aiohttp#3287, #9882: no hook), with the parser's message, which quotes the
    start of the hostile line, and logs the line at ERROR."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("the response had started")
        if isinstance(exc, LineTooLong):
            response = refused(
                431,
                "Request too large",
                "A request line or header is longer than the console reads.",
            )
        elif 400 <= status < 500:
            response = refused(400, "Bad request", "The console could not read this request.")
        else:  # the type only, as the middleware: a message could hold a hostile value
            LOG.error("console request failed: %s", type(exc).__name__)
            response = refused(500, "Internal error", "The console failed on this request.")
        response.headers.update(HEADERS)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's error lines carry the exception, whose text may quote the request:
        the type only."""
        exc = kw.get("exc_info")
        LOG.error(
            "console connection failed: %s",
            type(exc).__name__ if isinstance(exc, BaseException) else "unknown error",
        )


class _ConsoleServer(web.Server):
    """aiohttp's server, making ``_ConsoleProtocol`` connections."""

    def __init__(self, handler: Any, **kwargs: Any) -> None:
        request_factory = kwargs.pop("request_factory")
        super().__init__(handler, request_factory=request_factory)
        self._protocol_args = kwargs

    def __call__(self) -> web.RequestHandler:
        return _ConsoleProtocol(self, loop=asyncio.get_running_loop(), **self._protocol_args)


class ConsoleRunner(web.AppRunner):
    """The runner of a console: no access log (the first URL carries the token), no
    signal handling of its own, and every answer the console's, even to a request
    aiohttp could not parse (``_ConsoleProtocol``)."""

    def __init__(self, app: web.Application) -> None:
        super().__init__(app, access_log=None, handle_signals=False)

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # the application started and frozen
        return _ConsoleServer(
            made.request_handler, request_factory=made.request_factory, access_log=None
        )


def guard_of(app: web.Application) -> Guard:
    console: Console = app[CONSOLE]
    return console.guard
