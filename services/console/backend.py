"""The console's gRPC side: every call made with the person's own certificates.

Ledger pages use the operator certificate against the transition service; review pages
use the reviewer certificate against the approval service, which knows who decided from
that certificate alone (a node's certificate is refused there, whatever the console does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from ztate.services.cli.context import CLIENT_HINT, connect
from ztate.services.cli.output import CliError
from ztate.services.runtime.reloading import Stamp, stamp
from ztate.v1 import approval_pb2, approval_pb2_grpc, ledger_pb2, ledger_pb2_grpc
from ztate.worker_sdk.errors import from_rpc_error

DIGEST = re.compile(r"[0-9a-f]{64}")
CALL_TIMEOUT_SECONDS = 15.0
PAGE_SIZE = 100
MAX_ROWS = 500  # one page of the console never shows more than this
DELIVERY_WAIT_SECONDS = 10.0
TIMELINE_ROWS = 50  # the newest versions of a thread, each with its patch
DETAILS_AT_ONCE = 4  # details (each with a whole state) in flight for one timeline
T = TypeVar("T")

STATUS_NAMES = {
    "open": approval_pb2.REVIEW_STATUS_OPEN,
    "approved": approval_pb2.REVIEW_STATUS_APPROVED,
    "rejected": approval_pb2.REVIEW_STATUS_REJECTED,
    "expired": approval_pb2.REVIEW_STATUS_EXPIRED,
}
LOG = logging.getLogger("ztate.console")
# A page whose channel cannot be opened because the console's own certificate, key or
# CA file went away or became unreadable while it runs: a code of the console's own,
# given its HTTP status with the gRPC codes' (app.CALL_STATUS), and a fixed text.
CREDENTIALS_UNREADABLE = "CREDENTIALS_UNREADABLE"
CREDENTIALS_TEXT = "the console cannot read its credentials"
STATUS_OF = {value: name for name, value in STATUS_NAMES.items()}
DECISIONS = {"approve": approval_pb2.DECISION_APPROVE, "reject": approval_pb2.DECISION_REJECT}


@dataclass
class Identity:
    """One certificate the console presents, and where to.

    Its files are read and checked once (as every client command's: ``connect`` in
    services/cli/context.py), and again only when they change on disk (``stamp``: inode,
    size, modification time), so that a renewed certificate is used from the next page
    on. Files that went away, or changed into files that cannot be read or used, are
    ``CliError`` at every page until they are back: never the old credentials for files
    that are no longer there."""

    target: str
    cert: Path
    key: Path
    ca: Path
    server_name: str | None = None
    # the channel opener ``connect`` made and the files' stamp it was made at
    _opener: tuple[Stamp, Callable[[], Any]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def load(self, hint: str = CLIENT_HINT) -> Callable[[], Any]:
        """The channel opener, the files read and checked first if they changed since
        (``CliError`` naming a file that cannot be read or used, and ``hint``)."""
        now = stamp((self.cert, self.key, self.ca))  # before reading: a change after it is seen
        if self._opener is None or self._opener[0] != now:
            self._opener = None  # nothing of files that are no longer there
            self._opener = (
                now,
                connect(self.target, self.cert, self.key, self.ca, self.server_name, hint=hint),
            )
        return self._opener[1]

    def channel(self) -> grpc.aio.Channel:
        """A channel as every client command opens it (services/cli/context.py)."""
        channel: grpc.aio.Channel = self.load()()
        return channel


class CallFailed(Exception):
    """A refused or failed call, as the console shows it: status, reason and message."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


def _failed(error: grpc.aio.AioRpcError) -> CallFailed:
    typed = from_rpc_error(error)
    return CallFailed(error.code().name, typed.reason, error.details() or "")


def rejection_view(row: ledger_pb2.Rejection) -> dict[str, Any]:
    return {
        "rejected_at": row.rejected_at.ToJsonString(),
        "method": row.method,
        "node_id": row.node_id,
        "thread_id": row.thread_id,
        "base_version": row.base_version,
        "reason": row.reason,
        "keys": list(row.keys),
        "patch_digest": row.patch_digest,
        "patch_bytes": row.patch_bytes,
        "message": row.message,
    }


