"""What a caller may read of a thread beyond its view: records with their approval
receipt, and signed checkpoints.

A node reads exactly what ``GetView`` lets it read: threads bound to its policy
(any other thread is "not found", as if it did not exist), and of those only
records whose patch changes keys it may read, so that no value, and no name of a
key it may not read, ever reaches it. That is enough for a privileged worker (a
database writer) to check, with public keys, that the head it is about to act on
was approved. Operators read everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from ztate.services.policy.model import PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.thread_ids import check_thread_id
from ztate.services.store.interface import TransitionStore
from ztate.services.store.rows import CheckpointRow, Evidence, StoredTransition
from ztate.transition_service.checks import (
    check_privileged,
    check_registered,
    hide_foreign_thread,
    thread_not_found,
)

DIGEST = re.compile(r"^[0-9a-f]{64}\Z")
RECORDS_FORBIDDEN = "this node may not read ledger records or checkpoints"


@dataclass(frozen=True, slots=True)
class Lookup:
    """One of: a record digest, a (thread, version), or a thread's head."""

    digest: str | None = None
    thread_id: str | None = None
    version: int | None = None
    head_of: str | None = None


@dataclass(frozen=True, slots=True)
class RecordWithEvidence:
    transition: StoredTransition
    evidence: Evidence


class ThreadReads:
    """Access checks shared by GetTransition, GetCheckpoint and WatchThread."""

    def __init__(self, store: TransitionStore, policies: PolicySet) -> None:
        self._store = store
        self._policies = policies

    async def readable(self, caller: Identity, thread_id: str) -> frozenset[str] | None:
        """The keys ``caller`` may read on ``thread_id`` (None: every key).

        Refuses as ``GetView`` does: identities that are neither nodes nor
        operators, unregistered nodes, and threads that do not exist or are bound
        to another policy (told apart from nothing: "not found").
        """
        check_thread_id(thread_id)
        if caller.role is not Role.NODE:
            check_privileged(caller, "read threads")
            if await self._store.head_version(thread_id) is None:
                raise thread_not_found(thread_id)
            return None
        policy = check_registered(caller, self._policies)
        head = await self._store.read_head(thread_id)
        if head is None:
            raise thread_not_found(thread_id)
        hide_foreign_thread(caller, policy, head)
        return policy.readable(caller.name)

    async def transition(self, caller: Identity, lookup: Lookup) -> RecordWithEvidence:
        """One record and the receipt it was committed under, if the caller may read it."""
        found = await self._find(caller, lookup)
        if caller.role is Role.NODE:
            try:
                readable = await self.readable(caller, found.thread_id)
            except errors.ThreadNotFound:
                raise errors.TransitionNotFound("no transition matches") from None
            assert readable is not None
            self._check_reads_records(caller)
            patch = orjson.loads(found.record)["patch"]
            if not patch.keys() <= readable:
                raise errors.RoleForbidden("this record changes keys this node may not read")
        else:
            check_privileged(caller, "read the ledger")
        return RecordWithEvidence(found, await self._store.evidence(found.digest))

    def discloses_records(self, caller: Identity) -> bool:
        """Whether answers to ``caller`` may carry records and digests.

        A record's digest, a head digest and a record's ``state_digest`` all commit to
        the whole state: whoever holds one can test guesses of keys it may not read.
        Nodes the policy does not mark ``read_records`` get versions and outcomes only.
        """
        if caller.role is not Role.NODE:
            return True
        policy = self._policies.of_node(caller.name)
        return policy is not None and policy.reads_records(caller.name)

    def _check_reads_records(self, caller: Identity) -> None:
        if not self.discloses_records(caller):
            raise errors.RoleForbidden(RECORDS_FORBIDDEN)

    async def _find(self, caller: Identity, lookup: Lookup) -> StoredTransition:
        if caller.role not in (Role.NODE, Role.OPERATOR):
            check_privileged(caller, "read the ledger")
        if lookup.digest is not None:
            if not DIGEST.match(lookup.digest):
                raise errors.RequestInvalid("digest must be 64 lower-case hex characters")
            found = await self._store.transition_by_digest(lookup.digest)
        elif lookup.head_of is not None:
            await self._may_look_into(caller, lookup.head_of)
            found = await self._store.head_transition(lookup.head_of)
        elif lookup.thread_id is not None and lookup.version is not None:
            await self._may_look_into(caller, lookup.thread_id)
            found = await self._store.transition_at(lookup.thread_id, lookup.version)
        else:
            raise errors.RequestInvalid("give a digest, a (thread_id, version) or head_of_thread")
        if found is None:
            raise errors.TransitionNotFound("no transition matches")
        return found

    async def _may_look_into(self, caller: Identity, thread_id: str) -> None:
        check_thread_id(thread_id)
        if caller.role is Role.NODE:
            await self.readable(caller, thread_id)

    async def checkpoint(self, caller: Identity, thread_id: str) -> CheckpointRow | None:
        """The newest signed checkpoint of a thread the caller may read."""
        await self.readable(caller, thread_id)
        if caller.role is Role.NODE:
            self._check_reads_records(caller)
        return await self._store.latest_checkpoint(thread_id)
