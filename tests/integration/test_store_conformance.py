"""The transition store's contract, as its docstrings state it, run against every
implementation: Postgres, and Citus (a coordinator and two workers; marked ``citus``, so
only ``make test-citus`` runs it), through ``tests/citus/lanes.py``'s ``LANES``.

Each test drives the store directly, below the pipeline: what a method returns in each
case, and what it leaves written.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio

from tests.citus.lanes import LANES, lane_database
from tests.harness import Ledger, new_thread_id
from ztate.services.canonical import canonical_bytes, sha256_hex
from ztate.services.chain import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_TRANSITION,
    SealedRecord,
    build_record,
    seal,
)
from ztate.services.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.services.store.transitions import (
    Commit,
    PendingTransition,
    Rejection,
    TransitionStore,
)
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
    assert await store.create_thread(
        genesis, state, policy_name="pipeline", committed_at=datetime.now(UTC)
    )
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
    assert not await store.create_thread(
        again, state, policy_name="pipeline", committed_at=datetime.now(UTC)
    )
    head = await store.read_head(thread_id)
    assert head is not None
    assert (head.version, head.digest) == (0, genesis.digest)


async def test_absent_threads_are_none(store: TransitionStore) -> None:
    assert await store.read_head("never-created") is None
    assert await store.head_version("never-created") is None
    assert await store.head_transition("never-created") is None
    assert await store.state_at("never-created", 0) == (False, None)


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
    parked, inserted = await store.park(first, b"{}")
    assert inserted
    assert parked is not None
    assert parked.digest == first.digest
    again, inserted = await store.park(first, b"{}")  # the same request again
    assert (again, inserted) == (parked, False)
    same_digest = pending(thread_id, genesis.digest, "p-2", "a1" * 32)
    again, inserted = await store.park(same_digest, b"{}")  # the same proposal, another key
    assert again is not None
    assert (again.idempotency_key, inserted) == ("p-1", False)
    assert await store.find_pending(thread_id, NODE, "p-1") == parked
    assert await store.pending_by_digest("a1" * 32) == parked
    assert await store.find_pending(thread_id, NODE, "absent") is None


async def test_park_refuses_a_key_that_names_a_committed_request(
    store: TransitionStore, keyring: Keyring
) -> None:
    thread_id, genesis = await new_thread(store, keyring)
    await commit(store, keyring, thread_id, 1, genesis.digest, "used")
    assert await store.park(pending(thread_id, genesis.digest, "used", "b2" * 32), b"{}") == (
        None,
        False,
    )


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
