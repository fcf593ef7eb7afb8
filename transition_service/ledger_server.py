"""``ztate.v1.LedgerService``: read-only ledger queries for operators.

Operators ask what happened (which transitions, by whom, touching which key,
with which receipt) without a superuser shell: every query runs on the
read-only role, only privileged identities may ask, and every list is a keyset
page so that the millionth row costs what the first does.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from google.protobuf import timestamp_pb2

from ztate.contract.canonical import canonical_bytes
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Authenticator, Identity, Role
from ztate.services.runtime.rpc_guard import Context, guarded
from ztate.services.runtime.serving import within_budget
from ztate.services.runtime.thread_ids import THREAD_ID, check_thread_id
from ztate.services.store.ledger import (
    COMMITTED,
    PARKED_STATUSES,
    LedgerQueries,
    PageKey,
    RejectionFilter,
    StoredDetail,
    StoredEntry,
    StoredKeyChange,
    StoredRejection,
    StoredThread,
    StoredWork,
    TransitionFilter,
)
from ztate.transition_service.checks import check_privileged
from ztate.v1 import ledger_pb2, ledger_pb2_grpc

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp_message(moment: datetime) -> timestamp_pb2.Timestamp:
    """``moment`` (timezone-aware) as a protobuf Timestamp: what ``FromDatetime`` gives,
    at a quarter of its cost (it runs on every answered proposal)."""
    delta = moment - EPOCH
    return timestamp_pb2.Timestamp(
        seconds=delta.days * 86_400 + delta.seconds, nanos=delta.microseconds * 1000
    )


class _WithTimes(Protocol):
    def HasField(self, field_name: Any) -> bool: ...


# what a datetime (and so the query) can hold: 0001-01-01 to 9999-12-31, UTC
MIN_SECONDS, MAX_SECONDS = -62_135_596_800, 253_402_300_799
MAX_FILTER_CHARACTERS = 1024
INT64_MAX = 2**63 - 1


def _moment(message: _WithTimes, field: str) -> datetime | None:
    if not message.HasField(field):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, field)
    if not MIN_SECONDS <= stamp.seconds <= MAX_SECONDS or not 0 <= stamp.nanos < 10**9:
        raise errors.RequestInvalid(
            f"{field} must be a timestamp between 0001-01-01 and 9999-12-31 UTC"
        )
    return stamp.ToDatetime(tzinfo=UTC)


def filter_text(value: str, field: str) -> str | None:
    """A filter as given (None when empty); refuses what no stored row can hold."""
    if not value:
        return None
    if "\x00" in value or len(value) > MAX_FILTER_CHARACTERS:
        raise errors.RequestInvalid(
            f"{field} must be at most {MAX_FILTER_CHARACTERS} characters, without U+0000"
        )
    return value


def thread_filter(value: str) -> str | None:
    """A thread id as given (None when empty); ``RequestInvalid`` without echoing it
    when it breaks the thread-id rule (no committed row holds one that does)."""
    if not value:
        return None
    check_thread_id(value)
    return value


def page_size(requested: int) -> int:
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= requested <= MAX_PAGE_SIZE:
        raise errors.RequestInvalid(f"page_size must be between 1 and {MAX_PAGE_SIZE}")
    return requested


def page_after(token: str) -> int | None:
    """Page tokens are the last id seen, in decimal: keyset pagination."""
    if not token:
        return None
    if not PAGE_ID.fullmatch(token) or int(token) > INT64_MAX:
        raise errors.RequestInvalid("page_token is not one this service issued")
    return int(token)


def rejection_message(row: StoredRejection) -> ledger_pb2.Rejection:
    return ledger_pb2.Rejection(
        id=row.id,
        rejected_at=timestamp_message(row.rejected_at),
        method=row.method,
        node_id=row.node_id,
        thread_id=row.thread_id or "",
        base_version=row.base_version or 0,
        reason=row.reason,
        keys=row.keys,
        patch_digest=row.patch_digest or "",
        patch_bytes=row.patch_bytes or 0,
        message=row.message,
    )


DIGEST = re.compile(r"^[0-9a-f]{64}\Z")
PAGE_ID = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() takes "²"


def entry_page_token(entry: StoredEntry) -> str:
    """An opaque token naming the last entry of a page: its moment and digest."""
    token = f"{_micros(entry.at)}:{entry.digest}"
    return base64.urlsafe_b64encode(token.encode()).decode()


def _micros(moment: datetime) -> int:
    delta = moment - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def entry_page_after(token: str) -> PageKey | None:
    """The inverse of ``entry_page_token``; refuses anything this service did not issue."""
    if not token:
        return None
    try:
        micros, digest = base64.urlsafe_b64decode(token.encode()).decode().split(":")
        at = EPOCH + timedelta(microseconds=int(micros))
    except (binascii.Error, UnicodeDecodeError, ValueError, OverflowError):
        raise errors.RequestInvalid("page_token is not one this service issued") from None
    if not DIGEST.match(digest):
        raise errors.RequestInvalid("page_token is not one this service issued")
    return PageKey(at, digest)


def entry_message(row: StoredEntry) -> ledger_pb2.LedgerEntry:
    return ledger_pb2.LedgerEntry(
        thread_id=row.thread_id,
        version=row.version,
        digest=row.digest,
        parent_digest=row.parent_digest,
        node_id=row.node_id,
        kind=row.kind or "",
        status=row.status,
        at=timestamp_message(row.at),
        changed_keys=row.changed_keys,
        has_receipt=row.has_receipt,
    )


def detail_message(row: StoredDetail) -> ledger_pb2.GetTransitionDetailResponse:
    record = json.loads(row.record)
    return ledger_pb2.GetTransitionDetailResponse(
        entry=entry_message(row.entry),
        record_json=row.record.decode(),
        patch_json=canonical_bytes(record["patch"]).decode(),
        state_json=row.state.decode() if row.state is not None else "",
        state_kept=row.state is not None,
        key_id=row.key_id,
        signature=row.signature,
        # the exact RFC 8785 bytes the approval service signed
        receipt_json=row.receipt.decode() if row.receipt is not None else "",
        receipt_signature=row.receipt_signature or "",
        receipt_key_id=row.receipt_key_id or "",
    )


def key_change_message(row: StoredKeyChange, key: str) -> ledger_pb2.KeyChange:
    value = json.loads(row.record)["patch"][key]
    return ledger_pb2.KeyChange(
        version=row.version,
        digest=row.digest,
        node_id=row.node_id,
        committed_at=timestamp_message(row.committed_at),
        removed=value is None,
        value_json="" if value is None else canonical_bytes(value).decode(),
    )


def transition_filter(request: ledger_pb2.ListTransitionsRequest) -> TransitionFilter:
    status = request.status or COMMITTED
    if status != COMMITTED and status not in PARKED_STATUSES:
        allowed = ", ".join([COMMITTED, *sorted(PARKED_STATUSES)])
        raise errors.RequestInvalid(f"status must be one of {allowed}")
    return TransitionFilter(
        thread_id=thread_filter(request.thread_id),
        node_id=filter_text(request.node_id, "node_id"),
        changed_key=filter_text(request.changed_key, "changed_key"),
        status=status,
        since=_moment(request, "since"),
        until=_moment(request, "until"),
    )


MAX_THREAD_TOKEN_CHARACTERS = 200  # base64url of the longest thread id (128), with room


def thread_page_token(thread_id: str) -> str:
    return base64.urlsafe_b64encode(thread_id.encode()).decode().rstrip("=")


def thread_page_after(token: str) -> str | None:
    """A ListThreads page token: the last thread id of the previous page, base64url.
    Hostile input: bounded, decoded strictly, and a thread id or refused."""
    if not token:
        return None
    refused = errors.RequestInvalid("page_token is not one this service issued")
    if len(token) > MAX_THREAD_TOKEN_CHARACTERS or not re.fullmatch(r"[A-Za-z0-9_-]+", token):
        raise refused
    try:
        decoded = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("ascii")
    except (binascii.Error, ValueError):
        raise refused from None
    if not THREAD_ID.fullmatch(decoded) or thread_page_token(decoded) != token:
        raise refused
    return decoded


def check_operator(caller: Identity) -> None:
    if caller.role is not Role.OPERATOR:
        raise errors.RoleForbidden(f"a {caller.role} identity may not administer threads")


def thread_head_message(row: StoredThread) -> ledger_pb2.ThreadHead:
    return ledger_pb2.ThreadHead(
        thread_id=row.thread_id,
        policy=row.policy,
        version=row.version,
        head_digest=row.head_digest,
        created_at=timestamp_message(row.created_at),
        updated_at=timestamp_message(row.updated_at),
    )


def node_work_message(row: StoredWork) -> ledger_pb2.NodeWork:
    message = ledger_pb2.NodeWork(
        node=row.node,
        wake_version=row.wake_version,
        handled_version=row.handled_version,
        due=row.wake_version > row.handled_version,
        holder=row.holder or "",
        lease_epoch=row.epoch,
    )
    if row.expires_at is not None:
        message.lease_expires_at.CopyFrom(timestamp_message(row.expires_at))
    return message


class LedgerServicer(ledger_pb2_grpc.LedgerServiceServicer):
    """Adapts ``LedgerQueries`` to ``ztate.v1.LedgerService``."""

    def __init__(
        self, queries: LedgerQueries, authenticator: Authenticator, reply_budget: int
    ) -> None:
        """``reply_budget``: the bytes one page may take, under the server's reply limit."""
        self._queries = queries
        self._authenticator = authenticator
        self._budget = reply_budget

    async def ListRejections(
        self, request: ledger_pb2.ListRejectionsRequest, context: Context
    ) -> ledger_pb2.ListRejectionsResponse:
        async def handle(caller: Identity) -> ledger_pb2.ListRejectionsResponse:
            check_privileged(caller, "read the ledger")
            limit = page_size(request.page_size)
            rows = await self._queries.rejections(
                RejectionFilter(
                    thread_id=filter_text(request.thread_id, "thread_id"),
                    node_id=filter_text(request.node_id, "node_id"),
                    reason=filter_text(request.reason, "reason"),
                    since=_moment(request, "since"),
                    until=_moment(request, "until"),
                ),
                limit=limit,
                before_id=page_after(request.page_token),
            )
            page = within_budget([rejection_message(row) for row in rows], self._budget)
            more = len(page) < len(rows) or len(rows) == limit
            return ledger_pb2.ListRejectionsResponse(
                rejections=page, next_page_token=str(page[-1].id) if page and more else ""
            )

        return await guarded(context, self._authenticator, "ListRejections", handle)

    async def ListTransitions(
        self, request: ledger_pb2.ListTransitionsRequest, context: Context
    ) -> ledger_pb2.ListTransitionsResponse:
        async def handle(caller: Identity) -> ledger_pb2.ListTransitionsResponse:
            check_privileged(caller, "read the ledger")
            limit = page_size(request.page_size)
            rows = await self._queries.transitions(
                transition_filter(request),
                limit=limit,
                after=entry_page_after(request.page_token),
            )
            page = within_budget([entry_message(row) for row in rows], self._budget)
            more = len(page) < len(rows) or len(rows) == limit
            return ledger_pb2.ListTransitionsResponse(
                entries=page,
                next_page_token=entry_page_token(rows[len(page) - 1]) if page and more else "",
            )

        return await guarded(context, self._authenticator, "ListTransitions", handle)

    async def GetTransitionDetail(
        self, request: ledger_pb2.GetTransitionDetailRequest, context: Context
    ) -> ledger_pb2.GetTransitionDetailResponse:
        async def handle(caller: Identity) -> ledger_pb2.GetTransitionDetailResponse:
            check_privileged(caller, "read the ledger")
            if request.digest:
                if request.thread_id or request.version:
                    raise errors.RequestInvalid("give either digest or thread_id and version")
                if not DIGEST.match(request.digest):
                    raise errors.RequestInvalid("digest must be 64 lower-case hex characters")
                row = await self._queries.detail(digest=request.digest)
                wanted = f"transition {request.digest}"
            else:
                thread_id = thread_filter(request.thread_id)
                if thread_id is None or request.version < 0:
                    raise errors.RequestInvalid("give either digest or thread_id and version")
                row = await self._queries.detail(thread_id=thread_id, version=request.version)
                wanted = f"version {request.version} of thread {request.thread_id}"
            if row is None:
                raise errors.TransitionNotFound(f"no committed {wanted}")
            return detail_message(row)

        return await guarded(context, self._authenticator, "GetTransitionDetail", handle)

    async def KeyHistory(
        self, request: ledger_pb2.KeyHistoryRequest, context: Context
    ) -> ledger_pb2.KeyHistoryResponse:
        async def handle(caller: Identity) -> ledger_pb2.KeyHistoryResponse:
            check_privileged(caller, "read the ledger")
            if not thread_filter(request.thread_id) or not filter_text(request.key, "key"):
                raise errors.RequestInvalid("thread_id and key are required")
            limit = page_size(request.page_size)
            after = page_after(request.page_token)
            rows = await self._queries.key_history(
                request.thread_id,
                request.key,
                limit=limit,
                after_version=-1 if after is None else after,
            )
            page = within_budget(
                [key_change_message(row, request.key) for row in rows], self._budget
            )
            more = len(page) < len(rows) or len(rows) == limit
            return ledger_pb2.KeyHistoryResponse(
                changes=page, next_page_token=str(page[-1].version) if page and more else ""
            )

        return await guarded(context, self._authenticator, "KeyHistory", handle)

    async def ListThreads(
        self, request: ledger_pb2.ListThreadsRequest, context: Context
    ) -> ledger_pb2.ListThreadsResponse:
        async def handle(caller: Identity) -> ledger_pb2.ListThreadsResponse:
            check_operator(caller)
            limit = page_size(request.page_size)
            rows = await self._queries.threads(
                policy=filter_text(request.policy, "policy"),
                after=thread_page_after(request.page_token),
                limit=limit,
            )
            page = within_budget([thread_head_message(row) for row in rows], self._budget)
            more = len(page) < len(rows) or len(rows) == limit
            return ledger_pb2.ListThreadsResponse(
                threads=page,
                next_page_token=thread_page_token(page[-1].thread_id) if page and more else "",
            )

        return await guarded(context, self._authenticator, "ListThreads", handle)

    async def DescribeThread(
        self, request: ledger_pb2.DescribeThreadRequest, context: Context
    ) -> ledger_pb2.DescribeThreadResponse:
        async def handle(caller: Identity) -> ledger_pb2.DescribeThreadResponse:
            check_operator(caller)
            check_thread_id(request.thread_id)
            found = await self._queries.thread(request.thread_id)
            if found is None:
                raise errors.ThreadNotFound(f"thread {request.thread_id!r} does not exist")
            head, work = found
            return ledger_pb2.DescribeThreadResponse(
                thread=thread_head_message(head), work=[node_work_message(w) for w in work]
            )

        return await guarded(context, self._authenticator, "DescribeThread", handle)
