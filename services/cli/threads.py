"""Thread administration for operators: ``ztate threads create|list|show`` and
``ztate ledger tail`` (new transitions as they commit).

Every command connects as ``services/cli/context.py`` resolves (an operator
certificate; the service decides what it may see), prints with ``-o
table|json|jsonl|yaml`` in the one shape of its resource, and exits with the CLI's
codes (3 for a thread that does not exist, 4 unreachable). gRPC and the generated
protos are imported when a command runs, never for ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from ztate.services.cli.context import add_connection_flags, run_client
from ztate.services.cli.output import (
    OK,
    Column,
    add_output_flag,
    dumps,
    emit_list,
    emit_one,
    shown,
    shown_lines,
    usage,
    write,
)
from ztate.services.cli.resources import (
    TIME_FORMS,
    as_resource,
    bounded_float,
    bounded_int,
    paged,
    parse_time,
    policy_name,
)

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
CALL_TIMEOUT_SECONDS = 30.0
MAX_LIMIT = 100_000
TAIL_PAGE = 200
TAIL_PAGES = 50
TAIL_KEPT = TAIL_PAGE * TAIL_PAGES  # new entries one look shows, the newest
TAIL_COUNT_PAGES = 500  # pages past those read only to count what is skipped
DEFAULT_LOOKBACK_SECONDS = 10.0
MAX_LOOKBACK_SECONDS = 3600.0
MAX_STATE_BYTES = 4 * 1024 * 1024


_limit = bounded_int(1, MAX_LIMIT)
_interval = bounded_float(0.05, 3600)


def _initial_state(text: str) -> bytes:
    """The initial state: JSON, or ``@path`` of a JSON file (``@-``: standard input)."""
    if text.startswith("@"):
        name = text[1:]
        try:
            if name == "-":
                raw = sys.stdin.buffer.read(MAX_STATE_BYTES + 1)
            else:  # no more than the limit is read, whatever the file (/dev/zero)
                with Path(name).open("rb") as handle:
                    raw = handle.read(MAX_STATE_BYTES + 1)
        except OSError as exc:
            usage(f"--state {text}: cannot read ({exc.strerror or exc})")
        if len(raw) > MAX_STATE_BYTES:
            usage(f"--state: more than {MAX_STATE_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            usage(f"--state {text}: not UTF-8")
    elif len(text.encode("utf-8", "surrogatepass")) > MAX_STATE_BYTES:
        usage(f"--state: more than {MAX_STATE_BYTES} bytes")
    from ztate.contract.canonical import parse_object
    from ztate.contract.errors import ContractError

    # as the service reads it (I-JSON: no NaN, integers within 2^53, no duplicate names
    # or lone surrogates, bounded nesting): refused here in one line, not a traceback
    try:
        # nesting: the most a service may be configured to take (ZTATE_MAX_JSON_DEPTH
        # is at most 128); the service refuses deeper than its own setting
        parsed = parse_object(text.encode("utf-8", "surrogatepass"), what="--state", max_depth=128)
    except ContractError as exc:
        usage(exc.message)  # a CliError shows it escaped
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()


# --- create -----------------------------------------------------------------------------


def cmd_threads_create(args: argparse.Namespace) -> int:
    """Create a thread with its initial state, bound to a policy."""
    from ztate.v1 import transition_pb2, transition_pb2_grpc

    request = transition_pb2.CreateThreadRequest(
        thread_id=args.thread,
        initial_state_json=_initial_state(args.state),
        policy=args.policy or "",
    )

    async def call(channel: Any) -> dict[str, Any]:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        response = await stub.CreateThread(request, timeout=CALL_TIMEOUT_SECONDS)
        genesis = response.genesis
        return {
            "thread_id": genesis.thread_id,
            "version": genesis.version,
            "digest": genesis.digest,
            # the same creation again (same creator, policy and state): nothing written
            "replayed": response.replayed,
        }

    created = run_client(args, call)
    emit_one(created, args.output, _created_line)
    return OK


def _created_line(created: dict[str, Any]) -> str:
    if created["replayed"]:
        return shown(
            f"{created['thread_id']} already exists with this initial state "
            f"(digest {created['digest']}): nothing written"
        )
    return shown(f"created {created['thread_id']} (digest {created['digest']})")


# --- list -------------------------------------------------------------------------------

THREAD_COLUMNS: list[Column] = [
    ("thread", lambda r: r["thread_id"]),
    ("policy", lambda r: r["policy"]),
    ("version", lambda r: r["version"]),
    ("head", lambda r: r["head_digest"][:16]),
    ("updated_at", lambda r: r["updated_at"]),
]


def cmd_threads_list(args: argparse.Namespace) -> int:
    """List threads in id order with their policy and head version."""
    from ztate.v1 import ledger_pb2, ledger_pb2_grpc

    request = ledger_pb2.ListThreadsRequest(
        policy=args.policy or "", page_size=min(args.limit, 1000)
    )

    async def call(channel: Any) -> list[dict[str, Any]]:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        return await paged(stub.ListThreads, request, lambda r: r.threads, args.limit)

    emit_list(run_client(args, call), args.output, THREAD_COLUMNS, empty="no threads match")
    return OK


# --- show -------------------------------------------------------------------------------


def _thread_text(found: dict[str, Any]) -> str:
    head = found["thread"]
    lines = [
        f"thread   {head['thread_id']}",
        f"policy   {head['policy']}",
        f"version  {head['version']}  (head {head['head_digest'][:16]})",
        f"created  {head['created_at']}",
        f"updated  {head['updated_at']}",
    ]
    for work in found["work"]:
        lines.append(
            f"  {shown(work['node']):<20} {'due' if work['due'] else 'idle':<4} "
            f"woken@{work['wake_version']} handled@{work['handled_version']} "
            f"lease={work['holder'] or '-'} epoch={work['lease_epoch']} "
            f"until={work['lease_expires_at'] or '-'}"
        )
    return shown_lines(lines)  # every value here came from the server


def cmd_threads_show(args: argparse.Namespace) -> int:
    """A thread's head and policy, and each node's work and lease on it."""
    from ztate.v1 import ledger_pb2, ledger_pb2_grpc

    request = ledger_pb2.DescribeThreadRequest(thread_id=args.thread)

    async def call(channel: Any) -> dict[str, Any]:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        return as_resource(await stub.DescribeThread(request, timeout=CALL_TIMEOUT_SECONDS))

    emit_one(run_client(args, call), args.output, _thread_text)
    return OK


# --- ledger tail ------------------------------------------------------------------------


def _entry_line(entry: dict[str, Any]) -> str:
    """One transition on one line, whatever its fields hold (a thread id, a node or a
    key from a hostile server cannot draw, retitle or write the clipboard)."""
    keys = ",".join(entry["changed_keys"]) or "-"
    return shown(
        f"{entry['at']}  {entry['thread_id']}@{entry['version']}  "
        f"{shown(entry['kind']):<10} {entry['node_id']}  keys={keys}"
    )


def _emit_entry(entry: dict[str, Any], output: str) -> None:
    if output in ("json", "jsonl"):  # a stream: one object per line either way
        write(dumps(entry, indent=None))
    elif output == "yaml":
        from ztate.services.cli.output import yaml_text

        write("---\n" + yaml_text(entry).rstrip("\n"))
    else:
        write(_entry_line(entry))


def _at(entry: Any) -> datetime:
    from datetime import UTC

    from ztate.services.cli.resources import malformed

    try:
        moment: datetime = entry.at.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise malformed("at is not a valid timestamp") from None
    return moment


class _Look:
    """One look of ``ledger tail``: the entries not shown yet, newest first, at most
    ``TAIL_KEPT``; past them, how many more unseen ones were only counted (skipped);
    whether it read back to ``since`` (``complete``), else the oldest instant it read."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.skipped = 0
        self.complete = True
        self.oldest_read: datetime | None = None

    @property
    def floor(self) -> datetime | None:
        """Where the next looks stop, when this one skipped entries or stopped reading
        before ``since``: nothing older is asked again (and a warning says so)."""
        if self.skipped:
            return _at(self.entries[-1])
        return None if self.complete else self.oldest_read


