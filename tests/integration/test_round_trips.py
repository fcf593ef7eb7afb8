"""Database round trips off the happy path, counted so that they cannot creep back.

Each pipeline here is the service's own (``TransitionPipeline`` over a
``PostgresTransitionStore``; ``DecisionPipeline`` for ApplyDecision) on a real database
of each lane (plain Postgres; Citus, distributed, in the citus lane), through an asyncpg
pool whose every connection logs each statement it sends (``add_query_logger``): one
logged statement is one round trip. Issue 19's budgets: a stale proposal at most 2 round
trips (it was 4: head, key look-up, parked look-up, rejection), a lost compare-and-swap
race at most 2 (it was 5: commit, head version, two look-ups, rejection). Issue 20's: an
approving ApplyDecision at most 3 (it was 11: parked row, nonce, head, candidate state,
BEGIN, lock, commit, receipt, announcement, COMMIT, head again), and so every other
ApplyDecision outcome: a rejection, an approval the policy now refuses, an approval whose
thread moved on (each was 6 or 7: the lookup, then a transaction of four or five
statements; migration 0017 makes each one call). And a proposal under a lease (a
SubscribeWork worker's) that commits: 1 round trip (it was 3: the fence, the commit, the
release; migration 0019 makes them one call), and one that is parked: 2 on a cached head
(it was 3: the fence, the park, the release; migration 0024 fences in the park). A
CreateThread repeated by its creator: 2 (it was 3: the creation, the genesis, the head).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
import pytest_asyncio

from tests.citus.lanes import LANES, lane_database
from tests.harness import INITIAL, TRUST_DOMAIN, Ledger, act, new_thread_id
from ztate.contract.canonical import canonical_bytes
from ztate.contract.keyring import Keyring, generate_signing_key, load_public_keys, load_signing_key
from ztate.contract.receipts import SignedReceipt, build_receipt, sign_receipt
from ztate.services.policy.model import PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.store.approvals import ApprovalStore, DecisionLookup
from ztate.services.store.interface import Parking
from ztate.services.store.migrate import migrate
from ztate.services.store.transitions import (
    COMMIT,
    CREATE_THREAD,
    PARK,
    PostgresTransitionStore,
    keep_session,
)
from ztate.services.store.work import ANNOUNCE_WORK, RELEASE, WorkStore
from ztate.transition_service.decisions import APPROVAL_SERVICE_NAME, DecisionPipeline
from ztate.transition_service.decisions import Outcome as DecidedOutcome
from ztate.transition_service.heads import HeadCache
from ztate.transition_service.outcomes import OutcomeListener
from ztate.transition_service.pipeline import TransitionPipeline
from ztate.transition_service.requests import Committed, Parked, Proposal
from ztate.transition_service.server import propose_leased
from ztate.transition_service.work import Leases, Waker, WorkDispatcher
from ztate.worker_sdk import encode_json

OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"  # a sensitive change: parked
STALE_BUDGET = 2
LOST_RACE_BUDGET = 2


@dataclass
class Counted:
    """A pipeline and the statements its pool has sent since ``reset``."""

    pipeline: TransitionPipeline
    pool: asyncpg.Pool
    statements: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.statements.clear()


@pytest_asyncio.fixture(scope="module", params=LANES)
async def lane_dsn(request: pytest.FixtureRequest, settings: Settings) -> str:
    """A migrated database of each lane (plain Postgres; Citus, distributed, in its lane):
    the counts must hold on both."""
    dsn = await lane_database(request.param, request)
    if request.param == "postgres":
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn, settings.db_role)
        finally:
            await conn.close()
    return dsn


@pytest_asyncio.fixture
async def ledger(lane_dsn: str, keyring: Keyring) -> Ledger:
    return Ledger(lane_dsn, keyring)


@pytest_asyncio.fixture
async def replicas(
    lane_dsn: str, settings: Settings, keyring: Keyring
) -> AsyncIterator[tuple[Counted, Counted]]:
    """Two replicas of the service (each its own pool and head cache) on one database."""
    made: list[Counted] = []
    policies = PolicySet.load(settings.policy_path)
    for _ in range(2):
        statements: list[str] = []

        async def log_queries(conn: asyncpg.Connection, into: list[str] = statements) -> None:
            conn.add_query_logger(lambda logged: into.append(logged.query))

        pool = await asyncpg.create_pool(
            lane_dsn,
            min_size=1,
            max_size=2,
            init=log_queries,
            reset=keep_session,  # as the service's pool: no reset query on release
            server_settings={"role": settings.db_role},
        )
        pipeline = TransitionPipeline(
            store=PostgresTransitionStore(pool),
            policies=policies,
            keyring=keyring,
            max_patch_bytes=settings.max_patch_bytes,
            max_depth=settings.max_depth,
            head_cache_size=16,
        )
        made.append(Counted(pipeline, pool, statements))
    yield made[0], made[1]
    for counted in made:
        await counted.pool.close()


OPERATOR = Identity(TRUST_DOMAIN, Role.OPERATOR, "admin")
PARSER = Identity(TRUST_DOMAIN, Role.NODE, "input-parser")


def proposal(thread_id: str, version: int, key: str) -> Proposal:
    return Proposal(thread_id, version, encode_json({"requested_action": act(key)}), key)


async def stale_rows(ledger: Ledger, thread_id: str) -> list[int]:
    return [r["base_version"] for r in await ledger.rejections(thread_id)]


async def test_a_stale_proposal_costs_at_most_two_round_trips(
    replicas: tuple[Counted, Counted], ledger: Ledger
) -> None:
    first, _ = replicas
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    committed = await first.pipeline.propose(PARSER, proposal(thread_id, 0, "k-1"))
    assert isinstance(committed, Committed)

    first.reset()
    with pytest.raises(errors.StaleVersion) as refused:
        await first.pipeline.propose(PARSER, proposal(thread_id, 0, "k-2"))

    assert refused.value.current_version == 1
    assert len(first.statements) <= STALE_BUDGET, first.statements
    assert await stale_rows(ledger, thread_id) == [0]  # recorded once, nothing committed
    assert (await ledger.snapshot(thread_id)).head_version == 1


async def test_a_lost_race_costs_at_most_two_round_trips(
    replicas: tuple[Counted, Counted], ledger: Ledger
) -> None:
    winner, loser = replicas
    thread_id = new_thread_id()
    # the loser creates the thread, so its cache holds the head at version 0
    await loser.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    assert isinstance(
        await winner.pipeline.propose(PARSER, proposal(thread_id, 0, "k-win")), Committed
    )

    loser.reset()
    with pytest.raises(errors.StaleVersion) as refused:
        await loser.pipeline.propose(PARSER, proposal(thread_id, 0, "k-lose"))

    assert refused.value.current_version == 1
    assert loser.statements[0] == COMMIT  # it did try to commit
    assert len(loser.statements) <= LOST_RACE_BUDGET, loser.statements
    rows = await ledger.rejections(thread_id)
    assert [(r["reason"], r["base_version"]) for r in rows] == [("STALE_VERSION", 0)]
    assert rows[0]["message"] == "expected version 0, but the head is at 1"
    assert (await ledger.snapshot(thread_id)).head_version == 1


APPLY_DECISION_BUDGET = 3
PLANNER = Identity(TRUST_DOMAIN, Role.NODE, "planner")
APPROVAL_SERVICE = Identity(TRUST_DOMAIN, Role.SERVICE, APPROVAL_SERVICE_NAME)


@dataclass
class Decided:
    """A parked transition, the receipt that decides it, and a decision pipeline over the
    first replica's counted pool."""

    thread_id: str
    parked: Parked
    receipt: SignedReceipt
    decisions: DecisionPipeline


