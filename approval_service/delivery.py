"""Delivering signed receipts to the transition service, until each is taken.

A decision is stored with its receipt first and delivered afterwards, from this
outbox: if the transition service is down, nothing is lost, and delivery is
retried with capped exponential backoff. A receipt counts as delivered once the
transition service applied it, and also once it answered that the receipt can
never be applied (the thread moved on, the transition was closed, the receipt
expired, does not match, or was applied already): retrying those would only
repeat the answer. A refusal of the deliverer rather than of the decision (a
public key the transition service lacks, a certificate or identity it does not
accept) is a configuration problem: it is logged loudly and retried while the
receipt is valid, because a decision must not be dropped for it. An answer that
the receipt was applied already means an earlier delivery's answer was lost: the
review records what that delivery did. The same loop closes open reviews whose
deadline passed.

Calls use the approval service's own certificate: the transition service takes
decisions from the identity ``spiffe://<domain>/service/approval`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import Iterable
from datetime import datetime

import grpc
from google.rpc import error_details_pb2, status_pb2

from ztate.approval_service.service import ApprovalService
from ztate.approval_service.store import OutboxEntry, ReviewStore
from ztate.contract.receipts import now_utc
from ztate.services.runtime import tls
from ztate.services.runtime.config import ApprovalSettings
from ztate.services.runtime.outage import STORAGE_ERRORS
from ztate.services.runtime.rpc_errors import ERROR_DOMAIN
from ztate.services.runtime.telemetry import untraced
from ztate.v1 import approval_pb2, transition_pb2, transition_pb2_grpc

log = logging.getLogger("ztate.approval")
BATCH = 100
CALL_TIMEOUT_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 30.0
DETAILS_KEY = "grpc-status-details-bin"

# Answers that may go away on their own (a failure of the service, not a verdict on the
# receipt): retried, and bounded all the same, since once the receipt expires the
# answer is RECEIPT_EXPIRED, which settles it. Every other refusal is a verdict: the
# transition service will never apply this receipt, so it settles at once, and the
# review says why. An approved transition always reaches a definite outcome.
TRANSIENT = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
# The transition service could not be reached: stop this round, back off.
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Refusals of the deliverer, not verdicts on the transition: the transition service
# lacks the public key the receipt names (a key rotation given to the approval service
# first) or refuses this service's certificate or identity. Retried, loudly, while the
# receipt is valid by this clock: fixing the configuration in that time delivers it.
MISCONFIGURED = frozenset(
    {"RECEIPT_INVALID", "IDENTITY_INVALID", "IDENTITY_REVOKED", "ROLE_FORBIDDEN"}
) | frozenset({grpc.StatusCode.UNAUTHENTICATED.name, grpc.StatusCode.PERMISSION_DENIED.name})


def refusal_reason(error: grpc.aio.AioRpcError) -> str:
    """The ztate reason code in a failed call's rich status, else the status code's name."""
    metadata: Iterable[tuple[str, str | bytes]] = error.trailing_metadata() or ()  # type: ignore[assignment]
    for key, value in metadata:
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        for packed in status_pb2.Status.FromString(value).details:
            info = error_details_pb2.ErrorInfo()
            if packed.Unpack(info) and info.domain == ERROR_DOMAIN:
                return str(info.reason)
    return error.code().name


def transition_channel(settings: ApprovalSettings) -> tls.ServiceChannel:
    """An mTLS channel to the transition service, as the approval service (its files
    read again when they change)."""
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    assert settings.tls_ca is not None
    return tls.ServiceChannel(
        settings.transition_target,
        settings.tls_cert,
        settings.tls_key,
        settings.tls_ca,
        server_name=settings.transition_server_name,
    )


def _receipt_expired(entry: OutboxEntry, now: datetime) -> bool:
    """Whether the receipt's validity ended by our own clock.

    A receipt the transition service calls expired while it is still valid here
    means the two clocks disagree (it is not yet valid there): worth a retry.
    """
    expires_at = json.loads(entry.receipt.receipt_bytes)["expires_at"]
    return datetime.fromisoformat(expires_at.replace("Z", "+00:00")) <= now


def _decision(entry: OutboxEntry) -> str:
    """The receipt's decision: ``approve`` or ``reject`` (it is this service's own)."""
    return str(json.loads(entry.receipt.receipt_bytes)["decision"])


class Attempt(enum.Enum):
    """How one delivery went."""

    SETTLED = "settled"  # applied, or definitively refused: out of the outbox
    RETRY = "retry"  # refused for a reason that may go away: stays in the outbox
    UNREACHABLE = "unreachable"  # the transition service did not answer: end the round


class ReceiptDelivery:
    """The background task that delivers receipts and expires overdue reviews."""

    def __init__(
        self,
        *,
        service: ApprovalService,
        store: ReviewStore,
        channel: tls.ServiceChannel,
        wake: asyncio.Event,
        interval: float,
    ) -> None:
        """``wake`` is set when a receipt is signed; otherwise a round runs every
        ``interval`` seconds, less often while deliveries fail."""
        self._service = service
        self._store = store
        self._channel = channel
        self._wake = wake
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self._failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ztate-receipt-delivery")

    async def stop(self) -> None:
        """Stop between calls or abandon the one in flight; undelivered receipts stay
        in the outbox for the next start."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._channel.close()

    async def _run(self) -> None:
        while True:
            try:
                with untraced():  # a round every few seconds: not a trace each
                    await self.run_once()
            except STORAGE_ERRORS as failure:
                self._failed()
                log.warning("receipt delivery round failed: %s", type(failure).__name__)
            except Exception as unexpected:
                # A bug must not end delivery for good: log it loudly, back off, go on.
                self._failed()
                log.exception("receipt delivery round failed: %s", type(unexpected).__name__)
            delay = min(self._interval * 2**self._failures, MAX_BACKOFF_SECONDS)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancellation that lands as the wait ends, and stop() then waits forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()

    def _failed(self) -> None:
        self._failures = min(self._failures + 1, 6)

    async def run_once(self) -> None:
        """One round: expire overdue reviews, then deliver what is waiting."""
        await self._service.expire_overdue()
        clean = True
        for entry in await self._store.undelivered(BATCH):
            result = await self._deliver(entry)
            if result is Attempt.UNREACHABLE:
                self._failed()
                return
            clean = clean and result is Attempt.SETTLED
        if clean:
            self._failures = 0
        else:
            self._failed()

    async def _deliver(self, entry: OutboxEntry) -> Attempt:
        request = transition_pb2.ApplyDecisionRequest(
            receipt=approval_pb2.SignedReceipt(
                receipt_json=entry.receipt.receipt_bytes,
                signature=entry.receipt.signature,
                key_id=entry.receipt.key_id,
            )
        )
        try:
            stub = transition_pb2_grpc.TransitionServiceStub(await self._channel.channel())
            response = await stub.ApplyDecision(request, timeout=CALL_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as error:
            return await self._refused(entry, error)
        outcome = transition_pb2.Outcome.Name(response.outcome).removeprefix("OUTCOME_").lower()
        if response.reason:
            outcome = f"{outcome}: {response.reason}"
        log.info("delivered the receipt of review %s: %s", entry.digest[:16], outcome)
        await self._store.mark_delivered(entry.digest, now_utc(), outcome)
        return Attempt.SETTLED

    async def _refused(self, entry: OutboxEntry, error: grpc.aio.AioRpcError) -> Attempt:
        code, reason, digest = error.code(), refusal_reason(error), entry.digest[:16]
        if code in UNREACHABLE:
            log.warning("delivering review %s: %s; will retry", digest, code.name)
            return Attempt.UNREACHABLE
        now = now_utc()
        if reason == "RECEIPT_EXPIRED" and not _receipt_expired(entry, now):
            log.error(
                "delivering review %s: the transition service calls a receipt expired that is "
                "valid by this clock; are the two clocks in step? will retry",
                digest,
            )
            return Attempt.RETRY
        if reason in MISCONFIGURED and not _receipt_expired(entry, now):
            log.error(
                "delivering review %s refused: %s %s; the transition service does not take "
                "this service's receipts (its approval public keys, this service's certificate "
                "or identity): will retry until the receipt expires",
                digest,
                code.name,
                reason,
            )
            return Attempt.RETRY
        if reason == "RECEIPT_REPLAYED":
            # Only this receipt's own delivery uses its nonce, and the transition service
            # records it only when it applies the receipt: with a commit for an approval,
            # with the rejection for a rejection. An earlier delivery did, and its answer
            # was lost (a deadline, a restart mid-call).
            outcome = "committed" if _decision(entry) == "approve" else "rejected"
            log.info("the receipt of review %s was applied before: %s", digest, outcome)
            await self._store.mark_delivered(entry.digest, now, outcome)
            return Attempt.SETTLED
        # the status code and reason only, never the refusal's text: no log holds a
        # refusal's message (docs/operations.md), and under INTERNAL or UNKNOWN it is
        # whatever answered at the transition service's address (a proxy's page)
        if code in TRANSIENT:
            log.error("delivering review %s refused: %s %s; will retry", digest, code.name, reason)
            return Attempt.RETRY
        log.warning(
            "the transition service will not apply the receipt of review %s: %s %s",
            digest,
            code.name,
            reason,
        )
        outcome = "stale" if reason == "APPROVAL_STALE" else f"not applied: {reason}"
        await self._store.mark_delivered(entry.digest, now, outcome)
        return Attempt.SETTLED
