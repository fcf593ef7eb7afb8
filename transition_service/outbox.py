"""Submitting parked transitions to the approval service, until each is delivered.

A parked transition is stored first and submitted afterwards, from this outbox:
if the approval service is down, nothing is lost, and submission is retried
(with backoff, capped) until it is taken. The approval service opens one review
per digest, so a submission repeated after a crash is harmless. The same loop
closes transitions that waited longer than ``pending_ttl`` as expired.

A failure that stands for every review (the approval service unreachable, overloaded,
refusing this service's identity, a deadline) stops the round, which backs off. A
refusal of one review (``REFUSED_REVIEW``: the approval service cannot derive a review
from that submission, or it is over its request limit, which a submission found too
large before it is sent also is) or a base record that is gone sets that one aside for
``SET_ASIDE_SECONDS``: it stays parked (and expires with ``pending_ttl`` if never
taken), while the reviews parked after it are submitted. Before, it held back every
review parked after it, for good. Rounds page through the waiting transitions oldest
first, each full page's round ending where the next begins, so a backlog of refused
ones larger than what a process sets aside (``MAX_SET_ASIDE``) holds back no review
parked after it either: they only take their turn in the pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, timedelta

import grpc

from ztate.services.runtime import tls
from ztate.services.runtime.serving import APPROVAL_MAX_MESSAGE_BYTES
from ztate.services.runtime.telemetry import untraced
from ztate.services.store.approvals import ApprovalStore, SubmitPosition
from ztate.services.store.rows import PendingTransition
from ztate.v1 import approval_pb2, approval_pb2_grpc

log = logging.getLogger("ztate.transition")
BATCH = 100
MAX_BACKOFF_SECONDS = 30.0
# the approval service's answers that refuse one submission, not the service's state
REFUSED_REVIEW = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        # the submission is over its request limit: this one review, not the service
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
# the most parked transitions a process sets aside (past it, the oldest is tried again)
MAX_SET_ASIDE = 1000
# how long one stays aside before it is tried again: a refusal of one review may also be
# a version skew between the services during a rolling upgrade, which passes
SET_ASIDE_SECONDS = 600.0


def submission(
    pending: PendingTransition, base_record: bytes, base_state: bytes | None
) -> approval_pb2.SubmitReviewRequest:
    """What the approval service needs to derive the review itself: the proposal and the
    exact record and state it builds on (approval_service/review.py)."""
    return approval_pb2.SubmitReviewRequest(
        digest=pending.digest,
        thread_id=pending.thread_id,
        base_version=pending.base_version,
        node_id=pending.node_id,
        risk_rules=pending.risk_rules,
        required_approvals=pending.required_approvals,
        proposal_json=pending.proposal,
        base_record_json=base_record,
        base_state_json=base_state or b"",
        sensitive_keys=pending.sensitive_keys,
    )


class ApprovalOutbox:
    """The background task that delivers parked transitions and expires old ones."""

    def __init__(
        self,
        *,
        approvals: ApprovalStore,
        channel: tls.ServiceChannel | None,
        wake: asyncio.Event,
        interval: float,
        pending_ttl: timedelta,
    ) -> None:
        self._approvals = approvals
        self._channel = channel
        self._wake = wake
        self._interval = interval
        self._pending_ttl = pending_ttl
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        # the parked transitions the approval service refused: digest -> when (the
        # loop's clock) to try it again, oldest first
        self._set_aside: dict[str, float] = {}
        # where the last full page ended: the next round goes on from there, so that a
        # backlog is walked through whatever the approval service refuses in it
        self._position: SubmitPosition | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ztate-approval-outbox")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._channel is not None:
            await self._channel.close()

    async def _run(self) -> None:
        while True:
            delay = min(self._interval * 2**self._failures, MAX_BACKOFF_SECONDS)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancellation that lands as the wait ends, and stop() then waits forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()
            try:
                with untraced():  # a round every few seconds: not a trace each
                    await self.run_once()
            except Exception as failure:  # the outbox must outlive any one failure
                log.warning(
                    "approval outbox round failed (%s); the next round retries",
                    type(failure).__name__,
                )

    async def run_once(self) -> None:
        """One round: expire overdue transitions, then submit what is waiting."""
        now = datetime.now(UTC)
        overdue = await self._approvals.overdue(self._pending_ttl, now)
        if overdue:
            expired = await self._approvals.close_without_decision(overdue, "expired", now)
            log.info("expired %d parked transitions", len(expired))
        if self._channel is None:
            return
        clock = asyncio.get_running_loop().time()
        for digest, again in list(self._set_aside.items()):
            if again <= clock:
                del self._set_aside[digest]
        page = await self._approvals.to_submit(BATCH, list(self._set_aside), self._position)
        for pending in page:
            try:
                base_record, base_state = await self._approvals.base_of(pending)
                request = submission(pending, base_record, base_state)
                if request.ByteSize() > APPROVAL_MAX_MESSAGE_BYTES:
                    self._set_apart(
                        pending,
                        f"its submission is {request.ByteSize()} bytes, over the approval "
                        f"service's limit of {APPROVAL_MAX_MESSAGE_BYTES}",
                    )
                    continue
                stub = approval_pb2_grpc.ApprovalServiceStub(await self._channel.channel())
                await stub.SubmitReview(request, timeout=10)
            except LookupError:
                self._set_apart(pending, "its base record is gone")
                continue
            except grpc.aio.AioRpcError as error:
                if error.code() in REFUSED_REVIEW:
                    self._set_apart(
                        pending, f"the approval service refused it: {error.code().name}"
                    )
                    continue
                self._failures = min(self._failures + 1, 6)
                log.warning(
                    "submitting %s to the approval service failed: %s; will retry",
                    pending.digest[:16],
                    error.code().name,
                )
                return
            await self._approvals.mark_submitted(pending, datetime.now(UTC))
            self._failures = 0
        # a full page: the next round starts after it (the rows set aside in it stay
        # behind); a short one: the backlog is walked through, the next starts over
        last = page[-1] if len(page) == BATCH else None
        self._position = (last.parked_at, last.digest) if last is not None else None

    def _set_apart(self, pending: PendingTransition, why: str) -> None:
        """Submit ``pending`` no more for ``SET_ASIDE_SECONDS`` (it stays parked, and
        expires with ``pending_ttl`` if never taken), and say why: the reviews parked
        after it go on."""
        if len(self._set_aside) >= MAX_SET_ASIDE:
            del self._set_aside[next(iter(self._set_aside))]
        again = asyncio.get_running_loop().time() + SET_ASIDE_SECONDS
        self._set_aside[pending.digest] = again
        log.warning(
            "parked transition %s cannot be reviewed (%s): set aside, tried again in %gs",
            pending.digest[:16],
            why,
            SET_ASIDE_SECONDS,
        )