async def park_and_decide(
    first: Counted,
    lane_dsn: str,
    keyring: Keyring,
    settings: Settings,
    tmp_path: Path,
    decision: str,
    policies: PolicySet | None = None,
    *,
    nonce: str | None = None,
    approvals: ApprovalStore | None = None,
) -> Decided:
    """Park a sensitive change by the planner and sign a receipt deciding it (under
    ``nonce``, if given); the decision pipeline judges it under ``policies`` (the
    service's by default), through ``approvals`` (the store, by default)."""
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    parked = await first.pipeline.propose(
        PLANNER,
        Proposal(thread_id, 0, encode_json({"target_user_id": OTHER_USER}), "k-parked"),
    )
    assert isinstance(parked, Parked)
    generate_signing_key(tmp_path / "a.pem", tmp_path / "a.json", "a")
    now = datetime.now(UTC)
    receipt = sign_receipt(
        build_receipt(
            transition_digest=parked.pending.digest,
            thread_id=thread_id,
            base_version=0,
            decision=decision,
            reviewers=[f"spiffe://{TRUST_DOMAIN}/reviewer/alice"],
            issued_at=now,
            expires_at=now + timedelta(minutes=5),
            key_id="a",
            nonce=nonce,
        ),
        load_signing_key(tmp_path / "a.pem"),
    )
    decisions = DecisionPipeline(
        store=PostgresTransitionStore(first.pool),
        approvals=approvals or ApprovalStore(first.pool),
        keyring=keyring,
        public_keys=load_public_keys(tmp_path / "a.json"),
        heads=HeadCache(16),
        listener=OutcomeListener(lane_dsn, settings.db_role),  # not started: unused
        policies=policies or PolicySet.load(settings.policy_path),
    )
    return Decided(thread_id, parked, receipt, decisions)


