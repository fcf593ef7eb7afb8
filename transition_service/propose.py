"""Proposing a transition: every check a proposal passes, top to bottom, then a commit
with compare-and-swap, or parking for approval, or a refusal recorded with its reason."""

from __future__ import annotations

from datetime import UTC, datetime

from ztate.contract.canonical import JsonObject, canonical_bytes, hashed_name, sha256_hex
from ztate.contract.record import KIND_TRANSITION, build_proposal, build_record, seal
from ztate.services.policy.changes import (
    Change,
    apply_patch,
    changed_keys,
    check_invariants,
    matched_risk_rules,
)
from ztate.services.policy.model import Policy
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity
from ztate.services.runtime.telemetry import (
    COMMITTED,
    PARKED,
    REFUSED,
    note_transition,
)
from ztate.services.runtime.thread_ids import THREAD_ID
from ztate.services.store.interface import Commit, HeadLookup, Park, StaleRefusal
from ztate.services.store.rows import PendingTransition, Rejection
from ztate.transition_service.checks import (
    check_bound_policy,
    check_credentials,
    check_layers,
    check_proposal_fields,
    check_registered,
    check_schema,
    check_size,
    check_state_size,
    check_storable,
    check_writable,
    key_reused,
    parse_admitted,
    request_digest,
    thread_not_found,
)
from ztate.transition_service.heads import CachedHead
from ztate.transition_service.requests import (
    Committed,
    Outcome,
    Parked,
    Proposal,
)
from ztate.transition_service.usecase import UseCase, as_stored
from ztate.transition_service.work import LEASE_LOST, LeasedProposal


