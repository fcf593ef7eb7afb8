"""Creating a thread: an operator's genesis record, checked like any patch."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.record import GENESIS_PARENT, KIND_GENESIS, build_record, seal
from ztate.services.policy.changes import Change, apply_patch, check_invariants
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity
from ztate.services.runtime.thread_ids import check_thread_id
from ztate.services.store.interface import Creation
from ztate.services.store.rows import StoredTransition
from ztate.transition_service.checks import (
    check_credentials,
    check_declared,
    check_privileged,
    check_schema,
    check_size,
    check_state_size,
    check_storable,
    parse_admitted,
)
from ztate.transition_service.heads import CachedHead
from ztate.transition_service.requests import Committed
from ztate.transition_service.usecase import UseCase, as_stored
from ztate.transition_service.work import acting_node


class CreateThread(UseCase):
    """``CreateThread``: the genesis of a thread, bound to one policy."""

    async def create_thread(
        self, caller: Identity, thread_id: str, policy_name: str, initial_state_json: bytes
    ) -> Committed:
        """The genesis, ``replayed`` when this caller created the thread before with this
        initial state and policy (``_created_before``): nothing is written then."""
        check_privileged(caller, "create threads")
        check_thread_id(thread_id)
        policy = self._policy_named(policy_name)
        check_size(initial_state_json, self._max_patch_bytes, "initial state")
        initial = parse_admitted(initial_state_json, "initial state", self._max_depth)
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
                risk_rules=(),  # risk rules are not checked at genesis
            ),
            self._keyring,
        )
        created = await self._store.create_thread(
            sealed,
            state_bytes,
            policy_name=policy.name,
            committed_at=now,
            # whom the genesis wakes, recorded by the creation itself (docs/work.md)
            woken=policy.woken(frozenset(initial), state, acting_node(caller)),
        )
        if created is Creation.ID_TAKEN:
            earlier = await self._created_before(caller, thread_id, policy.name, initial)
            if earlier is None:
                raise errors.ThreadExists(f"thread {thread_id!r} already exists")
            return Committed(earlier, replayed=True)
        self._heads.put(thread_id, CachedHead(0, sealed.digest, state, policy.name))
        return Committed(as_stored(sealed, now, None, None), replayed=False)

    async def _created_before(
        self, caller: Identity, thread_id: str, policy_name: str, initial: JsonObject
    ) -> StoredTransition | None:
        """The genesis of ``thread_id`` when this caller created it with this initial state
        and policy: a retry whose first reply was lost gets the answer it missed, not
        THREAD_EXISTS for its own creation (the SDK retries CreateThread). Anyone else,
        or another state or policy: None."""
        found = await self._store.genesis(thread_id)  # one round trip
        if found is None or found.record.node_id != caller.spiffe_id:
            return None
        patch = orjson.loads(found.record.record)["patch"]
        if found.policy_name != policy_name or canonical_bytes(patch) != canonical_bytes(initial):
            return None
        return found.record