async def decided_rows(lane_dsn: str, digest: str) -> tuple[str, list[str]]:
    """The parked row's status and the decisions of the receipts recorded for it."""
    conn = await asyncpg.connect(lane_dsn)
    try:
        status = await conn.fetchval(
            "SELECT status FROM ztate.pending_transitions WHERE digest = $1", digest
        )
        receipts = await conn.fetch(
            "SELECT decision FROM ztate.receipts WHERE transition_digest = $1", digest
        )
    finally:
        await conn.close()
    return str(status), [r["decision"] for r in receipts]


async def test_an_approved_decision_costs_at_most_three_round_trips(
    replicas: tuple[Counted, Counted],
    ledger: Ledger,
    lane_dsn: str,
    keyring: Keyring,
    settings: Settings,
    tmp_path: Path,
) -> None:
    """ApplyDecision of an approving receipt: the lookup by the receipt's thread (the
    parked row, its candidate state, the head, the nonce) and the commit call (lock,
    compare-and-swap, status, ledger record, receipt, announcements). It was 11."""
    first, _ = replicas
    case = await park_and_decide(first, lane_dsn, keyring, settings, tmp_path, "approve")

    first.reset()
    resolution = await case.decisions.apply(APPROVAL_SERVICE, case.receipt)

    assert resolution.outcome is DecidedOutcome.COMMITTED
    assert len(first.statements) <= APPLY_DECISION_BUDGET, first.statements
    rows = await ledger.rows(case.thread_id)
    assert [r["version"] for r in rows] == [0, 1]
    assert rows[1]["receipt"] == case.receipt.receipt_bytes
    assert (await ledger.snapshot(case.thread_id)).head_version == 1
    # the approved version's wakes were decided by the same call: the mark is at it
    assert (await work_rows(lane_dsn, case.thread_id))[1] == 1


async def test_a_rejecting_decision_costs_at_most_three_round_trips(
    replicas: tuple[Counted, Counted],
    ledger: Ledger,
    lane_dsn: str,
    keyring: Keyring,
    settings: Settings,
    tmp_path: Path,
) -> None:
    """A rejection: the lookup and one call (status, receipt, announcement). It was 6
    (the lookup, then BEGIN, status, receipt, announcement, COMMIT)."""
    first, _ = replicas
    case = await park_and_decide(first, lane_dsn, keyring, settings, tmp_path, "reject")

    first.reset()
    resolution = await case.decisions.apply(APPROVAL_SERVICE, case.receipt)

    assert resolution.outcome is DecidedOutcome.REJECTED
    assert len(first.statements) <= APPLY_DECISION_BUDGET, first.statements
    digest = case.parked.pending.digest
    assert await decided_rows(lane_dsn, digest) == ("rejected", ["reject"])
    assert [r["version"] for r in await ledger.rows(case.thread_id)] == [0]  # nothing committed
    # the nonce is spent all the same: the same receipt again is a replay, nothing written
    with pytest.raises(errors.ReceiptReplayed):
        await case.decisions.apply(APPROVAL_SERVICE, case.receipt)
    assert await decided_rows(lane_dsn, digest) == ("rejected", ["reject"])


class LookedUpBefore(ApprovalStore):
    """The store, with another decision committed between a decision's look-up and its
    call: the race a look-up cannot see."""

    def __init__(self, pool: asyncpg.Pool, meanwhile: Callable[[], Awaitable[object]]) -> None:
        super().__init__(pool)
        self._meanwhile = meanwhile

    async def decision_lookup(self, thread_id: str, digest: str, nonce: str) -> DecisionLookup:
        looked = await super().decision_lookup(thread_id, digest, nonce)
        await self._meanwhile()
        return looked


