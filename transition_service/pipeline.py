"""The proposal pipeline: every check a proposal passes, top to bottom.

A proposal is checked in this order, each check a small function with its own
reason code: the caller's identity and registration, request fields and size
(before parsing), strict parsing, the write allowlist, the strict schema,
credentials, authority layers; then, on the head it builds on, the policy the
thread is bound to, the CEL invariants of the candidate state and the risk
rules. A risky proposal is parked; any other passing proposal is sealed into the
chain and committed with compare-and-swap. The pipeline knows nothing of gRPC;
``ztate.transition_service.server`` adapts it.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import orjson

from ztate.services.canonical import JsonObject, canonical_bytes, parse_object, sha256_hex
from ztate.services.chain import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_REVERT,
    KIND_TRANSITION,
    SealedRecord,
    build_proposal,
    build_record,
    seal,
)
from ztate.services.keyring import Keyring
from ztate.services.policy.changes import Change, apply_patch, check_invariants, matched_risk_rules
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.outage import STORAGE_ERRORS
from ztate.services.runtime.telemetry import (
    COMMITTED,
    NO_METRICS,
    PARKED,
    REFUSED,
    Metrics,
    note_transition,
)
from ztate.services.store.transitions import (
    Head,
    PendingTransition,
    Rejection,
    StoredTransition,
    TransitionStore,
)
from ztate.transition_service.checks import (
    check_bound_policy,
    check_credentials,
    check_declared,
    check_layers,
    check_privileged,
    check_proposal_fields,
    check_registered,
    check_revert_fields,
    check_revert_target,
    check_schema,
    check_size,
    check_state_size,
    check_storable,
    check_thread_id,
    check_writable,
    hide_foreign_thread,
    key_reused,
    request_digest,
    restoring_patch,
    revert_digest,
    thread_not_found,
)
from ztate.transition_service.heads import CachedHead, HeadCache
from ztate.transition_service.requests import (
    Committed,
    Outcome,
    Parked,
    Proposal,
    Revert,
    View,
)


class TransitionPipeline:
    """Decides, records and signs transitions."""

    def __init__(
        self,
        *,
        store: TransitionStore,
        policies: PolicySet,
        keyring: Keyring,
        max_patch_bytes: int,
        max_depth: int,
        head_cache_size: int,
        max_state_bytes: int = 1024 * 1024,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._store = store
        self._max_state_bytes = max_state_bytes
        self._metrics = metrics
        self._policies = policies
        self._keyring = keyring
        self._max_patch_bytes = max_patch_bytes
        self._max_depth = max_depth
        self._heads = HeadCache(head_cache_size)
        # set whenever a proposal is parked, so the approval outbox wakes up
        self._parked = asyncio.Event()

    @property
    def parked(self) -> asyncio.Event:
        return self._parked

    @property
    def heads(self) -> HeadCache:
        return self._heads

    async def create_thread(
        self, caller: Identity, thread_id: str, policy_name: str, initial_state_json: bytes
    ) -> StoredTransition:
        check_privileged(caller, "create threads")
        check_thread_id(thread_id)
        policy = self._policy_named(policy_name)
        check_size(initial_state_json, self._max_patch_bytes, "initial state")
        initial = parse_object(initial_state_json, what="initial state", max_depth=self._max_depth)
        check_storable(initial, "initial state")
        check_declared(initial, policy)
        check_schema(initial, policy)
        check_credentials(initial, policy)
        state = apply_patch({}, initial)  # the genesis patch is applied like any other
        check_invariants(policy, Change.of(policy, state, {}, initial, caller.name))
        state_bytes = canonical_bytes(state)
        check_state_size(state_bytes, self._max_state_bytes)
        now = datetime.now(UTC)
        sealed = seal(
            build_record(
                kind=KIND_GENESIS,
                thread_id=thread_id,
                version=0,
                parent_digest=GENESIS_PARENT,
                node_id=caller.spiffe_id,
                patch=initial,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy.digest,
                receipt_digest=None,
                key_id=self._keyring.current,
                committed_at=now,
            ),
            self._keyring,
        )
        created = await self._store.create_thread(
            sealed, state_bytes, policy_name=policy.name, committed_at=now
        )
        if not created:
            raise errors.ThreadExists(f"thread {thread_id!r} already exists")
        self._heads.put(thread_id, CachedHead(0, sealed.digest, state, policy.name))
        return as_stored(sealed, now, None, None)

    def _policy_named(self, name: str) -> Policy:
        if not name:
            only = self._policies.only
            if only is None:
                raise errors.RequestInvalid("several policies are loaded: name the thread's policy")
            return only
        policy = self._policies.get(name)
        if policy is None:
            raise errors.PolicyNotFound(f"no policy named {name!r} is loaded")
        return policy

    async def view(self, caller: Identity, thread_id: str) -> View:
        check_thread_id(thread_id)
        readable: frozenset[str] | None = None
        policy = None
        if caller.role is Role.NODE:
            policy = check_registered(caller, self._policies)
            readable = policy.readable(caller.name)
        else:
            check_privileged(caller, "read views")
        head = await self._store.read_head(thread_id)
        if head is None:
            raise thread_not_found(thread_id)
        if policy is not None:
            hide_foreign_thread(caller, policy, head)
        state = self._remember(head)
        projected = state if readable is None else {k: state[k] for k in state.keys() & readable}
        return View(thread_id, head.version, head.digest, canonical_bytes(projected))

    async def propose(self, caller: Identity, proposal: Proposal) -> Outcome:
        """Run every check; commit, park, replay, or refuse (and record the refusal)."""
        try:
            outcome = await self._propose(caller, proposal)
        except STORAGE_ERRORS:
            # not a ZtateError: ztate.services.runtime.rpc_guard answers it as STORAGE_UNAVAILABLE
            if self._metrics.enabled:
                self._metrics.proposal(REFUSED, errors.StorageUnavailable.reason)
                note_transition(proposal.thread_id, proposal.expected_version)
            raise
        except errors.ZtateError as refusal:
            if self._metrics.enabled:
                self._metrics.proposal(REFUSED, refusal.reason)
                note_transition(proposal.thread_id, proposal.expected_version)
            if not isinstance(refusal, errors.StorageUnavailable):
                await self._store.record_rejection(_rejection(caller, proposal, refusal))
            if isinstance(refusal, errors.PolicyMismatch):
                raise thread_not_found(proposal.thread_id) from None
            raise
        if self._metrics.enabled:
            observed(outcome)
            self._metrics.proposal(decision_of(outcome))
        return outcome

    async def _propose(self, caller: Identity, proposal: Proposal) -> Outcome:
        policy = check_registered(caller, self._policies)
        check_proposal_fields(proposal)
        node = caller.name
        limit = policy.max_patch_bytes(node) or self._max_patch_bytes
        check_size(proposal.patch_json, limit, "patch")
        patch = parse_object(proposal.patch_json, what="patch", max_depth=self._max_depth)
        check_storable(patch, "patch")
        check_writable(patch, policy.writable(node))
        check_schema(patch, policy)
        check_credentials(patch, policy)
        check_layers(patch, policy, node)

        base = await self._base(caller, policy, proposal)
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
                caller, proposal, policy, base, patch, state_bytes, risky, digest_of_request
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
            ),
            self._keyring,
        )
        committed = await self._store.commit(
            sealed,
            state_bytes,
            expected_version=proposal.expected_version,
            committed_at=now,
            idempotency_key=proposal.idempotency_key,
            request_digest=digest_of_request,
        )
        if committed:
            self._heads.put(
                proposal.thread_id,
                CachedHead(base.version + 1, sealed.digest, state, base.policy_name),
            )
            return Committed(
                as_stored(sealed, now, proposal.idempotency_key, digest_of_request), False
            )
        return await self._explain_lost_race(caller, proposal)

    async def _park(
        self,
        caller: Identity,
        proposal: Proposal,
        policy: Policy,
        base: CachedHead,
        patch: JsonObject,
        state_bytes: bytes,
        risky: list[str],
        digest_of_request: str,
    ) -> Outcome:
        """Keep a risky proposal for a human decision bound to its digest."""
        proposal_bytes = canonical_bytes(
            build_proposal(
                thread_id=proposal.thread_id,
                base_version=base.version,
                parent_digest=base.digest,
                node_id=caller.spiffe_id,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy.digest,
                risk_rules=risky,
            )
        )
        parked, inserted = await self._store.park(
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
        )
        self._parked.set()
        if parked is None:  # the key already names a committed request
            return await self._replay_or_stale(caller, proposal, base.version)
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
        self, caller: Identity, policy: Policy, proposal: Proposal
    ) -> CachedHead | Outcome:
        """The head to build on: bound to the caller's policy (checked first, so that
        nothing, not even a version, is told about another workflow's thread) and at
        the expected version."""
        cached = self._heads.get(proposal.thread_id, proposal.expected_version)
        if cached is not None:
            check_bound_policy(caller, policy, cached)
            return cached
        head = await self._store.read_head(proposal.thread_id)
        if head is None:
            raise thread_not_found(proposal.thread_id)
        check_bound_policy(caller, policy, head)
        state = self._remember(head)
        if head.version != proposal.expected_version:
            return await self._replay_or_stale(caller, proposal, head.version)
        return CachedHead(head.version, head.digest, state, head.policy_name)

    async def _explain_lost_race(self, caller: Identity, proposal: Proposal) -> Outcome:
        version = await self._store.head_version(proposal.thread_id)
        if version is None:
            raise thread_not_found(proposal.thread_id)
        if version != proposal.expected_version:
            # the compare-and-swap lost to another commit (not an idempotency key taken)
            self._metrics.cas_conflicts.add(1)
        return await self._replay_or_stale(caller, proposal, version)

    async def _replay_or_stale(
        self, caller: Identity, proposal: Proposal, head_version: int
    ) -> Outcome:
        earlier = await self._store.find_by_idempotency_key(
            proposal.thread_id, caller.spiffe_id, proposal.idempotency_key
        )
        if earlier is not None:
            if earlier.request_digest != request_digest(proposal):
                raise key_reused()
            return Committed(earlier, True)
        parked = await self._store.find_pending(
            proposal.thread_id, caller.spiffe_id, proposal.idempotency_key
        )
        if parked is not None:
            if parked.request_digest != request_digest(proposal):
                raise key_reused()
            return Parked(parked, True)
        raise errors.StaleVersion(
            f"expected version {proposal.expected_version}, but the head is at {head_version}",
            current_version=head_version,
        )

    async def revert(self, caller: Identity, revert: Revert) -> Committed:
        """Append a transition of kind "revert" restoring the state at ``to_version``.

        History is never rewritten: the revert is a new record on top of the head,
        committed by the same compare-and-swap as any transition, under the
        operator's identity.
        """
        check_privileged(caller, "revert threads")
        check_revert_fields(revert)
        head = await self._store.read_head(revert.thread_id)
        if head is None:
            raise thread_not_found(revert.thread_id)
        replayed = await self._replayed_revert(caller, revert)
        if replayed is not None:
            return replayed
        check_revert_target(revert, head.version)
        target = await self._kept_state(revert)
        policy = self._policy_named(head.policy_name)
        current: JsonObject = orjson.loads(head.state_bytes)
        patch = restoring_patch(current, target)
        state = apply_patch(current, patch)
        check_invariants(policy, Change.of(policy, state, current, patch, caller.name))
        state_bytes = canonical_bytes(state)
        check_state_size(state_bytes, self._max_state_bytes)
        now = datetime.now(UTC)
        sealed = seal(
            build_record(
                kind=KIND_REVERT,
                thread_id=revert.thread_id,
                version=head.version + 1,
                parent_digest=head.digest,
                node_id=caller.spiffe_id,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy.digest,
                receipt_digest=None,
                key_id=self._keyring.current,
                committed_at=now,
            ),
            self._keyring,
        )
        digest = revert_digest(revert)
        committed = await self._store.commit(
            sealed,
            state_bytes,
            expected_version=head.version,
            committed_at=now,
            idempotency_key=revert.idempotency_key,
            request_digest=digest,
        )
        if not committed:
            return await self._revert_lost_race(caller, revert)
        self._heads.put(
            revert.thread_id, CachedHead(head.version + 1, sealed.digest, state, head.policy_name)
        )
        return Committed(as_stored(sealed, now, revert.idempotency_key, digest), False)

    async def _replayed_revert(self, caller: Identity, revert: Revert) -> Committed | None:
        earlier = await self._store.find_by_idempotency_key(
            revert.thread_id, caller.spiffe_id, revert.idempotency_key
        )
        if earlier is None:
            return None
        if earlier.request_digest != revert_digest(revert):
            raise errors.IdempotencyKeyReused(
                "idempotency_key was already used by this operator on this thread for a "
                "different request"
            )
        return Committed(earlier, True)

    async def _kept_state(self, revert: Revert) -> JsonObject:
        exists, body = await self._store.state_at(revert.thread_id, revert.to_version)
        if not exists:
            raise errors.RequestInvalid(f"version {revert.to_version} does not exist")
        if body is None:
            raise errors.StatePruned(
                f"the state of version {revert.to_version} was pruned by retention; "
                "it cannot be restored"
            )
        state: JsonObject = orjson.loads(body)
        return state

    async def _revert_lost_race(self, caller: Identity, revert: Revert) -> Committed:
        replayed = await self._replayed_revert(caller, revert)
        if replayed is not None:
            return replayed
        version = await self._store.head_version(revert.thread_id)
        self._metrics.cas_conflicts.add(1)  # the key was not taken: the head moved
        raise errors.StaleVersion(
            "the thread moved while reverting; nothing was written, retry",
            current_version=version,
        )

    def _remember(self, head: Head) -> JsonObject:
        state: JsonObject = orjson.loads(head.state_bytes)
        self._heads.put(
            head.thread_id, CachedHead(head.version, head.digest, state, head.policy_name)
        )
        return state


def as_stored(
    sealed: SealedRecord, now: datetime, idempotency_key: str | None, digest: str | None
) -> StoredTransition:
    record = sealed.record
    return StoredTransition(
        thread_id=record["thread_id"],
        version=record["version"],
        digest=sealed.digest,
        parent_digest=record["parent_digest"],
        node_id=record["node_id"],
        key_id=sealed.key_id,
        signature=sealed.signature,
        record=sealed.record_bytes,
        committed_at=now,
        idempotency_key=idempotency_key,
        request_digest=digest,
    )


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


def _rejection(caller: Identity, proposal: Proposal, refusal: errors.ZtateError) -> Rejection:
    return Rejection(
        method="ProposeTransition",
        node_id=caller.spiffe_id,
        thread_id=proposal.thread_id[:128],
        base_version=proposal.expected_version,
        reason=refusal.reason,
        keys=refusal.keys,
        patch_digest=sha256_hex(proposal.patch_json),
        patch_bytes=len(proposal.patch_json),
        message=refusal.message,
    )
