"""The gRPC face of the approval service (``ztate.v1.ApprovalService``).

Every handler runs behind the transition service's ``guarded``: the caller is the
SPIFFE ID of its verified client certificate, and refusals map to gRPC statuses
in the one place they are mapped. The rules themselves live in ``service.py``.
"""

from __future__ import annotations

from datetime import datetime

from google.protobuf import timestamp_pb2

from ztate.approval_service.service import ApprovalService, Submission, encode_page_token
from ztate.approval_service.store import APPROVED, EXPIRED, OPEN, REJECTED, StoredReview
from ztate.contract.receipts import APPROVE, REJECT
from ztate.services.runtime.identity import Authenticator, Identity, caller_serial
from ztate.services.runtime.rpc_guard import Context, guarded
from ztate.services.runtime.serving import within_budget
from ztate.v1 import approval_pb2, approval_pb2_grpc

# the reviews of one ListReviews reply: half the service's reply limit
# (app.MAX_MESSAGE_BYTES, 16 MiB), the rest for the envelope and the token
LIST_REPLY_BUDGET = 8 * 1024 * 1024

STATUS_TO_PROTO = {
    OPEN: approval_pb2.REVIEW_STATUS_OPEN,
    APPROVED: approval_pb2.REVIEW_STATUS_APPROVED,
    REJECTED: approval_pb2.REVIEW_STATUS_REJECTED,
    EXPIRED: approval_pb2.REVIEW_STATUS_EXPIRED,
}
STATUS_FROM_PROTO = {value: name for name, value in STATUS_TO_PROTO.items()}
DECISION_FROM_PROTO = {approval_pb2.DECISION_APPROVE: APPROVE, approval_pb2.DECISION_REJECT: REJECT}


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def review_message(review: StoredReview) -> approval_pb2.Review:
    message = approval_pb2.Review(
        digest=review.digest,
        thread_id=review.thread_id,
        base_version=review.base_version,
        node_id=review.node_id,
        risk_rules=list(review.risk_rules),
        required_approvals=review.required_approvals,
        redacted_diff_json=review.redacted_diff,
        status=STATUS_TO_PROTO[review.status],
        approvers=list(review.approvers),
        opened_at=_timestamp(review.opened_at),
        expires_at=_timestamp(review.expires_at),
        outcome=review.outcome or "",
    )
    if review.receipt is not None:
        message.receipt.CopyFrom(
            approval_pb2.SignedReceipt(
                receipt_json=review.receipt.receipt_bytes,
                signature=review.receipt.signature,
                key_id=review.receipt.key_id,
            )
        )
    return message


def _status_filter(status: int) -> str | None:
    """Unknown values pass as a name the service refuses, after it checked the caller."""
    if status == approval_pb2.REVIEW_STATUS_UNSPECIFIED:
        return None
    return STATUS_FROM_PROTO.get(status, f"unknown ({status})")


def _decision(decision: int) -> str:
    return DECISION_FROM_PROTO.get(decision, f"unknown ({decision})")


class ApprovalServicer(approval_pb2_grpc.ApprovalServiceServicer):
    """Adapts ``ApprovalService`` to ``ztate.v1.ApprovalService``."""

    def __init__(self, service: ApprovalService, authenticator: Authenticator) -> None:
        self._service = service
        self._authenticator = authenticator

    async def SubmitReview(
        self, request: approval_pb2.SubmitReviewRequest, context: Context
    ) -> approval_pb2.SubmitReviewResponse:
        async def handle(caller: Identity) -> approval_pb2.SubmitReviewResponse:
            review = await self._service.submit_review(
                caller,
                Submission(
                    digest=request.digest,
                    thread_id=request.thread_id,
                    base_version=request.base_version,
                    node_id=request.node_id,
                    risk_rules=tuple(request.risk_rules),
                    required_approvals=request.required_approvals,
                    proposal_json=request.proposal_json,
                    base_record_json=request.base_record_json,
                    base_state_json=request.base_state_json,
                    sensitive_keys=frozenset(request.sensitive_keys),
                ),
            )
            return approval_pb2.SubmitReviewResponse(review=review_message(review))

        return await guarded(context, self._authenticator, "SubmitReview", handle)

    async def ListReviews(
        self, request: approval_pb2.ListReviewsRequest, context: Context
    ) -> approval_pb2.ListReviewsResponse:
        async def handle(caller: Identity) -> approval_pb2.ListReviewsResponse:
            page = await self._service.list_reviews(
                caller,
                status=_status_filter(request.status),
                thread_id=request.thread_id or None,
                page_size=request.page_size,
                page_token=request.page_token,
            )
            # a page of large reviews (each carries its diff) is cut to what fits a reply,
            # with a token after the last one sent: 100 diffs of a few hundred KB each
            # went over the reply limit, and every page failed
            messages = [review_message(review) for review in page.reviews]
            kept = within_budget(messages, LIST_REPLY_BUDGET)
            token = page.next_page_token
            if len(kept) < len(messages):
                token = encode_page_token(page.reviews[len(kept) - 1])
            return approval_pb2.ListReviewsResponse(reviews=kept, next_page_token=token)

        return await guarded(context, self._authenticator, "ListReviews", handle)

    async def GetReview(
        self, request: approval_pb2.GetReviewRequest, context: Context
    ) -> approval_pb2.GetReviewResponse:
        async def handle(caller: Identity) -> approval_pb2.GetReviewResponse:
            review = await self._service.get_review(caller, request.digest)
            return approval_pb2.GetReviewResponse(review=review_message(review))

        return await guarded(context, self._authenticator, "GetReview", handle)

    async def Decide(
        self, request: approval_pb2.DecideRequest, context: Context
    ) -> approval_pb2.DecideResponse:
        async def handle(caller: Identity) -> approval_pb2.DecideResponse:
            review = await self._service.decide(
                caller, request.digest, _decision(request.decision), caller_serial(context)
            )
            return approval_pb2.DecideResponse(review=review_message(review))

        return await guarded(context, self._authenticator, "Decide", handle)
