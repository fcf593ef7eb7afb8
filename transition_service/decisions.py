"""Applying approval decisions and reporting the outcome of parked transitions.

A receipt is checked, in this order, each check with its own reason: the caller
is the approval service; the Ed25519 signature, the form and the validity period
(``RECEIPT_INVALID``, ``RECEIPT_EXPIRED``); it binds a parked transition of the
same thread and base version (``RECEIPT_MISMATCH``); its nonce was never used
(``RECEIPT_REPLAYED``); the transition is still pending (``REVIEW_CLOSED``). An
approval then commits with compare-and-swap at the parked base version; if the
head moved meanwhile, the approval authorises nothing and the transition is
marked stale (``APPROVAL_STALE``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

import orjson

from ztate.contract.canonical import canonical_bytes
from ztate.contract.errors import ContractError
from ztate.contract.keyring import Keyring, PublicKeys
from ztate.contract.receipts import APPROVE, SignedReceipt, verify_receipt
from ztate.contract.record import KIND_TRANSITION, build_record, seal
from ztate.services.policy.changes import Change, apply_patch, changed_keys, check_invariants
from ztate.services.policy.model import PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.telemetry import COMMITTED, NO_METRICS, Metrics, note_transition
from ztate.services.runtime.thread_ids import THREAD_ID
from ztate.services.store.approvals import ApprovalStore, Approved, Rejected
from ztate.services.store.interface import TransitionStore
from ztate.services.store.rows import Head, PendingTransition, Rejection, StoredTransition
from ztate.transition_service.checks import (
    IDEMPOTENCY_KEY,
    check_credentials,
    check_layers,
    check_privileged,
    check_schema,
    check_state_size,
    check_writable,
)
from ztate.transition_service.heads import CachedHead, HeadCache
from ztate.transition_service.outcomes import OutcomeListener
from ztate.transition_service.usecase import as_stored
from ztate.transition_service.work import author_node

APPROVAL_SERVICE_NAME = "approval"
MAX_WAIT_SECONDS = 60.0
DIGEST = re.compile(r"[0-9a-f]{64}")
RECHECK_SECONDS = 1.0


class Outcome(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    REJECTED = "rejected"
    EXPIRED = "expired"
    STALE = "stale"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Resolution:
    outcome: Outcome
    transition: StoredTransition | None = None
    reason: str | None = None  # the refusal's reason code, when REFUSED


@dataclass(frozen=True, slots=True)
class WaitFor:
    """The parked transition WaitForOutcome names: exactly one of its digest or the
    proposer's handle (``pending_handle``)."""

    digest: str = ""
    handle: str = ""


def pending_handle(thread_id: str, idempotency_key: str) -> str:
    """How a proposer names its own parked proposal: only what it sent, so, unlike the
    transition digest, nothing that commits to state it may not read."""
    return f"{thread_id}/{idempotency_key}"


def parse_handle(handle: str) -> tuple[str, str]:
    """``(thread_id, idempotency_key)`` of a handle; thread ids never hold a "/"."""
    thread_id, slash, key = handle.partition("/")
    if not slash or not THREAD_ID.fullmatch(thread_id) or not IDEMPOTENCY_KEY.match(key):
        raise errors.RequestInvalid(
            "handle must be <thread_id>/<idempotency_key>, as PendingTransition.handle gives it"
        )
    return thread_id, key