async def _look(stub: Any, thread: str, since: datetime, seen: dict[str, datetime]) -> _Look:
    """Page ListTransitions (newest first) back to ``since``, keeping what ``seen`` lacks."""
    from ztate.v1 import ledger_pb2

    request = ledger_pb2.ListTransitionsRequest(thread_id=thread, page_size=TAIL_PAGE)
    request.since.FromDatetime(since)
    found = _Look()
    for _ in range(TAIL_PAGES + TAIL_COUNT_PAGES):
        response = await stub.ListTransitions(request, timeout=CALL_TIMEOUT_SECONDS)
        if response.entries:
            found.oldest_read = _at(response.entries[-1])
        for entry in response.entries:
            if entry.digest in seen:
                continue
            if len(found.entries) < TAIL_KEPT:
                found.entries.append(entry)
            elif _at(entry) < _at(found.entries[-1]):
                found.skipped += 1
            # else: the kept oldest instant's other entries, asked again at the next look
        if not response.next_page_token:
            return found
        request.page_token = response.next_page_token
    found.complete = False
    return found


def cmd_ledger_tail(args: argparse.Namespace) -> int:
    """Follow new transitions live (Ctrl-C to stop): one look per ``--interval``,
    whatever the number of threads.

    Each look asks from ``--lookback`` seconds before the newest commit time shown (never
    before ``--since``) and prints what it has not printed yet: a commit time is taken
    before its transaction commits, so a commit can become visible after a later one was
    shown. The digests shown within that window are remembered (memory bounded by the
    window's transitions). A look keeps at most ``TAIL_KEPT`` new entries; older new
    ones are counted and reported on stderr, never dropped silently."""
    import asyncio
    from datetime import UTC, timedelta

    from ztate.v1 import ledger_pb2_grpc

    start = datetime.now(UTC) - timedelta(seconds=1)
    if args.since:
        start = parse_time(args.since, "--since")
    lookback = timedelta(seconds=args.lookback)

    async def call(channel: Any) -> int:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        shown, floor = 0, start
        newest: datetime | None = None  # the newest commit time shown
        seen: dict[str, datetime] = {}  # digest -> commit time, within the window
        while args.count is None or shown < args.count:
            since = floor if newest is None else max(floor, newest - lookback)
            look = await _look(stub, args.thread or "", since, seen)
            if look.floor is not None:
                floor = look.floor
                _warn_skipped(look, since, floor)
            for entry in reversed(look.entries):  # oldest first
                seen[entry.digest] = _at(entry)
                _emit_entry(as_resource(entry), args.output)
                shown += 1
                if args.count is not None and shown >= args.count:
                    return shown
            if look.entries:
                latest = _at(look.entries[0])
                newest = latest if newest is None else max(newest, latest)
            if newest is not None:  # what no later look can return is forgotten
                window = max(floor, newest - lookback)
                seen = {digest: at for digest, at in seen.items() if at >= window}
            await asyncio.sleep(args.interval)  # the follow interval, not synchronisation
        return shown

    run_client(args, call)
    return OK


