"""What every use case of the transition service shares: the store, the policies,
the keyring, the limits, the cache of heads and the parked-proposal signal. Built once
by ``ztate.transition_service.pipeline.TransitionPipeline``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime

import orjson

from ztate.contract.canonical import JsonObject
from ztate.contract.keyring import Keyring
from ztate.contract.record import SealedRecord
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.identity import NAME
from ztate.services.runtime.telemetry import (
    NO_METRICS,
    Metrics,
)
from ztate.services.store.interface import TransitionStore
from ztate.services.store.rows import Head, StoredTransition
from ztate.transition_service.heads import CachedHead, HeadCache


@dataclass(frozen=True, slots=True)
class Shared:
    """What the use cases of one service share: one instance of each part (the same
    head cache, the same parked signal)."""

    store: TransitionStore
    policies: PolicySet
    keyring: Keyring
    max_patch_bytes: int
    max_depth: int
    max_state_bytes: int
    heads: HeadCache
    # set whenever a proposal is parked, so the approval outbox wakes up
    parked: asyncio.Event
    metrics: Metrics = NO_METRICS


class UseCase:
    """The base of each use case: the shared state, under the names the use cases use."""

    def __init__(self, shared: Shared) -> None:
        self._store = shared.store
        self._policies = shared.policies
        self._keyring = shared.keyring
        self._max_patch_bytes = shared.max_patch_bytes
        self._max_depth = shared.max_depth
        self._max_state_bytes = shared.max_state_bytes
        self._heads = shared.heads
        self._parked = shared.parked
        self._metrics = shared.metrics

    def _policy_named(self, name: str) -> Policy:
        if not name:
            only = self._policies.only
            if only is None:
                raise errors.RequestInvalid("several policies are loaded: name the thread's policy")
            return only
        policy = self._policies.get(name)
        if policy is None:
            # a name the caller chose: repeated only when it is one a policy may have
            if NAME.fullmatch(name):
                raise errors.PolicyNotFound(f"no policy named {name!r} is loaded")
            raise errors.PolicyNotFound("no policy by that name is loaded: it is not a policy name")
        return policy

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
