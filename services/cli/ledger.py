"""``ztate ledger ...`` and ``ztate threads revert``: the operator's client commands.

Each connects as ``services/cli/context.py`` resolves (flags, environment, context,
development layout) and prints with ``-o table|json|jsonl|yaml`` in the one shape of
its resource (``services/cli/resources.py``). gRPC and the generated protos are
imported when a command runs, never for ``--help``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from ztate.services.cli.context import TRANSITION, add_connection_flags, resolve, run_client
from ztate.services.cli.output import (
    NOT_FOUND,
    OK,
    UNREACHABLE,
    USAGE,
    CliError,
    Column,
    add_output_flag,
    dumps,
    emit_list,
    emit_one,
    shown,
    shown_lines,
    usage,
)
from ztate.services.cli.resources import (
    MAX_VERSION,
    TIME_FORMS,
    as_resource,
    bounded_float,
    bounded_int,
    paged,
    parse_time,
)

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?\Z")  # runtime.identity.NAME
MAX_LIMIT = 100_000
CALL_TIMEOUT_SECONDS = 30.0
TRANSITION_STATUSES = ("committed", "pending", "rejected", "expired", "stale")
STATUS_ALIASES = {"open": "pending"}  # the approval service's word for a parked proposal


# --- flags ------------------------------------------------------------------------------


def limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_LIMIT}")
    return value


def trust_domain(args: argparse.Namespace) -> str:
    """``ZTATE_TRUST_DOMAIN``, else the one in the client certificate, else the default."""
    explicit = os.environ.get("ZTATE_TRUST_DOMAIN")
    if explicit:
        return explicit
    try:
        from ztate.services.cli.ca import Issued

        for uri in Issued.read(resolve(args, TRANSITION).cert).uris:
            if uri.startswith("spiffe://"):
                return uri.removeprefix("spiffe://").split("/", 1)[0]
    except (OSError, ValueError):
        pass
    return "ztate.local"


def node_id(args: argparse.Namespace) -> str:
    """``--node``: a SPIFFE ID, or a node's short name (``planner``) in this trust domain."""
    given: str | None = args.node
    if not given:
        return ""
    if given.startswith("spiffe://"):
        return given
    if not NAME.fullmatch(given):
        usage(f"--node {given!r}: a node name ({NAME.pattern}) or a full SPIFFE ID")
    return f"spiffe://{trust_domain(args)}/node/{given}"


def add_time_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", metavar="WHEN", help=f"not before: {TIME_FORMS}")
    parser.add_argument("--until", metavar="WHEN", help=f"not after: {TIME_FORMS}")


def _set_times(request: Any, args: argparse.Namespace) -> None:
    for flag in ("since", "until"):
        text = getattr(args, flag)
        if text:
            getattr(request, flag).FromDatetime(parse_time(text, f"--{flag}"))


# --- rejections -------------------------------------------------------------------------

REJECTION_COLUMNS: list[Column] = [
    ("rejected_at", lambda r: r["rejected_at"]),
    ("reason", lambda r: r["reason"]),
    ("thread", lambda r: r["thread_id"]),
    ("base", lambda r: r["base_version"]),
    ("node", lambda r: r["node_id"]),
    ("keys", lambda r: r["keys"]),
]


def cmd_rejections(args: argparse.Namespace) -> int:
    """List refused proposals, newest first."""
    from ztate.v1 import ledger_pb2, ledger_pb2_grpc

    request = ledger_pb2.ListRejectionsRequest(
        thread_id=args.thread or "",
        node_id=node_id(args),
        reason=args.reason or "",
        page_size=min(args.limit, 1000),
    )
    _set_times(request, args)

    async def call(channel: Any) -> list[dict[str, Any]]:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        return await paged(stub.ListRejections, request, lambda r: r.rejections, args.limit)

    rows = run_client(args, call)
    emit_list(rows, args.output, REJECTION_COLUMNS, empty="no rejections match")
    return OK


# --- list -------------------------------------------------------------------------------