def _warn_skipped(look: _Look, since: datetime, floor: datetime) -> None:
    span = f"committed from {_rfc3339(since)} to before {_rfc3339(floor)}"
    if look.skipped:
        count = f"{look.skipped}" if look.complete else f"at least {look.skipped}"
        said = (
            f"{count} transitions {span} were skipped: more than {TAIL_KEPT} new ones in "
            "one look (narrow with --thread, or a later --since)"
        )
    else:
        read = (TAIL_PAGES + TAIL_COUNT_PAGES) * TAIL_PAGE
        said = (
            f"transitions {span} were not checked: more than {read} in one look "
            "(narrow with --thread, or a smaller --lookback)"
        )
    print(f"ztate ledger tail: {said}", file=sys.stderr, flush=True)


def _rfc3339(moment: datetime) -> str:
    """As an entry's ``at`` is printed (protobuf's JSON form of a Timestamp)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    stamp = Timestamp()
    stamp.FromDatetime(moment)
    text: str = stamp.ToJsonString()
    return text


# --- registration -----------------------------------------------------------------------


def register(commands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``threads create|list|show`` and ``ledger tail`` to the ``ztate`` command."""
    from ztate.services.cli.main import group

    threads = group(commands, "threads", "operate on threads")
    create = threads.add_parser("create", help="create a thread with its initial state")
    create.add_argument("thread", metavar="THREAD", help="the new thread's id")
    create.add_argument(
        "--state", required=True, help="initial state: JSON, or @FILE (@- for standard input)"
    )
    create.add_argument(
        "--policy", type=policy_name, help="the policy (default: the only one loaded)"
    )
    add_output_flag(create)
    add_connection_flags(create)
    create.set_defaults(func=cmd_threads_create)

    listing = threads.add_parser("list", help="list threads in id order")
    listing.add_argument("--policy", type=policy_name, help="only threads of this policy")
    listing.add_argument("--limit", type=_limit, default=100, help="at most N (default 100)")
    add_output_flag(listing)
    add_connection_flags(listing)
    listing.set_defaults(func=cmd_threads_list)

    show = threads.add_parser("show", help="a thread's head, policy, and its nodes' work")
    show.add_argument("thread", metavar="THREAD", help="the thread")
    add_output_flag(show)
    add_connection_flags(show)
    show.set_defaults(func=cmd_threads_show)

    ledger = group(commands, "ledger", "query, export and prune the ledger")
    tail = ledger.add_parser("tail", help="follow new transitions live (Ctrl-C stops)")
    tail.add_argument("--thread", help="one thread only")
    tail.add_argument("--since", metavar="WHEN", help=f"start from: {TIME_FORMS} (default: now)")
    tail.add_argument(
        "--interval", type=_interval, default=1.0, help="seconds between looks (default 1)"
    )
    tail.add_argument("--count", type=_limit, help="stop after this many transitions")
    tail.add_argument(
        "--lookback",
        type=bounded_float(0, MAX_LOOKBACK_SECONDS),
        default=DEFAULT_LOOKBACK_SECONDS,
        metavar="SECONDS",
        help="also print a commit that becomes visible up to this long after its commit "
        f"time, behind later ones already printed (0 to {MAX_LOOKBACK_SECONDS:g}; "
        f"default {DEFAULT_LOOKBACK_SECONDS:g})",
    )
    add_output_flag(tail, stream=True)
    add_connection_flags(tail)
    tail.set_defaults(func=cmd_ledger_tail)