class DecisionPipeline:
    """Turns signed receipts into commits or closures, and answers who waits."""

    def __init__(
        self,
        *,
        store: TransitionStore,
        approvals: ApprovalStore,
        keyring: Keyring,
        public_keys: PublicKeys,
        heads: HeadCache,
        listener: OutcomeListener,
        policies: PolicySet,
        max_state_bytes: int = 1024 * 1024,
        metrics: Metrics = NO_METRICS,
        revoked: Callable[[str], bool] = lambda _spiffe_id: False,
    ) -> None:
        self._store = store
        # whether this service's revocation list, as it is now, names an identity
        self._revoked = revoked
        self._policies = policies
        self._max_state_bytes = max_state_bytes
        self._approvals = approvals
        self._keyring = keyring
        self._public_keys = public_keys
        self._heads = heads
        self._listener = listener
        self._metrics = metrics

    async def apply(self, caller: Identity, signed: SignedReceipt) -> Resolution:
        if (caller.role, caller.name) != (Role.SERVICE, APPROVAL_SERVICE_NAME):
            raise errors.RoleForbidden("only the approval service delivers decisions")
        now = datetime.now(UTC)
        try:
            receipt = verify_receipt(signed, self._public_keys, now=now)
        except ContractError as exc:
            raise errors.from_contract(exc) from None
        # one round trip by the receipt's thread (single-shard on Citus): the parked row,
        # its candidate state, the head and whether the nonce was used
        looked = await self._approvals.decision_lookup(
            str(receipt["thread_id"]), str(receipt["transition_digest"]), str(receipt["nonce"])
        )
        pending = looked.pending
        if pending is None:  # not parked on that thread: on another, or nowhere
            pending = await self._store.pending_by_digest(receipt["transition_digest"])
        if pending is None:
            raise errors.ReceiptMismatch("no parked transition has the receipt's digest")
        if (receipt["thread_id"], receipt["base_version"]) != (
            pending.thread_id,
            pending.base_version,
        ):
            raise errors.ReceiptMismatch(
                "the receipt binds another thread or base version than the parked transition"
            )
        self._check_reviewers(receipt, pending)
        if looked.nonce_used:
            raise errors.ReceiptReplayed("the receipt's nonce was used before")
        if pending.status != "pending":
            raise errors.ReviewClosed(f"the transition is already {pending.status}")
        if receipt["decision"] != APPROVE:
            closed = await self._approvals.close_rejected(pending, signed, receipt["nonce"], now)
            if closed is Rejected.NONCE_USED:
                raise errors.ReceiptReplayed("the receipt's nonce was used before")
            if closed is Rejected.NOT_PENDING:
                raise await self._decided_meanwhile(pending, receipt["nonce"], "decided")
            note_transition(pending.thread_id, pending.base_version, Outcome.REJECTED.value)
            return Resolution(Outcome.REJECTED)
        head = looked.head
        refusal = self._revoked_reviewers(receipt, pending) or self._recheck(pending, head)
        if refusal is not None:
            return await self._refuse(pending, refusal, now)
        # a parked row has its thread (a foreign key) and its candidate state
        assert head is not None
        assert looked.candidate_state is not None
        return await self._commit(
            pending,
            looked.candidate_state,
            head,  # the base, or the head moved and the compare-and-swap answers stale
            signed,
            receipt["nonce"],
            now,
        )

    def _recheck(self, pending: PendingTransition, head: Head | None) -> errors.ZtateError | None:
        """The proposal against the policy in force now: a parked change must not outlive
        a tightening (a fresh identical proposal would be refused). None: it passes, or
        the head moved (the compare-and-swap then answers stale)."""
        if head is None or head.version != pending.base_version:
            return None
        patch = orjson.loads(pending.proposal)["patch"]
        node = pending.node_id.rsplit("/", 1)[-1]
        try:
            policy = self._policies.get(head.policy_name)
            if policy is None:
                raise errors.PolicyNotFound(f"the thread's policy {head.policy_name!r} is gone")
            if self._policies.of_node(node) is not policy:
                raise errors.NodeNotRegistered(f"node {node!r} is no longer in the policy")
            check_writable(patch, policy.writable(node))
            check_schema(patch, policy)
            check_credentials(patch, policy)
            check_layers(patch, policy, node)
            old = orjson.loads(head.state_bytes)
            new = apply_patch(old, patch)
            check_invariants(policy, Change.of(policy, new, old, patch, node))
            check_state_size(canonical_bytes(new), self._max_state_bytes)
        except errors.ZtateError as refusal:
            return refusal
        return None

    def _revoked_reviewers(
        self, receipt: dict[str, object], pending: PendingTransition
    ) -> errors.ZtateError | None:
        """An approval whose reviewers this service's revocation list now names, too many
        of them to leave the approvals the transition needs: refused, not committed. The
        approval service counts only unrevoked approvers when a review closes; a receipt
        delivered later (the transition service out of reach for minutes, or the two
        services' lists out of step) is checked again here. A receipt names identities,
        not certificates: a revoked certificate serial is the approval service's to
        check."""
        reviewers = sorted(set(cast(list[str], receipt["reviewers"])))  # _check_reviewers
        revoked = [r for r in reviewers if self._revoked(r)]
        if not revoked or len(reviewers) - len(revoked) >= pending.required_approvals:
            return None
        return errors.IdentityRevoked(
            f"the approval of {', '.join(revoked)} no longer counts: the identity is revoked"
        )

    async def _refuse(
        self, pending: PendingTransition, refusal: errors.ZtateError, now: datetime
    ) -> Resolution:
        """End an approved transition that may not commit: refused, with a rejection row
        the proposer, the reviewer (through the approval service) and auditors see."""
        closed = await self._approvals.close_refused(
            pending,
            Rejection(
                method="ApplyDecision",
                node_id=pending.node_id,
                thread_id=pending.thread_id,
                base_version=pending.base_version,
                reason=refusal.reason,
                keys=refusal.keys,
                patch_digest=None,
                patch_bytes=None,
                message=f"approved, but refused at commit: {refusal.message}",
            ),
            now,
        )
        if not closed:
            raise errors.ReviewClosed("the transition was decided meanwhile")
        note_transition(pending.thread_id, pending.base_version, Outcome.REFUSED.value)
        return Resolution(Outcome.REFUSED, reason=refusal.reason)

    @staticmethod
    def _check_reviewers(receipt: dict[str, object], pending: PendingTransition) -> None:
        """Defence in depth: the approval service enforces these too."""
        reviewers = receipt["reviewers"]
        if not isinstance(reviewers, list) or not all(isinstance(r, str) for r in reviewers):
            raise errors.ReceiptInvalid("reviewers must be a list of SPIFFE IDs")
        if receipt["decision"] != APPROVE:
            return
        if len(set(reviewers)) < pending.required_approvals:
            raise errors.ReceiptMismatch(
                f"the transition needs {pending.required_approvals} distinct approvals; "
                f"the receipt names {len(set(reviewers))}"
            )
        proposer = pending.node_id.rsplit("/", 1)[-1]
        if any(str(r).rsplit("/", 1)[-1] == proposer for r in reviewers):
            raise errors.ReceiptMismatch("a reviewer of the receipt proposed the transition")

    async def _commit(
        self,
        pending: PendingTransition,
        state_bytes: bytes,
        head: Head,
        signed: SignedReceipt,
        nonce: str,
        now: datetime,
    ) -> Resolution:
        """Commit an approved transition on ``head``, its thread's (whose policy a commit
        never changes, for the head cache; whose state the wakes are counted against)."""
        policy_name = head.policy_name
        proposal = json.loads(pending.proposal)
        sealed = seal(
            build_record(
                kind=KIND_TRANSITION,
                thread_id=pending.thread_id,
                version=pending.base_version + 1,
                parent_digest=pending.parent_digest,
                node_id=pending.node_id,
                patch=proposal["patch"],
                state_digest=proposal["state_digest"],
                policy_digest=proposal["policy_digest"],
                receipt_digest=signed.digest,
                key_id=self._keyring.current,
                committed_at=now,
                # the rules the approved proposal matched: the receipt's binding
                # checks offline from the record alone (format 2)
                risk_rules=proposal["risk_rules"],
            ),
            self._keyring,
        )
        # whom the version wakes, recorded by the commit itself (docs/work.md)
        policy = self._policies.get(policy_name)
        woken = (
            policy.woken(
                changed_keys(orjson.loads(head.state_bytes), proposal["patch"]),
                orjson.loads(state_bytes),
                author_node(pending.node_id),
            )
            if policy is not None
            else []
        )
        result = await self._approvals.commit_approved(
            sealed, state_bytes, pending, signed, nonce, now, woken
        )
        if result.outcome is Approved.NONCE_USED:
            raise errors.ReceiptReplayed("the receipt's nonce was used before")
        if result.outcome is Approved.HEAD_MOVED:  # the call closed the row as stale
            self._metrics.cas_conflicts.add(1)  # the head moved since it was parked
            raise errors.ApprovalStale(
                "the thread moved on since the transition was parked; propose again"
            )
        # a committed request took the idempotency key meanwhile, so this parked
        # transition can never commit (stale, though not a CAS conflict); rare, so the
        # row is closed by a second call
        if result.outcome is Approved.KEY_TAKEN:
            await self._approvals.close_without_decision([pending], "stale", now)
            raise errors.ApprovalStale(
                "the thread moved on since the transition was parked; propose again"
            )
        if result.outcome is Approved.NOT_PENDING:
            raise await self._decided_meanwhile(pending, nonce, str(result.status))
        self._heads.put(
            pending.thread_id,
            CachedHead(
                pending.base_version + 1, sealed.digest, orjson.loads(state_bytes), policy_name
            ),
        )
        stored = as_stored(sealed, now, pending.idempotency_key, pending.request_digest)
        note_transition(stored.thread_id, stored.version, COMMITTED)
        return Resolution(Outcome.COMMITTED, stored)

    async def _decided_meanwhile(
        self, pending: PendingTransition, nonce: str, status: str
    ) -> errors.ZtateError:
        """The error for a decision that found the parked row closed after its look-up
        found it pending and the nonce unused. When the decision that won the race used
        this receipt's nonce (the same receipt, delivered twice at once), this one is its
        replay, answered as a replay after the commit is: ``RECEIPT_REPLAYED``, the
        check that comes before the row's status (one more round trip, only here)."""
        looked = await self._approvals.decision_lookup(pending.thread_id, pending.digest, nonce)
        if looked.nonce_used:
            return errors.ReceiptReplayed("the receipt's nonce was used before")
        return errors.ReviewClosed(f"the transition was {status} meanwhile")

    async def resolution(self, pending: PendingTransition) -> Resolution:
        outcome = Outcome(pending.status)
        if outcome is Outcome.REFUSED:
            reason = await self._store.refusal_at_commit(pending)
            return Resolution(outcome, reason=reason)
        if outcome is not Outcome.COMMITTED:
            return Resolution(outcome)
        transition = await self._store.find_by_idempotency_key(
            pending.thread_id, pending.node_id, pending.idempotency_key
        )
        return Resolution(outcome, transition)

    async def wait(self, caller: Identity, wanted: WaitFor, patience: float | None) -> Resolution:
        """The outcome of a parked transition, once it has one or ``patience`` seconds pass."""
        pending = await self._named(caller, wanted)
        digest = pending.digest
        loop = asyncio.get_running_loop()
        # 0.0 is a real answer (the caller's deadline is near), not "no deadline"
        wait = MAX_WAIT_SECONDS if patience is None else min(patience, MAX_WAIT_SECONDS)
        deadline = loop.time() + wait
        async with self._listener.watching(digest) as announced:
            while True:
                pending = await self._visible(caller, digest)
                if pending.status != "pending":
                    return await self.resolution(pending)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return Resolution(Outcome.PENDING)
                announced.clear()
                try:
                    await asyncio.wait_for(announced.wait(), min(remaining, RECHECK_SECONDS))
                except TimeoutError:
                    continue

    async def _named(self, caller: Identity, wanted: WaitFor) -> PendingTransition:
        if bool(wanted.digest) == bool(wanted.handle):
            raise errors.RequestInvalid(
                "name the parked transition by exactly one of digest, handle"
            )
        if wanted.digest:
            if not DIGEST.fullmatch(wanted.digest):
                raise errors.RequestInvalid("digest must be 64 lower-case hex characters")
            return await self._visible(caller, wanted.digest)
        thread_id, key = parse_handle(wanted.handle)
        # a handle names the caller's own proposal: the key is unique per (thread, node)
        pending = await self._store.find_pending(thread_id, caller.spiffe_id, key)
        if pending is None:
            raise errors.ReviewNotFound("no parked transition of yours has this handle")
        return pending

    async def _visible(self, caller: Identity, digest: str) -> PendingTransition:
        pending = await self._store.pending_by_digest(digest)
        if caller.role is Role.NODE:
            if pending is None or pending.node_id != caller.spiffe_id:
                raise errors.ReviewNotFound("no parked transition of yours has this digest")
        else:
            check_privileged(caller, "wait for other nodes' transitions")
            if pending is None:
                raise errors.ReviewNotFound("no parked transition has this digest")
        return pending