TRANSITION_COLUMNS: list[Column] = [
    ("at", lambda r: r["at"]),
    ("status", lambda r: r["status"]),
    ("thread", lambda r: r["thread_id"]),
    ("version", lambda r: r["version"]),
    ("kind", lambda r: r["kind"]),
    ("digest", lambda r: r["digest"][:16]),
    ("node", lambda r: r["node_id"]),
    ("keys", lambda r: r["changed_keys"]),
    ("receipt", lambda r: r["has_receipt"]),
]


def cmd_list(args: argparse.Namespace) -> int:
    """List transitions (or parked proposals by status), newest first."""
    from ztate.v1 import ledger_pb2, ledger_pb2_grpc

    status = STATUS_ALIASES.get(args.status or "", args.status or "")
    request = ledger_pb2.ListTransitionsRequest(
        thread_id=args.thread or "",
        node_id=node_id(args),
        changed_key=args.changed_key or "",
        status="" if status == "committed" else status,
        page_size=min(args.limit, 1000),
    )
    _set_times(request, args)

    async def call(channel: Any) -> list[dict[str, Any]]:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        return await paged(stub.ListTransitions, request, lambda r: r.entries, args.limit)

    rows = run_client(args, call)
    emit_list(rows, args.output, TRANSITION_COLUMNS, empty="no transitions match")
    return OK


# --- show -------------------------------------------------------------------------------


def _detail_text(detail: dict[str, Any]) -> str:
    from ztate.services.cli.output import dumps

    entry = detail["entry"]
    receipt = detail.get("receipt")
    state = dumps(detail["state"], indent=None) if detail["state_kept"] else "(pruned)"
    lines = [
        f"{entry['thread_id']}@{entry['version']}  {entry['kind']}",
        f"digest     {entry['digest']}",
        f"parent     {entry['parent_digest']}",
        f"node       {entry['node_id']}",
        f"committed  {entry['at']}",
        f"key id     {detail['key_id'] or '-'}  signature {detail['signature'] or '-'}",
        f"patch      {dumps(detail['patch'], indent=None)}",
        f"state      {state}",
    ]
    if receipt:
        lines.append(f"receipt    {dumps(receipt, indent=None)}")
        lines.append(f"           key {detail['receipt_key_id'] or '-'}")
    else:
        lines.append("receipt    none")
    return shown_lines(lines)  # ids, node, key ids: as the server sent them


def cmd_show(args: argparse.Namespace) -> int:
    """One committed record with its patch, state (if kept) and receipt."""
    from ztate.v1 import ledger_pb2, ledger_pb2_grpc

    if bool(args.digest) == (args.thread is not None):
        usage("ledger show: give DIGEST, or --thread and --version")
    if args.thread is not None and args.version is None:
        usage("ledger show: --thread needs --version")
    request = ledger_pb2.GetTransitionDetailRequest(
        digest=args.digest or "", thread_id=args.thread or "", version=args.version or 0
    )

    async def call(channel: Any) -> dict[str, Any]:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        return as_resource(await stub.GetTransitionDetail(request, timeout=CALL_TIMEOUT_SECONDS))

    emit_one(run_client(args, call), args.output, _detail_text)
    return OK


# --- history ----------------------------------------------------------------------------

CHANGE_COLUMNS: list[Column] = [
    ("version", lambda r: r["version"]),
    ("committed_at", lambda r: r["committed_at"]),
    ("node", lambda r: r["node_id"]),
    # as JSON: a string is quoted (it cannot pass for "(removed)" or a list), and what a
    # terminal would act on is escaped
    ("value", lambda r: "(removed)" if r["removed"] else dumps(r["value"], indent=None)),
]


