"""The approval service's rules: who may open, read and decide a review, and when a
review is decided and its receipt signed.

A review can only be opened by the transition service, for proposal bytes that
hash to the digest it names and that name the same thread, base version, node and
risk rules as the review, so what a reviewer reads is bound to what they sign. A
reviewer decides on the digest they saw; nobody decides on their own proposal,
nobody decides twice, and a review closes either at its first rejection or once
``required_approvals`` distinct reviewers approved. Only then is a receipt signed,
over every approver. No gRPC here: ``server.py`` adapts this to the wire.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.approval_service.notifier import Notifier, ReviewEvent
from ztate.approval_service.review import derived_diff, redaction_key
from ztate.approval_service.store import (
    APPROVED,
    EXPIRED,
    OPEN,
    REJECTED,
    STATUSES,
    Cursor,
    ExpiredReview,
    LockedReview,
    NewReview,
    ReviewStore,
    StoredReview,
)
from ztate.contract.canonical import sha256_hex
from ztate.contract.receipts import APPROVE, REJECT, build_receipt, now_utc, sign_receipt
from ztate.contract.record import KIND_PROPOSAL
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role, parse_spiffe_id
from ztate.services.runtime.thread_ids import check_thread_id

log = logging.getLogger("ztate.approval")

TRANSITION_SERVICE_NAME = "transition"
MAX_APPROVALS = 16  # the policy's own bound on a risk rule's approvals
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
DIGEST = re.compile(r"^[0-9a-f]{64}\Z")
PAGE_TOKEN = re.compile(r"^(\d{1,18})\.([0-9a-f]{64})\Z")


@dataclass(frozen=True, slots=True)
class Submission:
    """A parked transition the transition service asks reviewers to decide on."""

    digest: str
    thread_id: str
    base_version: int
    node_id: str
    risk_rules: tuple[str, ...]
    required_approvals: int
    proposal_json: bytes
    base_record_json: bytes
    base_state_json: bytes
    sensitive_keys: frozenset[str]


@dataclass(frozen=True, slots=True)
class Page:
    reviews: list[StoredReview]
    next_page_token: str  # empty on the last page


class Verdict(enum.Enum):
    """What one decision did to its review."""

    RECORDED = "recorded"  # counted; the review waits for more approvals
    CLOSED = "closed"  # the review is decided and its receipt signed
    EXPIRED = "expired"  # the review's deadline had passed: closed, nothing decided


# --- checks, each with one reason -------------------------------------------------------


def check_submitter(caller: Identity) -> None:
    if (caller.role, caller.name) != (Role.SERVICE, TRANSITION_SERVICE_NAME):
        raise errors.RoleForbidden("only the transition service submits reviews")


def check_reader(caller: Identity) -> None:
    if caller.role not in (Role.REVIEWER, Role.OPERATOR):
        raise errors.RoleForbidden(f"a {caller.role} identity may not read reviews")


def check_reviewer(caller: Identity) -> None:
    if caller.role is not Role.REVIEWER:
        raise errors.RoleForbidden(f"a {caller.role} identity may not decide reviews")


def check_digest(digest: str) -> None:
    if not DIGEST.match(digest):
        raise errors.RequestInvalid("digest must be 64 lower-case hex characters")


def check_submission(submission: Submission, trust_domain: str) -> None:
    """Everything a review shows is bound to the digest a reviewer decides on."""
    check_digest(submission.digest)
    check_bound_to_proposal(submission)
    check_proposer(submission.node_id, trust_domain)
    if submission.base_version < 0:
        raise errors.RequestInvalid("base_version must not be negative")
    if not 1 <= submission.required_approvals <= MAX_APPROVALS:
        raise errors.RequestInvalid(f"required_approvals must be between 1 and {MAX_APPROVALS}")


def check_bound_to_proposal(submission: Submission) -> None:
    """The proposal bytes hash to the digest and name the review's thread, base
    version, node and risk rules."""
    if sha256_hex(submission.proposal_json) != submission.digest:
        raise errors.RequestInvalid("proposal_json does not hash to digest")
    proposal = _json_object(submission.proposal_json, "proposal_json")
    claimed: dict[str, Any] = {
        "kind": KIND_PROPOSAL,
        "thread_id": submission.thread_id,
        "base_version": submission.base_version,
        "node_id": submission.node_id,
        "risk_rules": sorted(submission.risk_rules),
    }
    differing = [
        name
        for name, value in claimed.items()
        if proposal.get(name) != value or type(proposal.get(name)) is not type(value)
    ]
    if differing:
        raise errors.RequestInvalid(
            f"the review's {', '.join(differing)} do not match the proposal's"
        )


def check_proposer(node_id: str, trust_domain: str) -> None:
    try:
        proposer = parse_spiffe_id(node_id, trust_domain)
    except errors.IdentityInvalid as bad:
        raise errors.RequestInvalid(f"node_id: {bad.message}") from None
    if proposer.role is not Role.NODE:
        raise errors.RequestInvalid("node_id must be a node identity")


def _json_object(data: bytes, field: str) -> dict[str, Any]:
    try:
        parsed = json.loads(data)
    except ValueError:
        raise errors.RequestInvalid(f"{field} is not JSON") from None
    if not isinstance(parsed, dict):
        raise errors.RequestInvalid(f"{field} must be a JSON object")
    return parsed


def proposer_name(node_id: str) -> str:
    """The name in ``spiffe://<domain>/node/<name>``, checked when the review opened."""
    return node_id.rsplit("/", 1)[-1]


