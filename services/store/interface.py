"""The transition store's contract: what the transition service may ask of its storage.

These docstrings are the contract, as Trillian's storage interfaces and SpiceDB's
datastore are: every implementation (``PostgresTransitionStore`` in
``ztate.services.store.transitions``; the Citus layout runs the same one) must pass
``tests/integration/test_store_conformance.py``, which checks each statement below.

For every method:

- **Typed results.** Each outcome a caller must tell apart has its own value
  (``Creation``, ``Commit``, ``Parking``, ``KeptState``); ``None`` means only "no such
  row".
- **Driver errors stay inside.** A database that cannot be reached (refused, reset,
  restarted, out of connections) is raised as
  ``ztate.services.runtime.errors.StorageUnavailable``; no exception of the driver
  crosses this boundary. Any other failure is a bug and propagates as it is.
- **Append-only.** Nothing here updates or deletes a ledger record, a rejection or a
  checkpoint; a commit writes the head and the record together or not at all.
- **SQL on the ledger's tables** (threads, transitions, pending transitions,
  rejections, checkpoints) lives in the store and nowhere else in the service; the
  offline verifier reads them through its own reader, trusting nothing they hold.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from ztate.contract.checkpoints import SignedCheckpoint
from ztate.contract.record import SealedRecord
from ztate.services.store.rows import (
    Backend,
    CheckpointRow,
    Evidence,
    Head,
    PendingTransition,
    Rejection,
    StoredTransition,
    VersionState,
)


class Creation(enum.Enum):
    """What ``TransitionStore.create_thread`` did."""

    CREATED = "created"
    ID_TAKEN = "id taken"  # a thread with this id exists: nothing was written


class Commit(enum.Enum):
    """What ``TransitionStore.commit`` did."""

    COMMITTED = "committed"
    HEAD_MOVED = "head moved"  # the compare-and-swap lost: a conflict
    KEY_TAKEN = "key taken"  # the idempotency key names a committed request: a replay?
    LEASE_LOST = "lease lost"  # the proposal's lease grant no longer holds: nothing written


@dataclass(slots=True)
class LeaseClaim:
    """A commit or a park made under a lease grant (migrations 0019, 0024): ``node``'s
    lease on the thread at ``epoch``, fenced by the call itself, and released by a
    commit. Set by a commit that
    committed: ``settled`` (it tried the release) and ``more`` (it released the lease,
    and more work waits for the node there; ``None``: the grant had lost the lease by
    then, and the lease stays its new owner's)."""

    node: str
    epoch: int
    settled: bool = False
    more: bool | None = None


class Park(enum.Enum):
    """What ``TransitionStore.park`` did."""

    PARKED = "parked"  # this call parked the proposal
    ALREADY_PARKED = "already parked"  # this request or this exact proposal was parked before
    KEY_TAKEN = "key taken"  # the idempotency key names a committed request: nothing parked
    LEASE_LOST = "lease lost"  # the lease grant it was proposed under is lost: nothing parked


@dataclass(frozen=True, slots=True)
class Parking:
    """The result of ``TransitionStore.park``: what happened, and the parked row
    (this call's or the earlier one's; None only for ``KEY_TAKEN`` and ``LEASE_LOST``)."""

    outcome: Park
    pending: PendingTransition | None


@dataclass(frozen=True, slots=True)
class Genesis:
    """A thread's genesis record and the policy the thread is bound to."""

    record: StoredTransition
    policy_name: str


@dataclass(frozen=True, slots=True)
class KeptState:
    """A record's state body as retention left it: ``None`` once pruned."""

    state: bytes | None


@dataclass(frozen=True, slots=True)
class StaleRefusal:
    """The rejection row of a proposal found stale, for ``TransitionStore.head_for_request``
    to record in the same round trip. ``rejection.message`` is a ``format`` template whose
    one ``%s`` is the head's version (``%%`` for a percent sign)."""

    rejection: Rejection
    policy_name: str  # recorded only if the thread is bound to it (else: not stale, foreign)


@dataclass(frozen=True, slots=True)
class HeadLookup:
    """What ``TransitionStore.head_for_request`` found, in one round trip."""

    head: Head | None
    earlier: StoredTransition | None  # committed under the request's idempotency key
    parked: PendingTransition | None  # parked under the request's idempotency key
    refused: bool  # the stale refusal was recorded


@dataclass(frozen=True, slots=True)
class UnsignedHead:
    """A thread head with no checkpoint at its version yet."""

    thread_id: str
    version: int
    head_digest: str


class TransitionStore(Protocol):
    """Thread heads, the transition ledger, parked proposals, rejections and
    checkpoints, as the transition service sees them through a least-privilege role."""

    async def ping(self) -> None:
        """Return once the database answers; ``StorageUnavailable`` if it does not."""

    async def close(self) -> None:
        """Release every connection; the store is not used afterwards."""

    async def create_thread(
        self,
        sealed: SealedRecord,
        state_bytes: bytes,
        *,
        policy_name: str,
        committed_at: datetime,
        woken: Sequence[str] = (),
    ) -> Creation:
        """Create a thread at version 0 with its genesis record and state, bound to
        ``policy_name``, with the work of the ``woken`` nodes and the thread's wake mark
        at 0: ``CREATED`` (the woken nodes announced after), or ``ID_TAKEN`` (nothing
        written) when a thread of that id exists."""

    async def read_head(self, thread_id: str) -> Head | None:
        """The thread's head (version, digest, state, policy), or None if no such thread."""

    async def head_version(self, thread_id: str) -> int | None:
        """The thread's head version, or None if no such thread."""

    async def head_for_request(
        self, thread_id: str, node_id: str, idempotency_key: str, stale: StaleRefusal
    ) -> HeadLookup:
        """In one round trip: the thread's head, the transition ``node_id`` committed and
        the proposal it parked on this thread under ``idempotency_key``; and, only when
        the head exists, is bound to ``stale.policy_name``, is not at
        ``stale.rejection.base_version`` and neither a transition nor a parked proposal
        holds the key (a stale proposal, not a replay), ``stale.rejection`` recorded with
        the head's version in its message (``refused``)."""

    async def head_versions(self, thread_ids: Sequence[str]) -> dict[str, int]:
        """The head versions of those of ``thread_ids`` that exist, in one query."""

    async def commit(
        self,
        sealed: SealedRecord,
        state_bytes: bytes,
        *,
        expected_version: int,
        committed_at: datetime,
        idempotency_key: str,
        request_digest: str,
        woken: Sequence[str] = (),
        lease: LeaseClaim | None = None,
    ) -> Commit:
        """Compare-and-swap the head from ``expected_version`` (and the record's
        parent digest) to the record's version, append the record, and record the
        work of the ``woken`` nodes (advancing the thread's wake mark to the version
        when it was at ``expected_version``), atomically; the woken nodes are announced
        after. Under a ``lease``: first its fence, and once committed its release
        (handled up to ``expected_version``; ``lease.settled`` and ``lease.more``
        set), in the same transaction.
        ``COMMITTED``: both happened. ``HEAD_MOVED``: the head was elsewhere (or the
        thread does not exist, or ``idempotency_key`` names a request of this node
        parked on the thread); nothing was written. ``KEY_TAKEN``: this node already
        committed a request under ``idempotency_key`` on this thread; nothing was
        written. ``LEASE_LOST``: the lease grant no longer holds; nothing was
        written."""

    async def find_by_idempotency_key(
        self, thread_id: str, node_id: str, idempotency_key: str
    ) -> StoredTransition | None:
        """The record this node committed on this thread under ``idempotency_key``."""

    async def transition_by_digest(self, digest: str) -> StoredTransition | None:
        """The record whose digest is ``digest``."""

    async def transition_at(self, thread_id: str, version: int) -> StoredTransition | None:
        """The thread's record at ``version``."""

    async def head_transition(self, thread_id: str) -> StoredTransition | None:
        """The record at the thread's head version."""

    async def genesis(self, thread_id: str) -> Genesis | None:
        """The thread's record at version 0 and the name of the policy its head is bound
        to, read together (one round trip); None when there is no such thread."""

    async def evidence(self, digest: str) -> Evidence:
        """The approval receipt the record ``digest`` was committed under and the risk
        rules its proposal matched (empty when it needed none, or no such record)."""

    async def versions_after(self, thread_id: str, version: int, limit: int) -> list[VersionState]:
        """Up to ``limit`` records newer than ``version``, oldest first, each with its
        kept state body."""

    async def records_after(
        self, thread_id: str, version: int, limit: int
    ) -> list[StoredTransition]:
        """Up to ``limit`` records of the thread newer than ``version``, oldest first
        (``version=-1``: from genesis)."""

    async def state_at(self, thread_id: str, version: int) -> KeptState | None:
        """The kept state body of the thread's record at ``version`` (``KeptState(None)``
        once pruned), or None if there is no such record."""

    async def watch_thread(self, thread_id: str, backend: Backend) -> None:
        """Have commits of ``thread_id`` announced to the replica whose LISTEN session
        is ``backend`` (idempotent)."""

    async def unwatch_thread(self, thread_id: str, backend: Backend) -> None:
        """Stop announcing ``thread_id`` to ``backend`` (a no-op if it was not)."""

    async def latest_checkpoint(self, thread_id: str) -> CheckpointRow | None:
        """The checkpoint of the thread at its highest signed version."""

    async def unsigned_heads(self, limit: int, after: str = "") -> list[UnsignedHead]:
        """Up to ``limit`` thread heads with no checkpoint at their version, in thread id
        order, of threads whose id sorts after ``after`` (a page cursor)."""

    async def save_checkpoints(
        self, checkpoints: Sequence[tuple[UnsignedHead, SignedCheckpoint, datetime]]
    ) -> None:
        """Append signed checkpoints; one of a version already signed is ignored
        (replicas may sign the same head)."""

    async def park(
        self, pending: PendingTransition, state_bytes: bytes, lease: LeaseClaim | None = None
    ) -> Parking:
        """Park a proposal with the state it would make: ``PARKED``;
        ``ALREADY_PARKED`` with the earlier row if this request (node and idempotency
        key) or this exact proposal (digest) is parked already; ``KEY_TAKEN`` (nothing
        parked) if the idempotency key names a committed request. Under a ``lease``,
        fenced first, in the same transaction: ``LEASE_LOST`` (nothing parked, whatever
        else is true) unless that grant still holds the lease, which stays held until
        the parked row is committed; the lease is not released."""

    async def find_pending(
        self, thread_id: str, node_id: str, idempotency_key: str
    ) -> PendingTransition | None:
        """The proposal this node parked on this thread under ``idempotency_key``."""

    async def pending_by_digest(self, digest: str) -> PendingTransition | None:
        """The parked proposal whose transition digest is ``digest``."""

    async def refusal_at_commit(self, pending: PendingTransition) -> str | None:
        """The reason an approved ``pending`` was refused when it came to commit."""

    async def pending_summary(self) -> tuple[int, datetime | None]:
        """How many proposals wait for a decision, and when the oldest was parked."""

    async def record_rejection(self, rejection: Rejection) -> None:
        """Append a refusal to the rejections ledger; always succeeds for any text the
        request carried (U+0000 and over-long texts are made storable first)."""