def cmd_history(args: argparse.Namespace) -> int:
    """The values one key took across a thread, oldest first."""
    import grpc

    from ztate.v1 import ledger_pb2, ledger_pb2_grpc

    request = ledger_pb2.KeyHistoryRequest(
        thread_id=args.thread, key=args.state_key, page_size=min(args.limit, 1000)
    )

    async def call(channel: Any) -> list[dict[str, Any]] | None:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        found = await paged(stub.KeyHistory, request, lambda r: r.changes, args.limit)
        if found:
            return found
        try:  # nothing changed it: does the thread exist at all? (its genesis is version 0)
            await stub.GetTransitionDetail(
                ledger_pb2.GetTransitionDetailRequest(thread_id=args.thread, version=0),
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return found

    rows = run_client(args, call)
    if rows is None:
        raise CliError(f"no thread {args.thread!r}", NOT_FOUND)
    emit_list(
        rows,
        args.output,
        CHANGE_COLUMNS,
        empty=f"{args.state_key} never changed in {args.thread}",
    )
    return OK


# --- prune ------------------------------------------------------------------------------


def _confirm(question: str) -> bool:
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    return answer.strip().lower() in {"y", "yes"}


def cmd_prune(args: argparse.Namespace) -> int:
    """Prune old state bodies; every record, digest and signature stays."""
    import asyncio
    from datetime import timedelta

    import asyncpg

    from ztate.services.cli.verify import database_dsn, settings_or_verify_error
    from ztate.services.store.retention import Limits, RetentionError, prune
    from ztate.services.store.waiting import first_line
    from ztate.services.verify.checks import VerifyError

    dsn: str | None = None
    try:
        limits = Limits(
            keep_versions=args.keep_versions,
            older_than=None if args.older_than is None else timedelta(days=args.older_than),
        )
        dsn, _embedded = database_dsn(settings_or_verify_error())
        would = asyncio.run(prune(dsn, limits, thread_id=args.thread, dry_run=True))
        if args.dry_run:
            print(f"would prune {would} state bodies (dry run: nothing changed)")
            return OK
        if would and not args.yes:
            if not sys.stdin.isatty():
                usage(
                    f"ledger prune would drop {would} state bodies for good: "
                    "confirm with --yes (or look first with --dry-run)"
                )
            if not _confirm(f"Prune {would} state bodies (records and digests stay)?"):
                print("nothing pruned", file=sys.stderr)
                return OK
        pruned = asyncio.run(prune(dsn, limits, thread_id=args.thread))
    except (RetentionError, VerifyError) as exc:
        raise CliError(f"ledger prune: {exc}", USAGE) from None
    except (OSError, TimeoutError) as exc:  # refused, timed out, lost: one line, exit 4
        said = first_line(exc, dsn)
        raise CliError(
            f"ledger prune: the database is not reachable: {said} ({type(exc).__name__})",
            UNREACHABLE,
        ) from None
    except (ValueError, OverflowError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        said = first_line(exc, dsn)  # a DSN it cannot use (a port past 65535), a privilege,
        # a lock: exit 1
        failed = f"ledger prune: the database failed: {said} ({type(exc).__name__})"
        raise CliError(failed) from None
    print(f"pruned {pruned} state bodies; every record, digest and signature is kept")
    return OK


# --- threads revert ---------------------------------------------------------------------


def cmd_revert(args: argparse.Namespace) -> int:
    """Append a transition restoring an earlier state; history is never rewritten."""
    import uuid

    from ztate.v1 import transition_pb2, transition_pb2_grpc

    request = transition_pb2.RevertThreadRequest(
        thread_id=args.thread,
        to_version=args.to,
        idempotency_key=args.idempotency_key or f"revert-{uuid.uuid4().hex}",
    )

    async def call(channel: Any) -> Any:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        return await stub.RevertThread(request, timeout=CALL_TIMEOUT_SECONDS)

    response = run_client(args, call)
    reverted = {
        "reverted_to": args.to,
        "replayed": response.replayed,
        "transition": as_resource(response.transition),
    }

    def text(doc: dict[str, Any]) -> str:
        done = doc["transition"]
        again = " (already done: this idempotency key was used)" if doc["replayed"] else ""
        return shown(
            f"thread {done['thread_id']} reverted to the state of version {args.to}{again}: "
            f"new version {done['version']}, digest {done['digest']}, by {done['node_id']}"
        )

    emit_one(reverted, args.output, text)
    return OK


# --- registration -----------------------------------------------------------------------


def register(commands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``ledger`` (rejections, list, show, history, export, prune) and ``threads
    revert`` to the ``ztate`` command."""
    from ztate.services.cli.main import group
    from ztate.services.cli.verify import add_export_command

    ledger = group(commands, "ledger", "query, export and prune the ledger")

    rejections = ledger.add_parser("rejections", help="list refused proposals, newest first")
    rejections.add_argument("--thread", help="only this thread")
    rejections.add_argument("--node", help="only this node: a name (planner) or a SPIFFE ID")
    rejections.add_argument("--reason", help="only this reason, e.g. KEY_NOT_WRITABLE")
    add_time_flags(rejections)
    rejections.add_argument("--limit", type=limit, default=50, help="at most N (default 50)")
    add_output_flag(rejections)
    add_connection_flags(rejections)
    rejections.set_defaults(func=cmd_rejections)

    listing = ledger.add_parser("list", help="list transitions, newest first")
    listing.add_argument("--thread", help="only this thread")
    listing.add_argument("--node", help="only this node: a name (planner) or a SPIFFE ID")
    listing.add_argument(
        "--changed-key", dest="changed_key", help="only records whose patch touches this key"
    )
    listing.add_argument(
        "--status",
        choices=(*TRANSITION_STATUSES, *STATUS_ALIASES),
        help="committed (default), or parked proposals: pending (= open), rejected, expired, stale",
    )
    add_time_flags(listing)
    listing.add_argument("--limit", type=limit, default=50, help="at most N (default 50)")
    add_output_flag(listing)
    add_connection_flags(listing)
    listing.set_defaults(func=cmd_list)

    show = ledger.add_parser(
        "show", help="one record by digest or --thread/--version, with patch, state, receipt"
    )
    show.add_argument("digest", nargs="?", metavar="DIGEST", help="the record's digest")
    show.add_argument("--thread", help="the thread (with --version)")
    show.add_argument(
        "--version", type=bounded_int(0, MAX_VERSION), help="the version (with --thread)"
    )
    add_output_flag(show)
    add_connection_flags(show)
    show.set_defaults(func=cmd_show)

    history = ledger.add_parser("history", help="the values one state key took, oldest first")
    history.add_argument("thread", metavar="THREAD", help="the thread")
    history.add_argument(
        "state_key", metavar="STATE_KEY", help="a top-level key of the thread's state"
    )
    history.add_argument(
        "--limit", type=limit, default=1000, help="at most N, the oldest (default 1000)"
    )
    add_output_flag(history)
    add_connection_flags(history)
    history.set_defaults(func=cmd_history)

    add_export_command(ledger)

    prune = ledger.add_parser(
        "prune",
        help="drop old state bodies (records, digests and signatures stay)",
        description="Irreversible: asks first on a terminal; elsewhere needs --yes. "
        "--dry-run counts what would go and changes nothing.",
    )
    prune.add_argument(
        "--keep-versions", type=bounded_int(0, MAX_VERSION), help="keep the newest N state bodies"
    )
    prune.add_argument(
        "--older-than",
        type=bounded_float(0, 365_000),
        metavar="DAYS",
        help="prune bodies older (0 to 365000 days)",
    )
    prune.add_argument("--thread", help="one thread only (default: every thread)")
    prune.add_argument("--dry-run", action="store_true", help="count only; change nothing")
    prune.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    prune.set_defaults(func=cmd_prune)

    threads = group(commands, "threads", "operate on threads")
    revert = threads.add_parser(
        "revert", help="append a transition restoring the state of an earlier version"
    )
    revert.add_argument("thread", metavar="THREAD", help="the thread")
    revert.add_argument(
        "--to",
        type=bounded_int(0, MAX_VERSION),
        required=True,
        metavar="VERSION",
        help="the version",
    )
    revert.add_argument(
        "--idempotency-key", help="retry-safe key of this revert (default: a new random one)"
    )
    add_output_flag(revert)
    add_connection_flags(revert)
    revert.set_defaults(func=cmd_revert)