def checked_page_size(requested: int) -> int:
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= requested <= MAX_PAGE_SIZE:
        raise errors.RequestInvalid(f"page_size must be between 1 and {MAX_PAGE_SIZE}")
    return requested


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def encode_page_token(review: StoredReview) -> str:
    """The last position seen: opened_at in unix microseconds, then the digest."""
    micros = (review.opened_at - EPOCH) // timedelta(microseconds=1)
    return f"{micros}.{review.digest}"


def decode_page_token(token: str) -> Cursor | None:
    if not token:
        return None
    match = PAGE_TOKEN.match(token)
    try:
        if match:
            return Cursor(EPOCH + timedelta(microseconds=int(match[1])), match[2])
    except OverflowError:
        pass
    raise errors.RequestInvalid("page_token is not one this service issued")


# --- the service ------------------------------------------------------------------------


class ApprovalService:
    """Opens reviews, collects decisions and signs receipts."""

    def __init__(
        self,
        *,
        store: ReviewStore,
        signing_key: Ed25519PrivateKey,
        key_id: str,
        notifier: Notifier,
        trust_domain: str,
        review_ttl: timedelta,
        receipt_ttl: timedelta,
        decided: asyncio.Event,
        clock: Callable[[], datetime] = now_utc,
        revoked: Callable[[str, int | None], bool] = lambda _spiffe_id, _serial: False,
    ) -> None:
        """``decided`` is set whenever a receipt is signed, to wake its delivery.
        ``revoked(spiffe_id, cert_serial)`` says whether the revocation list, as it is
        now, names an identity or a certificate (``Authenticator.revoked``)."""
        self._store = store
        self._key = signing_key
        self._redaction_key = redaction_key(signing_key)
        self._key_id = key_id
        self._notifier = notifier
        self._trust_domain = trust_domain
        self._review_ttl = review_ttl
        self._receipt_ttl = receipt_ttl
        self._decided = decided
        self._clock = clock
        self._revoked = revoked

    async def submit_review(self, caller: Identity, submission: Submission) -> StoredReview:
        """Open a review for a parked transition; the same digest again is the same review."""
        check_submitter(caller)
        check_submission(submission, self._trust_domain)
        diff = derived_diff(
            _json_object(submission.proposal_json, "proposal_json"),
            submission.base_record_json,
            submission.base_state_json,
            submission.sensitive_keys,
            self._redaction_key,
        )
        now = self._clock()
        review, opened = await self._store.submit(
            NewReview(
                digest=submission.digest,
                thread_id=submission.thread_id,
                base_version=submission.base_version,
                node_id=submission.node_id,
                risk_rules=tuple(sorted(submission.risk_rules)),
                required_approvals=submission.required_approvals,
                proposal=submission.proposal_json,
                redacted_diff=diff,
                opened_at=now,
                expires_at=now + self._review_ttl,
            )
        )
        if opened:
            log.info(
                "opened review %s on %s@%d (%s), %d approval(s) required",
                review.digest[:16],
                review.thread_id,
                review.base_version,
                ", ".join(review.risk_rules),
                review.required_approvals,
            )
            await self._notify("review.opened", review, now)
        return review

    async def list_reviews(
        self,
        caller: Identity,
        *,
        status: str | None,
        thread_id: str | None,
        page_size: int,
        page_token: str,
    ) -> Page:
        """One page of reviews with ``status`` (open by default)."""
        check_reader(caller)
        wanted = status or OPEN
        if wanted not in STATUSES:
            raise errors.RequestInvalid(f"status must be one of {', '.join(STATUSES)}")
        if thread_id:
            check_thread_id(thread_id)
        limit = checked_page_size(page_size)
        after = decode_page_token(page_token)
        reviews = await self._store.page(wanted, thread_id=thread_id, limit=limit, after=after)
        token = encode_page_token(reviews[-1]) if len(reviews) == limit else ""
        return Page(reviews, token)

    async def get_review(self, caller: Identity, digest: str) -> StoredReview:
        check_reader(caller)
        check_digest(digest)
        review = await self._store.get(digest)
        if review is None:
            raise errors.ReviewNotFound("no review has this digest")
        return review

    async def decide(
        self, caller: Identity, digest: str, decision: str, cert_serial: int | None = None
    ) -> StoredReview:
        """Record ``caller``'s decision on ``digest``, made with the certificate of serial
        ``cert_serial``; sign the receipt if it closes the review. One transaction, the
        review's row locked throughout."""
        check_reviewer(caller)
        check_digest(digest)
        if decision not in (APPROVE, REJECT):
            raise errors.RequestInvalid("decision must be approve or reject")
        now = self._clock()
        async with self._store.locked(digest) as locked:
            if locked is None:
                raise errors.ReviewNotFound("no review has this digest")
            before = locked.review
            verdict = await self._decide_locked(locked, caller, decision, now, cert_serial)
            # The answer is what this decision did, read before the lock is released: a
            # reviewer whose approval only counted must not be told "approved" because
            # another reviewer closed the review in between.
            after = await locked.reread() if verdict is not Verdict.EXPIRED else before
        if verdict is Verdict.EXPIRED:
            await self._notify("review.expired", before, now)
            raise errors.ReviewClosed("the review expired before this decision")
        log.info(
            "%s %s review %s%s",
            caller.spiffe_id,
            "approved" if decision == APPROVE else "rejected",
            digest[:16],
            ": decided, receipt signed" if verdict is Verdict.CLOSED else "",
        )
        if verdict is Verdict.CLOSED:
            self._decided.set()
            await self._notify("review.decided", before, now)
        return after

    async def _decide_locked(
        self,
        locked: LockedReview,
        caller: Identity,
        decision: str,
        now: datetime,
        cert_serial: int | None,
    ) -> Verdict:
        review = locked.review
        if review.status != OPEN:
            raise errors.ReviewClosed(f"the review is already {review.status}")
        if review.expires_at <= now:
            await locked.close(EXPIRED, now)
            return Verdict.EXPIRED
        if proposer_name(review.node_id) == caller.name:
            raise errors.SelfApproval(
                "a reviewer can never decide on a transition proposed by an identity of "
                "their own name"
            )
        if not await locked.record_decision(caller.spiffe_id, decision, now, cert_serial):
            raise errors.AlreadyDecided("you already decided on this review")
        if decision == REJECT:
            await self._sign(locked, REJECT, [caller.spiffe_id], now)
            return Verdict.CLOSED
        # an approval counts while neither its reviewer nor the certificate it was made
        # with is revoked: a stolen key's approval, revoked since, is taken back
        approvers = [
            approver.spiffe_id
            for approver in await locked.approvers()
            if not self._revoked(approver.spiffe_id, approver.cert_serial)
        ]
        if len(approvers) < review.required_approvals:
            return Verdict.RECORDED
        await self._sign(locked, APPROVE, approvers, now)
        return Verdict.CLOSED

    async def _sign(
        self, locked: LockedReview, decision: str, reviewers: list[str], now: datetime
    ) -> None:
        review = locked.review
        receipt = build_receipt(
            transition_digest=review.digest,
            thread_id=review.thread_id,
            base_version=review.base_version,
            decision=decision,
            reviewers=reviewers,
            issued_at=now,
            expires_at=now + self._receipt_ttl,
            key_id=self._key_id,
        )
        await locked.close(APPROVED if decision == APPROVE else REJECTED, now)
        await locked.store_receipt(sign_receipt(receipt, self._key), receipt["nonce"], now)

    async def expire_overdue(self) -> int:
        """Close open reviews whose deadline passed; returns how many."""
        now = self._clock()
        expired = await self._store.expire_open(now)
        for review in expired:
            log.info("review %s on %s expired undecided", review.digest[:16], review.thread_id)
            await self._notify("review.expired", review, now)
        return len(expired)

    async def _notify(self, kind: str, review: StoredReview | ExpiredReview, now: datetime) -> None:
        await self._notifier.notify(
            ReviewEvent(kind, review.digest, review.thread_id, review.risk_rules, now)
        )
