"""Thread administration for operators: ``ztate threads create|list|show`` and
``ztate ledger tail`` (new transitions as they commit).

Every command is a gRPC client authenticated by an operator certificate
(``operator_client``); the service decides what it may see.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from ztate.services.cli.operator_client import add_connection_flags, operator_channel
from ztate.services.runtime.config import Settings
from ztate.v1 import ledger_pb2, ledger_pb2_grpc, transition_pb2, transition_pb2_grpc

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
_T = TypeVar("_T")
TAIL_PAGE = 200
TAIL_PAGES = 50  # a backlog larger than this is shown from its newest part


def _home() -> Path:
    return Settings().home


def _as_dict(message: Any) -> dict[str, Any]:
    found: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return found


def _run(call: Coroutine[Any, Any, _T]) -> _T | None:
    """Run one client call; a printed error and None when it fails."""
    try:
        return asyncio.run(call)
    except grpc.aio.AioRpcError as error:
        print(f"ztate: {error.code().name}: {error.details()}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"ztate: {exc}", file=sys.stderr)
    return None


def _initial_state(text: str) -> bytes:
    """The initial state: JSON, or ``@path`` of a JSON file (``-``: standard input)."""
    if text.startswith("@"):
        name = text[1:]
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the initial state is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("the initial state must be a JSON object")
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()


async def _create(args: argparse.Namespace) -> dict[str, Any]:
    request = transition_pb2.CreateThreadRequest(
        thread_id=args.thread, initial_state_json=_initial_state(args.state), policy=args.policy
    )
    async with operator_channel(args, _home()) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        response = await stub.CreateThread(request, timeout=30)
    genesis = response.genesis
    return {"thread_id": genesis.thread_id, "version": genesis.version, "digest": genesis.digest}


def cmd_threads_create(args: argparse.Namespace) -> int:
    """Create a thread with its initial state, bound to a policy."""
    created = _run(_create(args))
    if created is None:
        return 1
    print(json.dumps(created, sort_keys=True) if args.json else f"created {created['thread_id']}")
    return 0


async def _list(args: argparse.Namespace) -> list[dict[str, Any]]:
    request = ledger_pb2.ListThreadsRequest(
        policy=args.policy or "", page_size=min(args.limit, 1000)
    )
    found: list[dict[str, Any]] = []
    async with operator_channel(args, _home()) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        while len(found) < args.limit:
            response = await stub.ListThreads(request, timeout=30)
            found += [_as_dict(thread) for thread in response.threads]
            if not response.next_page_token:
                break
            request.page_token = response.next_page_token
    return found[: args.limit]


def cmd_threads_list(args: argparse.Namespace) -> int:
    """List threads in id order with their policy and head version."""
    rows = _run(_list(args))
    if rows is None:
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0
    for row in rows:
        print(
            f"{row['thread_id']}  {row['policy']:<16} v{row.get('version', 0):<6} "
            f"{row.get('updated_at', '-')}"
        )
    if not rows:
        print("no threads match")
    return 0


async def _show(args: argparse.Namespace) -> dict[str, Any]:
    async with operator_channel(args, _home()) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        response = await stub.DescribeThread(
            ledger_pb2.DescribeThreadRequest(thread_id=args.thread), timeout=30
        )
    return _as_dict(response)


def cmd_threads_show(args: argparse.Namespace) -> int:
    """A thread's head and policy, and each node's work and lease on it."""
    found = _run(_show(args))
    if found is None:
        return 1
    if args.json:
        print(json.dumps(found, sort_keys=True))
        return 0
    head = found["thread"]
    print(f"thread   {head['thread_id']}")
    print(f"policy   {head['policy']}")
    print(f"version  {head.get('version', 0)}  ({head['head_digest'][:16]})")
    print(f"created  {head['created_at']}")
    print(f"updated  {head['updated_at']}")
    for work in found.get("work", []):
        state = "due" if work.get("due") else "idle"
        holder = work.get("holder") or "-"
        print(
            f"  {work['node']:<20} {state:<4} woken@{work.get('wake_version', 0)} "
            f"handled@{work.get('handled_version', 0)} lease={holder} "
            f"epoch={work.get('lease_epoch', 0)} until={work.get('lease_expires_at', '-')}"
        )
    return 0


def _entry_line(entry: dict[str, Any]) -> str:
    keys = ",".join(entry.get("changed_keys", [])) or "-"
    return (
        f"{entry['at']}  {entry['thread_id']}@{entry.get('version', 0)}  "
        f"{entry.get('kind', '-'):<10} {entry['node_id']}  keys={keys}"
    )


async def _tail(args: argparse.Namespace) -> int:
    """Every committed transition from now (or ``--since``), as it commits: one page
    query per ``--interval``, whatever the number of threads."""
    since = (
        datetime.fromisoformat(args.since.replace("Z", "+00:00"))
        if args.since
        else datetime.now(UTC) - timedelta(seconds=1)
    )
    seen: set[str] = set()
    async with operator_channel(args, _home()) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        shown = 0
        while args.count is None or shown < args.count:
            request = ledger_pb2.ListTransitionsRequest(
                thread_id=args.thread or "", page_size=TAIL_PAGE
            )
            request.since.FromDatetime(since)
            entries: list[ledger_pb2.LedgerEntry] = []
            for _ in range(TAIL_PAGES):  # newest first: back to `since`, printed oldest first
                response = await stub.ListTransitions(request, timeout=30)
                entries += response.entries
                if not response.next_page_token:
                    break
                request.page_token = response.next_page_token
            for entry in reversed(entries):
                if entry.digest in seen:
                    continue
                seen.add(entry.digest)
                row = _as_dict(entry)
                print(json.dumps(row, sort_keys=True) if args.json else _entry_line(row))
                shown += 1
                if args.count is not None and shown >= args.count:
                    break
            if entries:
                newest = max(e.at.ToDatetime(tzinfo=UTC) for e in entries)
                # keep the digests of the newest moment only: earlier ones fall out of range
                since = newest
                seen = {e.digest for e in entries if e.at.ToDatetime(tzinfo=UTC) == newest}
            sys.stdout.flush()
            if args.count is None or shown < args.count:
                await asyncio.sleep(args.interval)  # the follow interval
    return shown


def cmd_ledger_tail(args: argparse.Namespace) -> int:
    """Follow new transitions live (Ctrl-C to stop)."""
    with contextlib.suppress(KeyboardInterrupt):
        if _run(_tail(args)) is None:
            return 1
    return 0


def add_thread_commands(
    threads: Subparsers[argparse.ArgumentParser], ledger: Subparsers[argparse.ArgumentParser]
) -> None:
    """``threads create|list|show`` and ``ledger tail``."""
    create = threads.add_parser("create", help="create a thread with its initial state")
    create.add_argument("thread")
    create.add_argument(
        "--state", required=True, help="initial state: JSON, or @FILE (@- for standard input)"
    )
    create.add_argument("--policy", default="", help="default: the only policy loaded")
    create.add_argument("--json", action="store_true", help="one JSON object")
    add_connection_flags(create)
    create.set_defaults(func=cmd_threads_create)
    listing = threads.add_parser("list", help="list threads in id order")
    listing.add_argument("--policy", help="only threads of this policy")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    add_connection_flags(listing)
    listing.set_defaults(func=cmd_threads_list)
    show = threads.add_parser("show", help="a thread's head, policy, and its nodes' work")
    show.add_argument("thread")
    show.add_argument("--json", action="store_true", help="one JSON object")
    add_connection_flags(show)
    show.set_defaults(func=cmd_threads_show)
    tail = ledger.add_parser("tail", help="follow new transitions live")
    tail.add_argument("--thread", help="one thread only")
    tail.add_argument("--since", help="RFC 3339 time to start from (default: now)")
    tail.add_argument("--interval", type=float, default=1.0, help="seconds between looks")
    tail.add_argument("--count", type=int, help="stop after this many transitions")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    add_connection_flags(tail)
    tail.set_defaults(func=cmd_ledger_tail)