class Propose(UseCase):
    """``ProposeTransition``: commit, park, replay, or refuse (and record the refusal)."""

    async def propose(
        self, caller: Identity, proposal: Proposal, lease: LeasedProposal | None = None
    ) -> Outcome:
        """Run every check; commit, park, replay, or refuse (and record the refusal).
        Under a ``lease``: refused with ``LeaseLost`` first of all when its grant no
        longer holds it, checked before the first statement, or by the commit or the
        park itself (one round trip for a proposal that commits on a cached head)."""
        try:
            outcome = await self._propose(caller, proposal, lease)
        except errors.ZtateError as refusal:  # StorageUnavailable too: the store's boundary
            lost = await _fenced(lease, refusal)
            if lost is not None:  # refused before its lease was fenced, and it is lost
                await self.refused(caller, proposal, lost)
                raise lost from None
            await self.refused(caller, proposal, refusal, recorded=refusal.recorded)
            if isinstance(refusal, errors.PolicyMismatch):
                raise thread_not_found(proposal.thread_id) from None
            raise
        if self._metrics.enabled:
            observed(outcome)
            self._metrics.proposal(decision_of(outcome))
        return outcome

    async def refused(
        self,
        caller: Identity,
        proposal: Proposal,
        refusal: errors.ZtateError,
        *,
        recorded: bool = False,
    ) -> None:
        """Count a refusal of ``caller``'s proposal and record its rejection row (also for
        a refusal before the pipeline: a revoked certificate, ``rpc_guard``), unless the
        statement that found it ``recorded`` it already."""
        if self._metrics.enabled:
            self._metrics.proposal(REFUSED, refusal.reason)
            note_transition(proposal.thread_id, proposal.expected_version)
        if not recorded and not isinstance(refusal, errors.StorageUnavailable):
            await self._store.record_rejection(_rejection(caller, proposal, refusal))

    async def _propose(
        self, caller: Identity, proposal: Proposal, lease: LeasedProposal | None
    ) -> Outcome:
        policy = check_registered(caller, self._policies)
        check_proposal_fields(proposal)
        node = caller.name
        limit = policy.max_patch_bytes(node) or self._max_patch_bytes
        check_size(proposal.patch_json, limit, "patch")
        patch = parse_admitted(proposal.patch_json, "patch", self._max_depth)
        check_storable(patch, "patch", proposal.patch_json)
        check_writable(patch, policy.writable(node))
        check_schema(patch, policy)
        check_credentials(patch, policy)
        check_layers(patch, policy, node)

        base = await self._base(caller, policy, proposal, lease)
        if not isinstance(base, CachedHead):
            return base
        state = apply_patch(base.state, patch)
        change = Change.of(policy, state, base.state, patch, node)
        check_invariants(policy, change)
        state_bytes = canonical_bytes(state)
        check_state_size(state_bytes, self._max_state_bytes)
        state_digest = sha256_hex(state_bytes)
        digest_of_request = request_digest(proposal)

        risky = matched_risk_rules(policy, change)
        if risky:
            return await self._park(
                caller,
                proposal,
                policy,
                base,
                patch,
                (state_bytes, state_digest),
                risky,
                digest_of_request,
                lease,
            )

        now = datetime.now(UTC)
        sealed = seal(
            build_record(
                kind=KIND_TRANSITION,
                thread_id=proposal.thread_id,
                version=base.version + 1,
                parent_digest=base.digest,
                node_id=caller.spiffe_id,
                patch=patch,
                state_digest=state_digest,
                policy_digest=policy.digest,
                receipt_digest=None,
                key_id=self._keyring.current,
                committed_at=now,
                risk_rules=(),  # it matched none, or it would be parked
            ),
            self._keyring,
        )
        if lease is not None:
            # the commit carries the fence: whatever it answers (even a failure whose
            # outcome is unknown: it may have committed and released the lease), the
            # lease is not fenced again for this proposal
            lease.fenced = True
        result = await self._store.commit(
            sealed,
            state_bytes,
            expected_version=proposal.expected_version,
            committed_at=now,
            idempotency_key=proposal.idempotency_key,
            request_digest=digest_of_request,
            # whom the version wakes, recorded by the commit itself (docs/work.md)
            # by the keys it really changed: the same value again wakes no one
            woken=policy.woken(changed_keys(base.state, patch), state, node),
            # fenced and released by the commit's own transaction (migration 0019)
            lease=None if lease is None else lease.claim,
        )
        if result is Commit.LEASE_LOST:
            raise errors.LeaseLost(LEASE_LOST)
        if result is Commit.COMMITTED:
            self._heads.put(
                proposal.thread_id,
                CachedHead(base.version + 1, sealed.digest, state, base.policy_name),
            )
            return Committed(
                as_stored(sealed, now, proposal.idempotency_key, digest_of_request), False
            )
        return await self._explain_lost_race(caller, policy, proposal, result, lease)

    async def _park(
        self,
        caller: Identity,
        proposal: Proposal,
        policy: Policy,
        base: CachedHead,
        patch: JsonObject,
        state: tuple[bytes, str],
        risky: list[str],
        digest_of_request: str,
        lease: LeasedProposal | None,
    ) -> Outcome:
        """Keep a risky proposal for a human decision bound to its digest (``state``:
        the candidate state's canonical bytes and their digest, computed once)."""
        state_bytes, state_digest = state
        proposal_bytes = canonical_bytes(
            build_proposal(
                thread_id=proposal.thread_id,
                base_version=base.version,
                parent_digest=base.digest,
                node_id=caller.spiffe_id,
                patch=patch,
                state_digest=state_digest,
                policy_digest=policy.digest,
                risk_rules=risky,
            )
        )
        if lease is not None:
            # the park carries the fence (migration 0024): whatever it answers, the lease
            # is not fenced again for this proposal
            lease.fenced = True
        parking = await self._store.park(
            PendingTransition(
                digest=sha256_hex(proposal_bytes),
                thread_id=proposal.thread_id,
                base_version=base.version,
                parent_digest=base.digest,
                node_id=caller.spiffe_id,
                proposal=proposal_bytes,
                risk_rules=sorted(risky),
                idempotency_key=proposal.idempotency_key,
                request_digest=digest_of_request,
                status="pending",
                parked_at=datetime.now(UTC),
                sensitive_keys=sorted(key for key in patch if policy.document.keys[key].sensitive),
                required_approvals=max(
                    rule.approvals for rule in policy.risk_rules if rule.name in risky
                ),
            ),
            state_bytes,
            lease=None if lease is None else lease.claim,
        )
        if parking.outcome is Park.LEASE_LOST:
            raise errors.LeaseLost(LEASE_LOST)
        self._parked.set()
        parked, inserted = parking.pending, parking.outcome is Park.PARKED
        if parked is None:  # KEY_TAKEN: the key already names a committed request
            return await self._replay_or_stale(caller, policy, proposal, lease)
        same_request_key = (parked.node_id, parked.idempotency_key) == (
            caller.spiffe_id,
            proposal.idempotency_key,
        )
        if same_request_key and parked.request_digest != digest_of_request:
            raise key_reused()
        if not inserted and not same_request_key and parked.status != "pending":
            raise errors.ReviewClosed(
                f"this exact change on this version was already {parked.status}; change it "
                "or propose on a newer version"
            )
        # Not inserted: this request, or this exact proposal, is parked already.
        return Parked(parked, replayed=not inserted)

    async def _base(
        self, caller: Identity, policy: Policy, proposal: Proposal, lease: LeasedProposal | None
    ) -> CachedHead | Outcome:
        """The head to build on: bound to the caller's policy (checked first, so that
        nothing, not even a version, is told about another workflow's thread) and at
        the expected version."""
        cached = self._heads.get(proposal.thread_id, proposal.expected_version)
        if cached is not None:
            check_bound_policy(caller, policy, cached)
            return cached
        found = await self._look_up(caller, policy, proposal, lease)
        head = found.head
        if head is None:
            raise thread_not_found(proposal.thread_id)
        check_bound_policy(caller, policy, head)
        state = self._remember(head)
        if head.version != proposal.expected_version:
            return _replayed_or_stale(proposal, found, head.version)
        return CachedHead(head.version, head.digest, state, head.policy_name)

    async def _look_up(
        self, caller: Identity, policy: Policy, proposal: Proposal, lease: LeasedProposal | None
    ) -> HeadLookup:
        """The head and what the request's key names, in one round trip; a stale
        proposal's rejection row written by the same statement. Under a lease, fenced
        first (a lost lease is refused before the stale version)."""
        if lease is not None:
            await lease.fence()
        template = errors.StaleVersion(_stale_message(proposal.expected_version, "%s"))
        return await self._store.head_for_request(
            proposal.thread_id,
            caller.spiffe_id,
            proposal.idempotency_key,
            StaleRefusal(_rejection(caller, proposal, template), policy.name),
        )

    async def _explain_lost_race(
        self,
        caller: Identity,
        policy: Policy,
        proposal: Proposal,
        result: Commit,
        lease: LeasedProposal | None,
    ) -> Outcome:
        if result is Commit.HEAD_MOVED:
            self._metrics.cas_conflicts.add(1)  # a conflict, not an idempotency key taken
        return await self._replay_or_stale(caller, policy, proposal, lease)

    async def _replay_or_stale(
        self, caller: Identity, policy: Policy, proposal: Proposal, lease: LeasedProposal | None
    ) -> Outcome:
        found = await self._look_up(caller, policy, proposal, lease)
        if found.head is None:
            raise thread_not_found(proposal.thread_id)
        check_bound_policy(caller, policy, found.head)
        self._remember(found.head)
        return _replayed_or_stale(proposal, found, found.head.version)


