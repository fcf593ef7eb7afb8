"""``ztate console``: serve the web console on 127.0.0.1 until interrupted.

Like ``kubectl proxy``: the console holds the person's certificates and makes every call
with them; the browser holds only a session cookie, got by exchanging the one-time token
in the printed URL. Exit codes: 0 stopped by a signal, 2 unusable flags or credentials.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ztate.services.console.backend import Backend

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
DEFAULT_TARGET = "127.0.0.1:7443"
DEFAULT_APPROVAL_TARGET = "127.0.0.1:7444"


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``console`` to the ``ztate`` command (imports nothing heavy until it runs)."""
    console = subparsers.add_parser(
        "console",
        help="a local web console for reviews, threads, rejections and verification",
        description="Serves a web UI on 127.0.0.1 and prints its URL with a one-time token. "
        "Ledger pages use the operator certificate, review pages the reviewer certificate "
        "(defaults: $ZTATE_HOME/certs/operator-admin.* and reviewer-<name>.*). "
        "See docs/console.md.",
    )
    console.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: free)")
    console.add_argument(
        "--target",
        default=os.environ.get("ZTATE_LISTEN", DEFAULT_TARGET),
        help="host:port of the transition service (default: ZTATE_LISTEN or %(default)s)",
    )
    console.add_argument("--cert", type=Path, help="operator certificate (PEM)")
    console.add_argument("--key", type=Path, help="operator private key (PEM)")
    console.add_argument("--ca", type=Path, help="CA certificate (PEM)")
    console.add_argument(
        "--approval-target",
        default=os.environ.get("ZTATE_APPROVAL_LISTEN", DEFAULT_APPROVAL_TARGET),
        help="host:port of the approval service (default: ZTATE_APPROVAL_LISTEN or %(default)s)",
    )
    console.add_argument(
        "--reviewer", default="alice", help="picks $ZTATE_HOME/certs/reviewer-<name>.crt/.key"
    )
    console.add_argument("--reviewer-cert", type=Path, help="reviewer certificate (PEM)")
    console.add_argument("--reviewer-key", type=Path, help="reviewer private key (PEM)")
    console.add_argument("--server-name", help="expected server name, if not the target host")
    console.add_argument(
        "--verify-bundle",
        type=Path,
        help="the Verify page checks this exported bundle (default: the database of "
        "DATABASE_URL or $ZTATE_HOME/pg, as ztate verify)",
    )
    console.set_defaults(func=cmd_console)


def cmd_console(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError:
        print("ztate console needs its extra: pip install 'ztate[console]'", file=sys.stderr)
        return 2
    from ztate.services.console.backend import Backend, Identity

    home = Path(os.environ.get("ZTATE_HOME", ".ztate"))
    certs = home / "certs"
    ca = args.ca or certs / "ca.crt"
    operator = Identity(
        args.target,
        args.cert or certs / "operator-admin.crt",
        args.key or certs / "operator-admin.key",
        ca,
        args.server_name,
    )
    reviewer = Identity(
        args.approval_target,
        args.reviewer_cert or certs / f"reviewer-{args.reviewer}.crt",
        args.reviewer_key or certs / f"reviewer-{args.reviewer}.key",
        ca,
        args.server_name,
    )
    missing = [
        str(path)
        for path in (operator.cert, operator.key, reviewer.cert, reviewer.key, ca)
        if not path.is_file()
    ]
    if missing:
        print(f"ztate console: cannot read {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.verify_bundle is not None and not args.verify_bundle.exists():
        print(f"ztate console: no bundle at {args.verify_bundle}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print("ztate console: --port must be 0..65535", file=sys.stderr)
        return 2
    try:
        import asyncio

        asyncio.run(_serve(Backend(operator, reviewer), args.port, args.verify_bundle))
    except OSError as exc:
        print(f"ztate console: cannot listen on 127.0.0.1:{args.port}: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve(backend: Backend, port: int, bundle: Path | None) -> None:
    from aiohttp import web

    from ztate.services.console.app import guard_of, make_app

    app = make_app(backend, port, bundle=bundle)
    # no access log: the first request's URL carries the token
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    guard = guard_of(app)
    guard.port = bound
    print(f"ztate console: {guard.origin}/?token={guard.token}", flush=True)
    print(
        "  the token works once; this console uses your certificates. Ctrl-C stops it.", flush=True
    )
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