def _json_or_text(text: str | bytes) -> Any:
    try:
        return json.loads(text or "null")
    except ValueError:
        return text if isinstance(text, str) else text.decode("utf-8", "replace")


def review_view(review: approval_pb2.Review) -> dict[str, Any]:
    """What a review page shows; the redacted diff as the approval service derived it."""
    diff = _json_or_text(review.redacted_diff_json or b"{}")
    changes = diff.get("changes") if isinstance(diff, dict) else None
    rows: list[dict[str, Any]] = []
    if isinstance(changes, dict):
        for key, change in sorted(changes.items()):
            change = change if isinstance(change, dict) else {"new": change}
            rows.append(
                {
                    "key": key,
                    "old": _compact(change["old"]) if "old" in change else None,
                    "new": _compact(change["new"]) if "new" in change else None,
                }
            )
    view: dict[str, Any] = {
        "digest": review.digest,
        "status": STATUS_OF.get(review.status, "unspecified"),
        "thread_id": review.thread_id,
        "base_version": review.base_version,
        "node_id": review.node_id,
        "risk_rules": list(review.risk_rules),
        "required_approvals": review.required_approvals,
        "approvers": list(review.approvers),
        "still_needed": max(0, review.required_approvals - len(review.approvers)),
        "opened_at": review.opened_at.ToJsonString(),
        "expires_at": review.expires_at.ToJsonString(),
        "changes": rows,
        "raw_diff": None if isinstance(changes, dict) else _compact(diff),
        "outcome": review.outcome or None,
        "receipt": None,
    }
    if review.HasField("receipt"):
        receipt = _json_or_text(review.receipt.receipt_json)
        if isinstance(receipt, dict):
            view["receipt"] = {
                "decision": str(receipt.get("decision", "")),
                "reviewers": [str(r) for r in receipt.get("reviewers", []) or []],
                "nonce": str(receipt.get("nonce", "")),
                "expires_at": str(receipt.get("expires_at", "")),
                "key_id": review.receipt.key_id,
            }
    return view


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def timeline_row(entry: ledger_pb2.LedgerEntry, detail: Any) -> dict[str, Any]:
    """One version of a thread's timeline: who, when, which keys, and the patch."""
    patch = _json_or_text(detail.patch_json)
    changes = (
        [(key, _compact(value)) for key, value in sorted(patch.items())]
        if isinstance(patch, dict)
        else [("(patch)", _compact(patch))]
    )
    return {
        "version": entry.version,
        "digest": entry.digest,
        "node_id": entry.node_id,
        "kind": entry.kind,
        "at": entry.at.ToJsonString(),
        "changed_keys": list(entry.changed_keys),
        "has_receipt": entry.has_receipt,
        "changes": changes,
    }


@asynccontextmanager
async def _calling(identity: Identity) -> AsyncIterator[grpc.aio.Channel]:
    """A channel as ``identity`` for one page's calls; a failed call becomes ``CallFailed``,
    and so do credential files that can no longer be read (``CREDENTIALS_UNREADABLE``,
    logged by the type of what failed only: its text names a path)."""
    try:
        opened = identity.channel()
    except CliError as error:
        LOG.error(
            "console cannot read its credentials: %s", type(error.__context__ or error).__name__
        )
        raise CallFailed(CREDENTIALS_UNREADABLE, CREDENTIALS_UNREADABLE, CREDENTIALS_TEXT) from None
    try:
        async with opened as channel:
            yield channel
    except grpc.aio.AioRpcError as error:
        raise _failed(error) from None


async def _paged(
    fetch: Callable[[Any], Awaitable[Any]], request: Any, rows: Callable[[Any], Iterable[T]]
) -> list[T]:
    """Follow ``next_page_token`` until MAX_ROWS rows or the last page."""
    found: list[T] = []
    while len(found) < MAX_ROWS:
        response = await fetch(request)
        found += rows(response)
        if not response.next_page_token:
            break
        request.page_token = response.next_page_token
    return found[:MAX_ROWS]