async def _fenced(
    lease: LeasedProposal | None, refusal: errors.ZtateError
) -> errors.ZtateError | None:
    """A lease not fenced yet (the proposal was refused before any statement) is fenced
    now: the fence's own refusal (``LeaseLost``, or ``StorageUnavailable``) is the one
    to answer, as when the fence came first of all; None when ``refusal`` stands."""
    if lease is None or lease.fenced or isinstance(refusal, errors.LeaseLost):
        return None
    try:
        await lease.fence()
    except errors.ZtateError as failure:
        return failure
    return None


def _stale_message(expected_version: int, head_version: str) -> str:
    return f"expected version {expected_version}, but the head is at {head_version}"


def _replayed_or_stale(proposal: Proposal, found: HeadLookup, head_version: int) -> Outcome:
    """The replay of what the request's key already names, or ``StaleVersion`` (marked
    ``recorded`` when the look-up wrote its rejection row)."""
    if found.earlier is not None:
        if found.earlier.request_digest != request_digest(proposal):
            raise key_reused()
        return Committed(found.earlier, True)
    if found.parked is not None:
        if found.parked.request_digest != request_digest(proposal):
            raise key_reused()
        return Parked(found.parked, True)
    stale = errors.StaleVersion(
        _stale_message(proposal.expected_version, str(head_version)),
        current_version=head_version,
    )
    stale.recorded = found.refused
    raise stale


def decision_of(outcome: Outcome) -> str:
    """What a proposal's span and metrics call its outcome."""
    if outcome.replayed:
        return "replayed"
    return COMMITTED if isinstance(outcome, Committed) else PARKED


def observed(outcome: Outcome) -> None:
    """The thread, the version (committed, or the base of a parked one) and the decision
    of the current call."""
    if isinstance(outcome, Committed):
        where = (outcome.transition.thread_id, outcome.transition.version)
    else:
        where = (outcome.pending.thread_id, outcome.pending.base_version)
    note_transition(*where, decision_of(outcome))


def _thread_label(thread_id: str) -> str:
    return thread_id if THREAD_ID.fullmatch(thread_id) else hashed_name(thread_id)


def _rejection(caller: Identity, proposal: Proposal, refusal: errors.ZtateError) -> Rejection:
    return Rejection(
        method="ProposeTransition",
        node_id=caller.spiffe_id,
        # refused before its id was checked: one that breaks the thread-id rule (escape
        # sequences for an operator's terminal, say) is recorded by its hash, as
        # invalid key names are
        thread_id=_thread_label(proposal.thread_id),
        base_version=proposal.expected_version,
        reason=refusal.reason,
        keys=refusal.keys,
        patch_digest=sha256_hex(proposal.patch_json),
        patch_bytes=len(proposal.patch_json),
        message=refusal.message,
    )
