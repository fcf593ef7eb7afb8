"""``ztate.v1.LedgerService``: read-only ledger queries for operators."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from services import errors
from services.identity import Identity
from services.rpc_guard import Context, guarded
from services.store.ledger import LedgerQueries, RejectionFilter, StoredRejection
from transition_service.pipeline import check_privileged
from ztate.v1 import ledger_pb2, ledger_pb2_grpc

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _moment(message: ledger_pb2.ListRejectionsRequest, field: str) -> datetime | None:
    if not message.HasField(field):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, field)
    return stamp.ToDatetime(tzinfo=UTC)


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
    if not token.isdigit() or len(token) > 19:
        raise errors.RequestInvalid("page_token is not one this service issued")
    return int(token)


def rejection_message(row: StoredRejection) -> ledger_pb2.Rejection:
    return ledger_pb2.Rejection(
        id=row.id,
        rejected_at=_timestamp(row.rejected_at),
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


class LedgerServicer(ledger_pb2_grpc.LedgerServiceServicer):
    """Adapts ``LedgerQueries`` to ``ztate.v1.LedgerService``."""

    def __init__(self, queries: LedgerQueries, trust_domain: str) -> None:
        self._queries = queries
        self._trust_domain = trust_domain

    async def ListRejections(
        self, request: ledger_pb2.ListRejectionsRequest, context: Context
    ) -> ledger_pb2.ListRejectionsResponse:
        async def handle(caller: Identity) -> ledger_pb2.ListRejectionsResponse:
            check_privileged(caller, "read the ledger")
            limit = page_size(request.page_size)
            rows = await self._queries.rejections(
                RejectionFilter(
                    thread_id=request.thread_id or None,
                    node_id=request.node_id or None,
                    reason=request.reason or None,
                    since=_moment(request, "since"),
                    until=_moment(request, "until"),
                ),
                limit=limit,
                before_id=page_after(request.page_token),
            )
            return ledger_pb2.ListRejectionsResponse(
                rejections=[rejection_message(row) for row in rows],
                next_page_token=str(rows[-1].id) if len(rows) == limit else "",
            )

        return await guarded(context, self._trust_domain, "ListRejections", handle)
