"""Reverting a thread: an operator's new record restoring an earlier state; history is
never rewritten."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.record import KIND_REVERT, build_record, seal
from ztate.services.policy.changes import Change, apply_patch, changed_keys, check_invariants
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity
from ztate.services.store.interface import Commit
from ztate.transition_service.checks import (
    check_credentials,
    check_declared,
    check_privileged,
    check_revert_fields,
    check_revert_target,
    check_schema,
    check_state_size,
    restoring_patch,
    revert_digest,
    thread_not_found,
)
from ztate.transition_service.heads import CachedHead
from ztate.transition_service.requests import (
    Committed,
    Revert,
)
from ztate.transition_service.usecase import UseCase, as_stored
from ztate.transition_service.work import acting_node


class RevertThread(UseCase):
    """``RevertThread``: a revert record on top of the head."""

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
        # what the revert brings back must pass the policy in force now, as a proposal
        # of it would: a policy edited since (a narrower enum, a key no longer declared
        # or no longer opaque) is not undone by restoring a state written under the old
        changed_names = changed_keys(current, patch)  # also whom the revert wakes
        changed = {key: patch[key] for key in changed_names}
        check_declared(changed, policy)
        check_schema(changed, policy)
        check_credentials(changed, policy)
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
                risk_rules=(),  # an operator's repair: no risk rule applies
            ),
            self._keyring,
        )
        digest = revert_digest(revert)
        result = await self._store.commit(
            sealed,
            state_bytes,
            expected_version=head.version,
            committed_at=now,
            idempotency_key=revert.idempotency_key,
            request_digest=digest,
            woken=policy.woken(changed_names, state, acting_node(caller)),
        )
        if result is not Commit.COMMITTED:
            return await self._revert_lost_race(caller, revert, result)
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
        kept = await self._store.state_at(revert.thread_id, revert.to_version)
        if kept is None:
            raise errors.RequestInvalid(f"version {revert.to_version} does not exist")
        body = kept.state
        if body is None:
            raise errors.StatePruned(
                f"the state of version {revert.to_version} was pruned by retention; "
                "it cannot be restored"
            )
        state: JsonObject = orjson.loads(body)
        return state

    async def _revert_lost_race(
        self, caller: Identity, revert: Revert, result: Commit
    ) -> Committed:
        replayed = await self._replayed_revert(caller, revert)
        if replayed is not None:
            return replayed
        version = await self._store.head_version(revert.thread_id)
        if result is Commit.HEAD_MOVED:
            self._metrics.cas_conflicts.add(1)
        raise errors.StaleVersion(
            "the thread moved while reverting; nothing was written, retry",
            current_version=version,
        )
