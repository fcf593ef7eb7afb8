"""``ztate console``: serve the web console on 127.0.0.1 until interrupted.

Like ``kubectl proxy``: the console holds the person's certificates and makes every call
with them; the browser holds only a session cookie, got by exchanging the one-time token
in the printed URL. Exit codes: 0 stopped by a signal, 2 unusable flags or credentials.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ztate.services.console.backend import Backend, Identity

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``console`` to the ``ztate`` command (imports nothing heavy until it runs)."""
    from ztate.services.cli.context import add_connection_flags
    from ztate.services.cli.resources import bounded_int

    console = subparsers.add_parser(
        "console",
        help="a local web console for reviews, threads, rejections and verification",
        description="Serves a web UI on 127.0.0.1 and prints its URL with a one-time token. "
        "Ledger pages call the transition service, review pages the approval service, each "
        "connected as every client command is: flags, then the environment, then the "
        "current context, then $ZTATE_HOME/certs (operator-admin.*, reviewer-alice.*). "
        "See docs/console.md.",
    )
    console.add_argument(
        "--port",
        type=bounded_int(0, 65535),
        default=0,
        help="port on 127.0.0.1, 0 to 65535 (default 0: a free one)",
    )
    add_connection_flags(console)
    reviewing = console.add_argument_group(
        "the approval service (flags > environment > context > $ZTATE_HOME)"
    )
    reviewing.add_argument(
        "--approval-address",
        metavar="HOST:PORT",
        help="the approval service (env ZTATE_APPROVAL_ADDRESS; default: "
        "ZTATE_APPROVAL_LISTEN on localhost)",
    )
    reviewing.add_argument("--approval-target", dest="approval_address", help=argparse.SUPPRESS)
    reviewing.add_argument(
        "--reviewer",
        metavar="NAME",
        help="use $ZTATE_HOME/certs/reviewer-NAME.crt/.key (default: the certificate the "
        "client commands use, else reviewer-alice)",
    )
    reviewing.add_argument("--reviewer-cert", type=Path, help="reviewer certificate (PEM)")
    reviewing.add_argument("--reviewer-key", type=Path, help="reviewer private key (PEM)")
    console.add_argument(
        "--verify-bundle",
        type=Path,
        help="the Verify page checks this exported bundle (default: the database of "
        "DATABASE_URL or $ZTATE_HOME/pg, as ztate verify)",
    )
    console.set_defaults(func=cmd_console)


REVIEWER_HINT = "(give --reviewer-cert/--reviewer-key and --ca-cert, or a context)"


def identities(args: argparse.Namespace) -> tuple[Identity, Identity]:
    """The operator's and the reviewer's connections, resolved as every client command's
    (services/cli/context.py: flags, environment, context, development layout)."""
    from ztate.services.cli.context import APPROVAL, TRANSITION, resolve
    from ztate.services.console.backend import Identity

    # --reviewer names the approval side's certificates only (docs/console.md): the
    # operator side resolves as `ztate ledger` would, without it
    operator = resolve(argparse.Namespace(**{**vars(args), "reviewer": None}), TRANSITION)
    reviewer = resolve(
        argparse.Namespace(
            address=args.approval_address,
            client_cert=args.reviewer_cert,
            client_key=args.reviewer_key,
            ca_cert=args.ca_cert,
            server_name=args.server_name,
            context=args.context,
            reviewer=args.reviewer,
        ),
        APPROVAL,
        {
            "address": "--approval-address",
            "client_cert": "--reviewer-cert",
            "client_key": "--reviewer-key",
        },
    )
    return (
        Identity(operator.address, operator.cert, operator.key, operator.ca, operator.server_name),
        Identity(reviewer.address, reviewer.cert, reviewer.key, reviewer.ca, reviewer.server_name),
    )


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; a path that cannot even be asked about (a name too
    long: ENAMETOOLONG, a folder that cannot be searched) is no file either."""
    try:
        return path.is_file()
    except OSError:
        return False


def cmd_console(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
        import jinja2  # noqa: F401
    except ImportError:
        print("ztate console needs its extra: pip install 'ztate[console]'", file=sys.stderr)
        return 2
    from ztate.services.cli.output import CliError
    from ztate.services.console.backend import Backend

    operator, reviewer = identities(args)
    missing = [
        str(path)
        for path in dict.fromkeys(
            (operator.cert, operator.key, reviewer.cert, reviewer.key, operator.ca, reviewer.ca)
        )
        if not _is_file(path)
    ]
    if missing:
        print(f"ztate console: cannot read {', '.join(missing)}", file=sys.stderr)
        return 2
    try:  # present is not usable: checked as every client's are (not PEM, encrypted, not
        # the certificate's key), before serving a page, and kept for the pages' calls;
        # each side names its own flags
        operator.load()
        reviewer.load(hint=REVIEWER_HINT)
    except CliError as exc:
        print(f"ztate console: {exc.message}", file=sys.stderr)
        return 2
    if args.verify_bundle is not None and not args.verify_bundle.exists():
        print(f"ztate console: no bundle at {args.verify_bundle}", file=sys.stderr)
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

    from ztate.services.console.app import ConsoleRunner, guard_of, make_app

    app = make_app(backend, port, bundle=bundle)
    runner = ConsoleRunner(app)  # no access log: the first request's URL carries the token
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