class Backend:
    """The calls the pages make. Each page opens a channel for its calls and closes it."""

    def __init__(self, operator: Identity, reviewer: Identity) -> None:
        self.operator = operator
        self.reviewer = reviewer

    # --- reviews ------------------------------------------------------------------------

    async def reviews(self, status: str) -> list[dict[str, Any]]:
        request = approval_pb2.ListReviewsRequest(status=STATUS_NAMES[status], page_size=PAGE_SIZE)
        async with _calling(self.reviewer) as channel:
            stub = approval_pb2_grpc.ApprovalServiceStub(channel)
            return await _paged(
                lambda r: stub.ListReviews(r, timeout=CALL_TIMEOUT_SECONDS),
                request,
                lambda response: map(review_view, response.reviews),
            )

    async def review(self, digest: str) -> dict[str, Any]:
        async with _calling(self.reviewer) as channel:
            stub = approval_pb2_grpc.ApprovalServiceStub(channel)
            response = await stub.GetReview(
                approval_pb2.GetReviewRequest(digest=digest), timeout=CALL_TIMEOUT_SECONDS
            )
        return review_view(response.review)

    async def decide(self, digest: str, decision: str) -> dict[str, Any]:
        """Decide on exactly ``digest`` (as ``ztate approvals approve|reject DIGEST``), then
        wait a bounded time for what the transition service did with it."""
        async with _calling(self.reviewer) as channel:
            stub = approval_pb2_grpc.ApprovalServiceStub(channel)
            response = await stub.Decide(
                approval_pb2.DecideRequest(digest=digest, decision=DECISIONS[decision]),
                timeout=CALL_TIMEOUT_SECONDS,
            )
            review = response.review
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DELIVERY_WAIT_SECONDS
            while STATUS_OF.get(review.status) != "open" and not review.outcome:
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(0.2)  # the review's delivery, bounded by the deadline
                got = await stub.GetReview(
                    approval_pb2.GetReviewRequest(digest=digest), timeout=CALL_TIMEOUT_SECONDS
                )
                review = got.review
        return review_view(review)

    # --- the ledger ---------------------------------------------------------------------

    async def _transitions(self, request: ledger_pb2.ListTransitionsRequest) -> list[Any]:
        async with _calling(self.operator) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            return await _paged(
                lambda r: stub.ListTransitions(r, timeout=CALL_TIMEOUT_SECONDS),
                request,
                lambda response: response.entries,
            )

    async def threads(self) -> list[dict[str, Any]]:
        """Threads by their newest transitions (the ledger lists transitions, newest first)."""
        entries = await self._transitions(ledger_pb2.ListTransitionsRequest(page_size=PAGE_SIZE))
        threads: dict[str, dict[str, Any]] = {}
        for entry in entries:
            threads.setdefault(
                entry.thread_id,
                {
                    "thread_id": entry.thread_id,
                    "version": entry.version,
                    "at": entry.at.ToJsonString(),
                    "node_id": entry.node_id,
                },
            )
        return list(threads.values())

    async def timeline(self, thread_id: str) -> list[dict[str, Any]]:
        """A thread's newest committed transitions, newest first, each with its patch:
        one listing of ``TIMELINE_ROWS``, then their details ``DETAILS_AT_ONCE`` at a
        time, each turned into its row (patch kept, state dropped) as it arrives. A
        detail holds the whole state after it: 50 of them at once, at a 64 MiB state
        limit, were 3.2 GiB, and nine more listings were read only to be cut."""
        request = ledger_pb2.ListTransitionsRequest(thread_id=thread_id, page_size=TIMELINE_ROWS)
        async with _calling(self.operator) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            listed = await stub.ListTransitions(request, timeout=CALL_TIMEOUT_SECONDS)
            entries = list(listed.entries)[:TIMELINE_ROWS]
            at_once = asyncio.Semaphore(DETAILS_AT_ONCE)

            async def row(entry: Any) -> dict[str, Any]:
                async with at_once:
                    detail = await stub.GetTransitionDetail(
                        ledger_pb2.GetTransitionDetailRequest(digest=entry.digest),
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                    return timeline_row(entry, detail)

            return list(await asyncio.gather(*(row(entry) for entry in entries)))

    async def rejections(self, thread_id: str | None) -> list[dict[str, Any]]:
        request = ledger_pb2.ListRejectionsRequest(thread_id=thread_id or "", page_size=PAGE_SIZE)
        async with _calling(self.operator) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            return await _paged(
                lambda r: stub.ListRejections(r, timeout=CALL_TIMEOUT_SECONDS),
                request,
                lambda response: map(rejection_view, response.rejections),
            )