async def test_a_rejection_whose_nonce_was_used_meanwhile_is_a_replay_and_writes_nothing(
    replicas: tuple[Counted, Counted],
    ledger: Ledger,
    lane_dsn: str,
    keyring: Keyring,
    settings: Settings,
    tmp_path: Path,
) -> None:
    """Two receipts with one nonce, the second looked up before the first was applied:
    the second's call finds the nonce taken (a unique violation, which reached the
    caller as INTERNAL) and is refused as a replay; its transition stays pending, and
    no receipt of it is stored."""
    first, _ = replicas
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    winner = await park_and_decide(first, lane_dsn, keyring, settings, tmp_path / "a", "reject")
    nonce = str(orjson.loads(winner.receipt.receipt_bytes)["nonce"])
    loser = await park_and_decide(
        first,
        lane_dsn,
        keyring,
        settings,
        tmp_path / "b",
        "reject",
        nonce=nonce,
        approvals=LookedUpBefore(
            first.pool, lambda: winner.decisions.apply(APPROVAL_SERVICE, winner.receipt)
        ),
    )

    with pytest.raises(errors.ReceiptReplayed):
        await loser.decisions.apply(APPROVAL_SERVICE, loser.receipt)

    assert await decided_rows(lane_dsn, winner.parked.pending.digest) == ("rejected", ["reject"])
    assert await decided_rows(lane_dsn, loser.parked.pending.digest) == ("pending", [])
    assert [r["version"] for r in await ledger.rows(loser.thread_id)] == [0]


async def test_an_approval_the_policy_now_refuses_costs_at_most_three_round_trips(
    replicas: tuple[Counted, Counted],
    ledger: Ledger,
    lane_dsn: str,
    keyring: Keyring,
    settings: Settings,
    tmp_path: Path,
) -> None:
    """An approval of a change the policy in force no longer allows (the planner lost
    target_user_id): the lookup and one call (status, rejection row, announcement). It
    was 6."""
    first, _ = replicas
    tightened = tmp_path / "tightened"
    shutil.copytree(settings.policy_path, tightened)
    policy = tightened / "pipeline.yaml"
    text = policy.read_text()
    assert text.count("write: [pending_transition, target_user_id]") == 1
    policy.write_text(text.replace("write: [pending_transition, target_user_id]", "write: []"))
    case = await park_and_decide(
        first, lane_dsn, keyring, settings, tmp_path, "approve", PolicySet.load(tightened)
    )

    first.reset()
    resolution = await case.decisions.apply(APPROVAL_SERVICE, case.receipt)

    assert (resolution.outcome, resolution.reason) == (DecidedOutcome.REFUSED, "KEY_NOT_WRITABLE")
    assert len(first.statements) <= APPLY_DECISION_BUDGET, first.statements
    assert await decided_rows(lane_dsn, case.parked.pending.digest) == ("refused", [])
    refusals = await ledger.rejections(case.thread_id)
    assert [(r["method"], r["reason"], r["keys"]) for r in refusals] == [
        ("ApplyDecision", "KEY_NOT_WRITABLE", ["target_user_id"])
    ]
    assert [r["version"] for r in await ledger.rows(case.thread_id)] == [0]  # nothing committed


async def test_an_approval_after_the_thread_moved_costs_at_most_three_round_trips(
    replicas: tuple[Counted, Counted],
    ledger: Ledger,
    lane_dsn: str,
    keyring: Keyring,
    settings: Settings,
    tmp_path: Path,
) -> None:
    """An approval whose thread moved on since the change was parked: the lookup and the
    commit call, which loses its compare-and-swap and closes the parked row as stale. It
    was 7 (a second transaction closed the row)."""
    first, second = replicas
    case = await park_and_decide(first, lane_dsn, keyring, settings, tmp_path, "approve")
    moved = await second.pipeline.propose(PARSER, proposal(case.thread_id, 0, "k-moved"))
    assert isinstance(moved, Committed)

    first.reset()
    with pytest.raises(errors.ApprovalStale):
        await case.decisions.apply(APPROVAL_SERVICE, case.receipt)

    assert len(first.statements) <= APPLY_DECISION_BUDGET, first.statements
    assert await decided_rows(lane_dsn, case.parked.pending.digest) == ("stale", [])
    rows = await ledger.rows(case.thread_id)
    assert [(r["version"], r["receipt"]) for r in rows] == [(0, None), (1, None)]  # the parser's


