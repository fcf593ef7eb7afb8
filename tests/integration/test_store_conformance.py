"""The transition store's contract, as its docstrings state it, run against every
implementation: Postgres, and Citus (a coordinator and two workers; marked ``citus``, so
only ``make test-citus`` runs it), through ``tests/citus/lanes.py``'s ``LANES``.

Each test drives the store directly, below the pipeline: what a method returns in each
case, and what it leaves written.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.citus.lanes import LANES, lane_database
from tests.harness import Ledger, new_thread_id
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.checkpoints import sign_checkpoint
from ztate.contract.keyring import Keyring
from ztate.contract.record import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_TRANSITION,
    SealedRecord,
    build_record,
    seal,
)
from ztate.services.runtime.config import Settings
from ztate.services.runtime.errors import StorageUnavailable
from ztate.services.store.interface import (
    Commit,
    Creation,
    Genesis,
    HeadLookup,
    KeptState,
    LeaseClaim,
    Park,
    Parking,
    StaleRefusal,
    TransitionStore,
    UnsignedHead,
)
from ztate.services.store.rows import PendingTransition, Rejection
from ztate.services.store.transitions import PostgresTransitionStore
from ztate.services.store.work import WorkStore
from ztate.transition_service.app import start

NODE = "spiffe://ztate.test/node/input-parser"
OPERATOR = "spiffe://ztate.test/operator/admin"


@pytest_asyncio.fixture(scope="module", params=LANES)
async def implementation(
    request: pytest.FixtureRequest, settings: Settings, keyring: Keyring
) -> AsyncIterator[tuple[TransitionStore, Ledger]]:
    """A transition service's own store on a fresh database of each lane (``LANES``:
    Postgres, and Citus in the citus lane)."""
    dsn = await lane_database(request.param, request)
    running = await start(settings, dsn=dsn)
    yield running.store, Ledger(dsn, keyring)
    await running.stop(grace=1.0)


@pytest.fixture
def store(implementation: tuple[TransitionStore, Ledger]) -> TransitionStore:
    return implementation[0]


@pytest.fixture
def ledger(implementation: tuple[TransitionStore, Ledger]) -> Ledger:
    """The ledger of the store under test (not the session's)."""
    return implementation[1]


def sealed(
    keyring: Keyring, thread_id: str, version: int, parent: str, state: dict[str, Any]
) -> tuple[SealedRecord, bytes]:
    state_bytes = canonical_bytes(state)
    record = build_record(
        kind=KIND_GENESIS if version == 0 else KIND_TRANSITION,
        thread_id=thread_id,
        version=version,
        parent_digest=parent,
        node_id=OPERATOR if version == 0 else NODE,
        patch=state if version == 0 else {"raw_text": state["raw_text"]},
        state_digest=sha256_hex(state_bytes),
        policy_digest="ef" * 32,
        receipt_digest=None,
        key_id=keyring.current,
        committed_at=datetime.now(UTC),
    )
    return seal(record, keyring), state_bytes


async def new_thread(store: TransitionStore, keyring: Keyring) -> tuple[str, SealedRecord]:
    thread_id = new_thread_id()
    genesis, state = sealed(keyring, thread_id, 0, GENESIS_PARENT, {"raw_text": "v0"})
    created = await store.create_thread(
        genesis, state, policy_name="pipeline", committed_at=datetime.now(UTC)
    )
    assert created is Creation.CREATED
    return thread_id, genesis


async def commit(
    store: TransitionStore,
    keyring: Keyring,
    thread_id: str,
    version: int,
    parent: str,
    key: str,
    *,
    expected: int | None = None,
) -> tuple[Commit, SealedRecord]:
    record, state = sealed(keyring, thread_id, version, parent, {"raw_text": f"v{version}"})
    result = await store.commit(
        record,
        state,
        expected_version=version - 1 if expected is None else expected,
        committed_at=datetime.now(UTC),
        idempotency_key=key,
        request_digest=sha256_hex(key.encode()),
    )
    return result, record


async def test_create_thread_once(store: TransitionStore, keyring: Keyring) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    again, state = sealed(keyring, thread_id, 0, GENESIS_PARENT, {"raw_text": "other"})
    created = await store.create_thread(
        again, state, policy_name="pipeline", committed_at=datetime.now(UTC)
    )
    assert created is Creation.ID_TAKEN
    head = await store.read_head(thread_id)
    assert head is not None
    assert (head.version, head.digest) == (0, genesis.digest)


async def test_absent_threads_are_none(store: TransitionStore) -> None:
    assert await store.read_head("never-created") is None
    assert await store.head_version("never-created") is None
    assert await store.head_transition("never-created") is None
    assert await store.genesis("never-created") is None
    assert await store.state_at("never-created", 0) is None


async def test_genesis_is_the_first_record_with_the_threads_policy_however_far_the_head(
    store: TransitionStore, keyring: Keyring
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    await commit(store, keyring, thread_id, 1, genesis.digest, "k-g")
    first = await store.transition_at(thread_id, 0)
    assert first is not None
    assert (first.version, first.digest) == (0, genesis.digest)
    assert await store.genesis(thread_id) == Genesis(first, "pipeline")


async def test_commit_moves_the_head_and_appends_the_record(
    store: TransitionStore, keyring: Keyring, ledger: Ledger
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    result, record = await commit(store, keyring, thread_id, 1, genesis.digest, "k-1")
    assert result is Commit.COMMITTED
    assert await store.head_version(thread_id) == 1
    found = await store.transition_at(thread_id, 1)
    assert found is not None
    assert (found.digest, found.record) == (record.digest, record.record_bytes)
    assert await store.transition_by_digest(record.digest) == found
    assert await store.head_transition(thread_id) == found
    assert (await store.find_by_idempotency_key(thread_id, NODE, "k-1")) == found
    assert await ledger.verify(thread_id) == 2


async def test_a_stale_commit_writes_nothing_and_says_the_head_moved(
    store: TransitionStore, keyring: Keyring, ledger: Ledger
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    assert (await commit(store, keyring, thread_id, 1, genesis.digest, "k-1"))[0] is (
        Commit.COMMITTED
    )
    before = await ledger.snapshot(thread_id)
    result, _ = await commit(store, keyring, thread_id, 1, genesis.digest, "k-2", expected=0)
    assert result is Commit.HEAD_MOVED
    assert await ledger.snapshot(thread_id) == before
    result, _ = await commit(store, keyring, "never-created", 1, genesis.digest, "k-3")
    assert result is Commit.HEAD_MOVED


async def test_a_taken_idempotency_key_writes_nothing_and_says_so(
    store: TransitionStore, keyring: Keyring, ledger: Ledger
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    _, first = await commit(store, keyring, thread_id, 1, genesis.digest, "same-key")
    before = await ledger.snapshot(thread_id)
    result, _ = await commit(store, keyring, thread_id, 2, first.digest, "same-key")
    assert result is Commit.KEY_TAKEN
    assert await ledger.snapshot(thread_id) == before  # the head did not move either


def pending(thread_id: str, parent: str, key: str, digest: str) -> PendingTransition:
    return PendingTransition(
        digest=digest,
        thread_id=thread_id,
        base_version=0,
        parent_digest=parent,
        node_id=NODE,
        proposal=b'{"kind":"proposal"}',
        risk_rules=["target-user-change"],
        idempotency_key=key,
        request_digest=sha256_hex(key.encode()),
        status="pending",
        parked_at=datetime.now(UTC),
        sensitive_keys=[],
        required_approvals=1,
    )


async def test_park_inserts_once_and_returns_the_parked_one_after(
    store: TransitionStore, keyring: Keyring
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    first = pending(thread_id, genesis.digest, "p-1", "a1" * 32)
    parking = await store.park(first, b"{}")
    assert parking.outcome is Park.PARKED
    parked = parking.pending
    assert parked is not None
    assert parked.digest == first.digest
    again = await store.park(first, b"{}")  # the same request again
    assert again == Parking(Park.ALREADY_PARKED, parked)
    same_digest = pending(thread_id, genesis.digest, "p-2", "a1" * 32)
    again = await store.park(same_digest, b"{}")  # the same proposal, another key
    assert again.outcome is Park.ALREADY_PARKED
    assert again.pending is not None
    assert again.pending.idempotency_key == "p-1"
    assert await store.find_pending(thread_id, NODE, "p-1") == parked
    assert await store.pending_by_digest("a1" * 32) == parked
    assert await store.find_pending(thread_id, NODE, "absent") is None


async def test_park_refuses_a_key_that_names_a_committed_request(
    store: TransitionStore, keyring: Keyring
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    await commit(store, keyring, thread_id, 1, genesis.digest, "used")
    parking = await store.park(pending(thread_id, genesis.digest, "used", "b2" * 32), b"{}")
    assert parking == Parking(Park.KEY_TAKEN, None)
    assert await store.pending_by_digest("b2" * 32) is None


async def test_park_under_a_lost_lease_parks_nothing_whatever_else_is_true(
    store: TransitionStore, keyring: Keyring
) -> None:
    """Under a lease: parked while the grant holds it, which the park leaves held;
    ``LEASE_LOST`` once another grant took it, before a proposal parked already or a
    key that names a committed request, nothing parked."""
    assert isinstance(store, PostgresTransitionStore)
    work = WorkStore(store.pool)
    thread_id = new_thread_id()
    genesis, state = sealed(keyring, thread_id, 0, GENESIS_PARENT, {"raw_text": "v0"})
    await store.create_thread(
        genesis, state, policy_name="pipeline", committed_at=datetime.now(UTC), woken=["n"]
    )
    lost = await work.acquire(thread_id, "n", "first", 30.0)
    assert lost is not None
    held = pending(thread_id, genesis.digest, "l-1", "c1" * 32)
    parking = await store.park(held, b"{}", LeaseClaim("n", lost.epoch))
    assert parking.outcome is Park.PARKED
    parked = parking.pending
    assert await work.holds(thread_id, "n", lost.epoch)  # the park fences, not releases

    assert await work.release(thread_id, "n", lost.epoch, -1) is not None
    assert await work.acquire(thread_id, "n", "second", 30.0) is not None
    await commit(store, keyring, thread_id, 1, genesis.digest, "used")
    for refused in (
        pending(thread_id, genesis.digest, "l-2", "c2" * 32),  # would be parked
        held,  # parked already
        pending(thread_id, genesis.digest, "used", "c3" * 32),  # its key committed
    ):
        parking = await store.park(refused, b"{}", LeaseClaim("n", lost.epoch))
        assert parking == Parking(Park.LEASE_LOST, None)
    assert await store.pending_by_digest("c2" * 32) is None
    assert await store.pending_by_digest("c3" * 32) is None
    assert await store.find_pending(thread_id, NODE, "l-2") is None
    assert await store.pending_by_digest("c1" * 32) == parked  # as it was


async def test_every_rejection_is_recorded_whatever_it_holds(
    store: TransitionStore, ledger: Ledger
) -> None:
    thread_id = "t-\x00" + "x" * 2000
    before = await ledger.rejection_count()
    await store.record_rejection(
        Rejection(
            method="ProposeTransition",
            node_id=NODE,
            thread_id=thread_id,
            base_version=0,
            reason="REQUEST_INVALID",
            keys=["a\x00b"],
            patch_digest=None,
            patch_bytes=None,
            message="m\x00" * 2000,
        )
    )
    assert await ledger.rejection_count() == before + 1
    [row] = await ledger.rejections(("t-\\u0000" + "x" * 2000)[:1024])
    assert row["keys"] == ["a\\u0000b"]
    assert len(row["message"]) == 1024


async def test_a_kept_state_is_returned_and_a_missing_version_is_none(
    store: TransitionStore, keyring: Keyring
) -> None:
    thread_id, _ = await new_thread(store, keyring)
    assert await store.state_at(thread_id, 0) == KeptState(canonical_bytes({"raw_text": "v0"}))
    assert await store.state_at(thread_id, 1) is None


async def test_unsigned_heads_are_listed_until_signed_and_signing_twice_is_harmless(
    store: TransitionStore, keyring: Keyring
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    key = Ed25519PrivateKey.generate()
    now = datetime.now(UTC)

    async def unsigned_here() -> list[UnsignedHead]:
        # other tests' threads share the store: look at this one alone
        return [h for h in await store.unsigned_heads(100_000) if h.thread_id == thread_id]

    [head] = await unsigned_here()
    assert head == UnsignedHead(thread_id, 0, genesis.digest)
    # a page cursor: heads of threads whose id sorts after it, in thread id order
    after = await store.unsigned_heads(100_000, after=thread_id)
    assert all(h.thread_id > thread_id for h in after)
    assert [h.thread_id for h in after] == sorted(h.thread_id for h in after)
    signed = sign_checkpoint(
        key, "ck1", thread_id=thread_id, version=0, head_digest=genesis.digest, signed_at=now
    )
    await store.save_checkpoints([(head, signed, now)])
    await store.save_checkpoints([(head, signed, now)])  # another replica signed it too
    assert await unsigned_here() == []
    latest = await store.latest_checkpoint(thread_id)
    assert latest is not None
    assert (latest.checkpoint, latest.signature, latest.key_id) == (
        signed.checkpoint,
        signed.signature,
        "ck1",
    )
    await commit(store, keyring, thread_id, 1, genesis.digest, "k-1")
    assert [h.version for h in await unsigned_here()] == [1]


async def test_the_count_of_pending_proposals_and_the_oldest(
    store: TransitionStore, keyring: Keyring
) -> None:
    count, oldest = await store.pending_summary()
    thread_id, genesis = await new_thread(store, keyring)
    parked = pending(thread_id, genesis.digest, "p-count", "c3" * 32)
    await store.park(parked, b"{}")
    after, oldest_after = await store.pending_summary()
    assert after == count + 1
    assert oldest_after is not None
    assert oldest_after <= (oldest or parked.parked_at)


async def test_an_unreachable_database_is_storage_unavailable_never_a_driver_error() -> None:
    """The contract's boundary: no driver exception leaves the store. Postgres here:
    a pool whose server does not answer (nothing listens on the port)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = await asyncpg.create_pool(
        f"postgresql://ztate@127.0.0.1:{port}/ztate", min_size=0, max_size=1, timeout=2
    )
    unreachable = PostgresTransitionStore(pool)
    calls = {
        "ping": unreachable.ping(),
        "read_head": unreachable.read_head("t-1"),
        "state_at": unreachable.state_at("t-1", 0),
        "unsigned_heads": unreachable.unsigned_heads(1),
        "pending_summary": unreachable.pending_summary(),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(StorageUnavailable) as refused:
                await call
            assert refused.value.reason == "STORAGE_UNAVAILABLE", name
            assert isinstance(refused.value.__cause__, OSError), name
    finally:
        await pool.close()


def stale_refusal(thread_id: str, base_version: int, policy_name: str = "pipeline") -> StaleRefusal:
    return StaleRefusal(
        Rejection(
            method="ProposeTransition",
            node_id=NODE,
            thread_id=thread_id,
            base_version=base_version,
            reason="STALE_VERSION",
            keys=[],
            patch_digest="ab" * 32,
            patch_bytes=10,
            message=f"expected version {base_version}, but the head is at %s (100%%)",
        ),
        policy_name,
    )


async def test_head_for_request_finds_the_head_and_records_only_a_stale_refusal(
    store: TransitionStore, keyring: Keyring, ledger: Ledger
) -> None:
    missing = await store.head_for_request("never-created", NODE, "k", stale_refusal("x", 0))
    assert missing == HeadLookup(None, None, None, refused=False)
    thread_id, genesis = await new_thread(store, keyring)
    result, _record = await commit(store, keyring, thread_id, 1, genesis.digest, "k-1")
    assert result is Commit.COMMITTED

    at_head = await store.head_for_request(thread_id, NODE, "k-2", stale_refusal(thread_id, 1))
    assert at_head.head is not None
    assert at_head.head.version == 1
    assert (at_head.earlier, at_head.parked, at_head.refused) == (None, None, False)
    foreign = await store.head_for_request(
        thread_id, NODE, "k-2", stale_refusal(thread_id, 0, "billing")
    )
    assert not foreign.refused  # another workflow's thread: not this proposal's to be stale on
    replay = await store.head_for_request(thread_id, NODE, "k-1", stale_refusal(thread_id, 0))
    assert replay.earlier == await store.find_by_idempotency_key(thread_id, NODE, "k-1")
    assert not replay.refused  # a replay, not a refusal
    assert await ledger.rejections(thread_id) == []

    stale = await store.head_for_request(thread_id, NODE, "k-2", stale_refusal(thread_id, 0))
    assert stale.refused
    assert stale.head == at_head.head
    [row] = await ledger.rejections(thread_id)
    assert (row["reason"], row["base_version"], row["message"]) == (
        "STALE_VERSION",
        0,
        "expected version 0, but the head is at 1 (100%)",
    )
    assert await store.head_version(thread_id) == 1