async def work_rows(lane_dsn: str, thread_id: str) -> tuple[list[tuple[str, int]], int | None]:
    """The nodes with work on the thread (node, wake version) and its wake mark."""
    conn = await asyncpg.connect(lane_dsn)
    try:
        work = await conn.fetch(
            "SELECT node, wake_version FROM ztate.node_work WHERE thread_id = $1 ORDER BY node",
            thread_id,
        )
        mark = await conn.fetchval(
            "SELECT evaluated_version FROM ztate.wake_marks WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    return [(r["node"], r["wake_version"]) for r in work], mark


async def test_a_commit_records_whom_it_wakes_in_its_own_statement(
    replicas: tuple[Counted, Counted], lane_dsn: str, settings: Settings
) -> None:
    """Migration 0018: the statement that commits a version records the nodes it wakes
    and advances the thread's wake mark, for a creation as for a proposal. A version
    that wakes no one costs that one statement; one that wakes a node, the announcement
    after it. Before, the service decided every commit's wakes in the background with
    three more round trips and a transaction of their own."""
    first, _ = replicas
    thread_id = new_thread_id()
    first.reset()  # the initial raw_text wakes the parser
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    assert first.statements == [CREATE_THREAD, ANNOUNCE_WORK]
    assert await work_rows(lane_dsn, thread_id) == ([("input-parser", 0)], 0)

    first.reset()  # the planner is woken only by an action other than 'none'
    quiet = await first.pipeline.propose(
        PARSER,
        Proposal(thread_id, 0, encode_json({"requested_action": act("q", "none")}), "k-q"),
    )
    assert isinstance(quiet, Committed)
    assert first.statements == [COMMIT]
    assert await work_rows(lane_dsn, thread_id) == ([("input-parser", 0)], 1)

    first.reset()
    waking = await first.pipeline.propose(PARSER, proposal(thread_id, 1, "k-w"))
    assert isinstance(waking, Committed)
    assert first.statements == [COMMIT, ANNOUNCE_WORK]
    assert await work_rows(lane_dsn, thread_id) == ([("input-parser", 0), ("planner", 2)], 2)
    # nothing is left for the sweep to decide
    waker = Waker(WorkStore(first.pool), PolicySet.load(settings.policy_path))
    await waker.evaluate(thread_id)
    assert await work_rows(lane_dsn, thread_id) == ([("input-parser", 0), ("planner", 2)], 2)


async def test_a_commit_never_moves_a_mark_past_a_version_nobody_decided(
    replicas: tuple[Counted, Counted], lane_dsn: str, settings: Settings
) -> None:
    """A thread committed before migration 0018 can have a version whose wakes were never
    decided (a replica died between the commit and its background decision): its mark is
    behind. A new commit then leaves the mark alone, so that the sweep still finds the
    thread and decides the version it missed."""
    first, _ = replicas
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    woke = await first.pipeline.propose(PARSER, proposal(thread_id, 0, "k-1"))  # wakes planner
    assert isinstance(woke, Committed)
    conn = await asyncpg.connect(lane_dsn)
    try:  # as the version looked before 0018, its decision lost: no work, the mark at 0
        await conn.execute("DELETE FROM ztate.node_work WHERE thread_id = $1", thread_id)
        await conn.execute(
            "UPDATE ztate.wake_marks SET evaluated_version = 0 WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()

    quiet = await first.pipeline.propose(
        PARSER,
        Proposal(thread_id, 1, encode_json({"requested_action": act("q", "none")}), "k-2"),
    )
    assert isinstance(quiet, Committed)
    assert await work_rows(lane_dsn, thread_id) == ([], 0)  # the mark stayed behind
    waker = Waker(WorkStore(first.pool), PolicySet.load(settings.policy_path))
    await waker.evaluate(thread_id)  # the sweep's decision
    assert await work_rows(lane_dsn, thread_id) == ([("planner", 1)], 2)


async def test_a_commit_whose_announcement_fails_is_still_answered_committed(
    replicas: tuple[Counted, Counted], ledger: Ledger, lane_dsn: str
) -> None:
    """The announcement after a commit is best effort: when it fails (here pg_notify is
    refused to the service role), the proposal is still answered committed, as it is
    durable; before, the failure reached the caller, which counted it as refused."""
    first, _ = replicas
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    conn = await asyncpg.connect(lane_dsn)
    await conn.execute("REVOKE EXECUTE ON FUNCTION pg_notify(text, text) FROM PUBLIC")
    try:
        first.reset()
        committed = await first.pipeline.propose(PARSER, proposal(thread_id, 0, "k-1"))
    finally:
        await conn.execute("GRANT EXECUTE ON FUNCTION pg_notify(text, text) TO PUBLIC")
        await conn.close()
    assert isinstance(committed, Committed)
    assert first.statements == [COMMIT, ANNOUNCE_WORK]  # it tried to announce the planner
    assert [r["version"] for r in await ledger.rows(thread_id)] == [0, 1]
    assert (await work_rows(lane_dsn, thread_id))[0][-1] == ("planner", 1)


# --- proposals under a lease (SubscribeWork workers; migration 0019) -------------------------


def leases_of(counted: Counted, lane_dsn: str, settings: Settings) -> Leases:
    """The service's lease handling on the replica's own (counted) pool; its dispatcher
    is never started (nothing subscribes here)."""
    policies = PolicySet.load(settings.policy_path)
    work = WorkStore(counted.pool)
    dispatcher = WorkDispatcher(
        PostgresTransitionStore(counted.pool),
        work,
        policies,
        Waker(work, policies),
        OutcomeListener(lane_dsn, settings.db_role),
        lease_seconds=30.0,
        poll_seconds=60.0,
        max_streams=4,
        per_identity=4,
        lifetime=60.0,
    )
    return Leases(work, dispatcher)


async def parser_lease(lane_dsn: str, thread_id: str) -> asyncpg.Record:
    conn = await asyncpg.connect(lane_dsn)
    try:
        row = await conn.fetchrow(
            "SELECT epoch, holder, handled_version FROM ztate.node_work "
            "WHERE thread_id = $1 AND node = 'input-parser'",
            thread_id,
        )
    finally:
        await conn.close()
    assert row is not None
    return row


def quiet(thread_id: str, version: int, key: str) -> Proposal:
    """A proposal whose version wakes nobody (no announcement after its commit)."""
    return Proposal(thread_id, version, encode_json({"requested_action": act(key, "none")}), key)


async def test_a_leased_proposal_that_commits_costs_one_round_trip(
    replicas: tuple[Counted, Counted], ledger: Ledger, lane_dsn: str, settings: Settings
) -> None:
    """The fence and the release happen in the commit's own call: one statement (it was
    three: HOLDS, the commit, RELEASE), the lease given back exactly as RELEASE did
    (no holder, handled up to the version the proposal built on)."""
    first, _ = replicas
    leases = leases_of(first, lane_dsn, settings)
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    lease = await WorkStore(first.pool).acquire(thread_id, "input-parser", "test", 30.0)
    assert lease is not None  # the initial raw_text woke the parser at version 0

    first.reset()
    committed = await propose_leased(
        first.pipeline, leases, PARSER, quiet(thread_id, 0, "k-1"), lease.epoch
    )

    assert isinstance(committed, Committed)
    assert not committed.replayed
    assert first.statements == [COMMIT]
    assert [r["version"] for r in await ledger.rows(thread_id)] == [0, 1]
    released = await parser_lease(lane_dsn, thread_id)
    assert (released["epoch"], released["holder"], released["handled_version"]) == (
        lease.epoch,
        None,
        0,
    )


async def test_a_leased_proposal_whose_lease_was_lost_commits_nothing(
    replicas: tuple[Counted, Counted], ledger: Ledger, lane_dsn: str, settings: Settings
) -> None:
    """A grant that no longer holds the lease (released, and granted again under a new
    epoch) is refused with LEASE_LOST by the commit's own fence: nothing committed, its
    rejection row recorded, the new grant untouched. Even when the head moved meanwhile
    (the replica's cache still at the old version): the lost lease is the refusal."""
    first, second = replicas
    leases = leases_of(first, lane_dsn, settings)
    work = WorkStore(first.pool)
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    old = await work.acquire(thread_id, "input-parser", "test", 30.0)
    assert old is not None
    assert await work.release(thread_id, "input-parser", old.epoch, -1) is True
    new = await work.acquire(thread_id, "input-parser", "other", 30.0)
    assert new is not None
    assert new.epoch == old.epoch + 1

    for expected, key in [(0, "k-lost"), (0, "k-lost-moved")]:
        first.reset()
        with pytest.raises(errors.LeaseLost):
            await propose_leased(
                first.pipeline, leases, PARSER, quiet(thread_id, expected, key), old.epoch
            )
        assert first.statements[0] == COMMIT, first.statements  # the commit fenced it
        assert len(first.statements) == 2, first.statements  # then the rejection row
        if key == "k-lost":  # the head moves under the replica's cached version 0
            moved = await second.pipeline.propose(PARSER, quiet(thread_id, 0, "k-other"))
            assert isinstance(moved, Committed)

    rejected = await ledger.rejections(thread_id)
    assert [(r["reason"], r["base_version"]) for r in rejected] == [
        ("LEASE_LOST", 0),
        ("LEASE_LOST", 0),
    ]
    rows = await ledger.rows(thread_id)
    assert [(r["version"], r["idempotency_key"]) for r in rows] == [(0, None), (1, "k-other")]
    held = await parser_lease(lane_dsn, thread_id)
    assert (held["epoch"], held["holder"], held["handled_version"]) == (new.epoch, "other", -1)


async def test_a_stale_leased_proposal_keeps_its_lease(
    replicas: tuple[Counted, Counted], ledger: Ledger, lane_dsn: str, settings: Settings
) -> None:
    """A stale proposal under a lease that holds is refused as before (STALE_VERSION, its
    rejection row) and the lease stays held; it costs the commit, which fenced it, and
    the look-up that explains the lost race (it was three: the fence first)."""
    first, second = replicas
    leases = leases_of(first, lane_dsn, settings)
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    lease = await WorkStore(first.pool).acquire(thread_id, "input-parser", "test", 30.0)
    assert lease is not None
    moved = await second.pipeline.propose(PARSER, quiet(thread_id, 0, "k-other"))
    assert isinstance(moved, Committed)

    first.reset()
    with pytest.raises(errors.StaleVersion) as refused:
        await propose_leased(
            first.pipeline, leases, PARSER, quiet(thread_id, 0, "k-stale"), lease.epoch
        )

    assert refused.value.current_version == 1
    assert first.statements[0] == COMMIT, first.statements
    assert len(first.statements) <= LOST_RACE_BUDGET, first.statements
    assert [(r["reason"], r["base_version"]) for r in await ledger.rejections(thread_id)] == [
        ("STALE_VERSION", 0)
    ]
    assert (await ledger.snapshot(thread_id)).head_version == 1
    held = await parser_lease(lane_dsn, thread_id)
    assert (held["epoch"], held["holder"], held["handled_version"]) == (lease.epoch, "test", -1)


class LeaseLostBeforeParking(PostgresTransitionStore):
    """The store, with the lease of the proposal being parked lost just before its park
    is sent (released by its grant, granted again): the race no fence sent before the
    park can see."""

    def __init__(self, pool: asyncpg.Pool, meanwhile: Callable[[], Awaitable[object]]) -> None:
        super().__init__(pool)
        self._meanwhile = meanwhile

    async def park(self, *args: Any, **kwargs: Any) -> Parking:
        await self._meanwhile()
        return await super().park(*args, **kwargs)


async def planner_work(lane_dsn: str, thread_id: str) -> tuple[int, str | None, int, int]:
    """The planner's lease on the thread (epoch, holder, handled version) and how many
    proposals are parked on it."""
    conn = await asyncpg.connect(lane_dsn)
    try:
        row = await conn.fetchrow(
            "SELECT epoch, holder, handled_version FROM ztate.node_work "
            "WHERE thread_id = $1 AND node = 'planner'",
            thread_id,
        )
        parked = await conn.fetchval(
            "SELECT count(*) FROM ztate.pending_transitions WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert row is not None
    return row["epoch"], row["holder"], row["handled_version"], parked


def risky(thread_id: str, version: int, key: str) -> Proposal:
    """The planner's change of target_user_id: parked for approval."""
    return Proposal(thread_id, version, encode_json({"target_user_id": OTHER_USER}), key)


@pytest.mark.parametrize("cached", [True, False], ids=["cached-head", "looked-up-head"])
async def test_a_risky_proposal_whose_lease_is_lost_as_it_parks_parks_nothing(
    replicas: tuple[Counted, Counted],
    ledger: Ledger,
    lane_dsn: str,
    settings: Settings,
    keyring: Keyring,
    cached: bool,
) -> None:
    """The park of a proposal under a lease fences the lease in its own call (migration
    0024), as a commit does: a grant that lost the lease after every earlier look at it
    parks nothing and is refused LEASE_LOST, its rejection row recorded, the new grant
    untouched. Before, the pipeline fenced with a statement of its own and then parked:
    a lease lost in between left a proposal parked for approval under a lost lease.
    On the head the replica has cached, that park is the proposal's only statement
    (there was the fence before it)."""
    first, _ = replicas
    other = await asyncpg.create_pool(lane_dsn, min_size=1, max_size=1)  # not counted
    try:
        work = WorkStore(other)
        thread_id = new_thread_id()
        lost: list[int] = []

        async def lose() -> None:
            (epoch,) = lost
            assert await work.release(thread_id, "planner", epoch, -1) is not None
            assert await work.acquire(thread_id, "planner", "other", 30.0) is not None

        pipeline = TransitionPipeline(
            store=LeaseLostBeforeParking(first.pool, lose),
            policies=PolicySet.load(settings.policy_path),
            keyring=keyring,
            max_patch_bytes=settings.max_patch_bytes,
            max_depth=settings.max_depth,
            head_cache_size=16,
        )
        # the parser's commit wakes the planner at version 1; through this pipeline, its
        # head cache then holds version 1, otherwise it looks the head up
        author = pipeline if cached else first.pipeline
        await author.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
        assert isinstance(await author.propose(PARSER, proposal(thread_id, 0, "k-1")), Committed)
        lease = await work.acquire(thread_id, "planner", "test", 30.0)
        assert lease is not None
        lost.append(lease.epoch)

        first.reset()
        with pytest.raises(errors.LeaseLost):
            await propose_leased(
                pipeline,
                leases_of(first, lane_dsn, settings),
                PLANNER,
                risky(thread_id, 1, "k-r"),
                lease.epoch,
            )
    finally:
        await other.close()

    assert await planner_work(lane_dsn, thread_id) == (lease.epoch + 1, "other", -1, 0)
    rejected = await ledger.rejections(thread_id)
    assert [(r["reason"], r["base_version"]) for r in rejected] == [("LEASE_LOST", 1)]
    assert [r["version"] for r in await ledger.rows(thread_id)] == [0, 1]
    if cached:
        assert first.statements[0] == PARK, first.statements  # no fence of its own first
        assert len(first.statements) == 2, first.statements  # then the rejection row


async def test_a_leased_proposal_that_parks_costs_two_round_trips(
    replicas: tuple[Counted, Counted], ledger: Ledger, lane_dsn: str, settings: Settings
) -> None:
    """A risky proposal under a lease that holds, on the cached head: the park, which
    fences the lease (migration 0024), and the release (it was three: the fence first).
    Parked, the lease given back, the planner done with the version it built on."""
    first, _ = replicas
    leases = leases_of(first, lane_dsn, settings)
    thread_id = new_thread_id()
    await first.pipeline.create_thread(OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL))
    assert isinstance(
        await first.pipeline.propose(PARSER, proposal(thread_id, 0, "k-1")), Committed
    )
    lease = await WorkStore(first.pool).acquire(thread_id, "planner", "test", 30.0)
    assert lease is not None

    first.reset()
    parked = await propose_leased(
        first.pipeline, leases, PLANNER, risky(thread_id, 1, "k-r"), lease.epoch
    )

    assert isinstance(parked, Parked)
    assert not parked.replayed
    assert first.statements == [PARK, RELEASE], first.statements
    assert await planner_work(lane_dsn, thread_id) == (lease.epoch, None, 1, 1)
    assert [r["version"] for r in await ledger.rows(thread_id)] == [0, 1]


async def test_a_repeated_creation_costs_two_round_trips(
    replicas: tuple[Counted, Counted], ledger: Ledger
) -> None:
    """CreateThread again, by its creator with its genesis (a retry whose reply was lost):
    the creation that finds the id taken, then one read of the genesis with the thread's
    policy (it was two: the genesis, then the head). The same with another initial state
    is THREAD_EXISTS, at the same cost. Nothing is written either way."""
    first, _ = replicas
    thread_id = new_thread_id()
    created = await first.pipeline.create_thread(
        OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL)
    )
    before = await ledger.snapshot(thread_id)

    first.reset()
    again = await first.pipeline.create_thread(
        OPERATOR, thread_id, "pipeline", canonical_bytes(INITIAL)
    )
    assert again.replayed
    assert again.transition.digest == created.transition.digest
    assert first.statements[0] == CREATE_THREAD
    assert len(first.statements) == 2, first.statements

    first.reset()
    with pytest.raises(errors.ThreadExists):
        await first.pipeline.create_thread(
            OPERATOR, thread_id, "pipeline", canonical_bytes({**INITIAL, "raw_text": "other"})
        )
    assert len(first.statements) == 2, first.statements
    assert await ledger.snapshot(thread_id) == before
