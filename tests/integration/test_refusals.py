"""Every refused proposal: the precise error, and nothing committed.

Each test snapshots the thread's head and ledger before the call and asserts they
are unchanged after it; refusals by an authenticated node are also recorded in
the rejections ledger with their reason code and a digest of the refused bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.conftest import POLICY, TEST_MAX_PATCH_BYTES
from tests.harness import INITIAL, TRUST_DOMAIN, Ledger, Pki, act, client, new_thread_id
from ztate.services.policy.model import Policy
from ztate.services.store.work import WorkStore
from ztate.worker_sdk import (
    AwaitingApproval,
    InvalidRequest,
    LeaseLost,
    NotFound,
    PatchTooLarge,
    PermissionDenied,
    StaleVersion,
    ZtateClient,
    ZtateError,
)

PARSER_LIMIT = Policy.load(POLICY).max_patch_bytes("input-parser")


@pytest_asyncio.fixture
async def thread_id(target: str, pki: Pki) -> str:
    thread = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread, INITIAL, policy="pipeline")
    return thread


@pytest_asyncio.fixture
async def parser(target: str, pki: Pki) -> AsyncIterator[ZtateClient]:
    async with client(target, pki.node("input-parser")) as worker:
        yield worker


async def refused(
    ledger: Ledger, thread_id: str, call: object, expected: type[ZtateError], reason: str
) -> ZtateError:
    """Run ``call``; assert it raised ``expected`` with ``reason`` and changed nothing."""
    before = await ledger.snapshot(thread_id)
    with pytest.raises(expected) as caught:
        await call  # type: ignore[misc]
    assert caught.value.reason == reason, caught.value
    assert await ledger.snapshot(thread_id) == before
    return caught.value


async def test_stale_version_returns_the_head_and_commits_nothing(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    await parser.propose(thread_id, 0, {"requested_action": act("first")})
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, {"requested_action": act("late")}),
        StaleVersion,
        "STALE_VERSION",
    )
    assert error.code == grpc.StatusCode.ABORTED
    assert error.current_version == 1
    [row] = await ledger.rejections(thread_id)
    assert (row["reason"], row["base_version"]) == ("STALE_VERSION", 0)


async def test_version_from_the_future_is_stale(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 7, {"requested_action": act("x")}),
        StaleVersion,
        "STALE_VERSION",
    )
    assert error.current_version == 0


async def test_unknown_thread(parser: ZtateClient, ledger: Ledger) -> None:
    missing = new_thread_id()
    error = await refused(
        ledger,
        missing,
        parser.propose(missing, 0, {"requested_action": act("x")}),
        NotFound,
        "THREAD_NOT_FOUND",
    )
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert (await ledger.snapshot(missing)).transitions == 0


async def test_key_outside_the_write_allowlist_refuses_the_whole_patch(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    patch = {
        "requested_action": act("refund"),
        "execution_permissions": ["admin"],
        "target_user_id": "attacker",
    }
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        PermissionDenied,
        "KEY_NOT_WRITABLE",
    )
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert error.keys == ("execution_permissions", "target_user_id")
    [row] = await ledger.rejections(thread_id)
    assert row["reason"] == "KEY_NOT_WRITABLE"
    assert list(row["keys"]) == ["execution_permissions", "target_user_id"]
    assert row["node_id"] == "spiffe://ztate.test/node/input-parser"
    assert row["patch_digest"] is not None
    assert "attacker" not in row["message"]


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        (b'{"requested_action": {"action": "refund"}', "not valid JSON"),
        (b'["requested_action"]', "must be a JSON object"),
        (
            b'{"requested_action": {"action": "refund"}, "requested_action": {"action": "none"}}',
            "duplicate member name",
        ),
        (b'{"requested_action": {"action": "\xff\xfe"}}', "not valid UTF-8"),
        (b'{"requested_action": {"action": "\\ud800"}}', "lone surrogate"),
        (b"", "not valid JSON"),
    ],
    ids=["truncated", "array", "duplicate-key", "not-utf8", "lone-surrogate", "empty"],
)
async def test_malformed_patch(
    parser: ZtateClient, thread_id: str, ledger: Ledger, patch: bytes, fragment: str
) -> None:
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        InvalidRequest,
        "PATCH_MALFORMED",
    )
    assert fragment in error.message
    [row] = await ledger.rejections(thread_id)
    assert row["patch_digest"] == hashlib.sha256(patch).hexdigest()


@pytest.mark.parametrize(
    "patch",
    [
        b'{"requested_action": 9007199254740992}',
        b'{"requested_action": -9007199254740992}',
        b'{"requested_action": 1e400}',
        b'{"requested_action": NaN}',
        b'{"requested_action": -Infinity}',
        b'{"requested_action": ' + b"[" * 40 + b"]" * 40 + b"}",
        b'{"requested_action": 1e20}',
        b'{"requested_action": 1e-400}',
        b'{"requested_action": ' + b"7" * 4000 + b"}",
    ],
    ids=["2^53", "-2^53", "1e400", "NaN", "-Infinity", "too-deep", "1e20", "underflow", "digits"],
)
async def test_numbers_outside_ijson_and_deep_nesting(
    parser: ZtateClient, thread_id: str, ledger: Ledger, patch: bytes
) -> None:
    await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        InvalidRequest,
        "VALUE_OUT_OF_RANGE",
    )


async def test_largest_safe_integer_passes_the_parser_and_meets_the_schema(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    patch = b'{"requested_action": {"action": "refund", "amount_cents": 9007199254740991}}'
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        InvalidRequest,
        "SCHEMA_VIOLATION",
    )
    assert "requested_action.amount_cents" in error.message


@pytest.mark.parametrize(
    ("node", "limit"),
    [("input-parser", PARSER_LIMIT), ("planner", TEST_MAX_PATCH_BYTES)],
    ids=["node-limit-from-policy", "service-limit"],
)
async def test_oversized_patch_is_refused_before_parsing(
    target: str, pki: Pki, thread_id: str, ledger: Ledger, node: str, limit: int
) -> None:
    # Not JSON at all: only a size check that runs before the parser can name it.
    patch = b"{" * (limit + 1)
    async with client(target, pki.node(node)) as worker:
        error = await refused(
            ledger,
            thread_id,
            worker.propose(thread_id, 0, patch),
            PatchTooLarge,
            "PATCH_TOO_LARGE",
        )
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.limit == limit
    [row] = await ledger.rejections(thread_id)
    assert row["patch_bytes"] == limit + 1


async def test_patch_at_the_limit_is_parsed(parser: ZtateClient, thread_id: str) -> None:
    body = b'{"requested_action": {"action": "none"}'
    patch = body + b" " * (PARSER_LIMIT - len(body) - 1) + b"}"
    assert len(patch) == PARSER_LIMIT
    committed = await parser.propose(thread_id, 0, patch)
    assert committed.version == 1


async def test_reused_idempotency_key_for_another_request(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    await parser.propose(thread_id, 0, {"requested_action": act("a")}, idempotency_key="same")
    await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, {"requested_action": act("b")}, idempotency_key="same"),
        InvalidRequest,
        "IDEMPOTENCY_KEY_REUSED",
    )


async def test_reused_idempotency_key_at_the_current_head(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    """The key is taken even when the new request's base is the head."""
    await parser.propose(thread_id, 0, {"requested_action": act("a")}, idempotency_key="again")
    await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 1, {"requested_action": act("b")}, idempotency_key="again"),
        InvalidRequest,
        "IDEMPOTENCY_KEY_REUSED",
    )


@pytest.mark.parametrize(
    ("thread", "version", "key", "fragment"),
    [
        ("bad id with spaces", 0, "k", "thread_id"),
        ("x" * 129, 0, "k", "thread_id"),
        (None, -1, "k", "expected_version"),
        (None, 0, "", "idempotency_key"),
        (None, 0, "k" * 129, "idempotency_key"),
    ],
    ids=["thread-chars", "thread-length", "negative-version", "empty-key", "long-key"],
)
async def test_invalid_request_fields(
    parser: ZtateClient,
    thread_id: str,
    ledger: Ledger,
    thread: str | None,
    version: int,
    key: str,
    fragment: str,
) -> None:
    call = parser._stub.ProposeTransition  # raw stub: the SDK would fill an empty key
    from ztate.v1 import transition_pb2

    request = transition_pb2.ProposeTransitionRequest(
        thread_id=thread or thread_id,
        expected_version=version,
        patch_json=b'{"requested_action": {"action": "none"}}',
        idempotency_key=key,
    )
    before = await ledger.snapshot(thread_id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (caught.value.details() or "")
    assert await ledger.snapshot(thread_id) == before


async def test_empty_patch(parser: ZtateClient, thread_id: str, ledger: Ledger) -> None:
    await refused(
        ledger, thread_id, parser.propose(thread_id, 0, {}), InvalidRequest, "REQUEST_INVALID"
    )


async def test_thread_id_taken(target: str, pki: Pki, thread_id: str, ledger: Ledger) -> None:
    async with client(target, pki.operator()) as operator:
        error = await refused(
            ledger,
            thread_id,
            operator.create_thread(thread_id, {"raw_text": "other"}, policy="pipeline"),
            ZtateError,
            "THREAD_EXISTS",
        )
    assert error.code == grpc.StatusCode.ALREADY_EXISTS


async def test_creating_a_thread_again_as_its_creator_answers_its_genesis(
    target: str, pki: Pki, thread_id: str, ledger: Ledger
) -> None:
    """A CreateThread retried after its reply was lost (the SDK retries it) is answered
    the genesis it created, not THREAD_EXISTS; the same id, state and policy from another
    operator, or with another policy, is still THREAD_EXISTS. Nothing new is written.
    The answer to the repeat says so (``replayed``); a creation does not."""
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.operator()) as operator:
        first = await operator.get_transition(thread_id=thread_id, version=0)
        again = await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        fresh = await operator.create_thread(new_thread_id(), INITIAL, policy="pipeline")
        with pytest.raises(ZtateError) as other_policy:
            await operator.create_thread(thread_id, {"invoice_note": "n"}, policy="billing")
    async with client(target, pki.operator("other-admin")) as other:
        with pytest.raises(ZtateError) as other_operator:
            await other.create_thread(thread_id, INITIAL, policy="pipeline")
    assert (again.version, again.digest, again.record_json) == (0, first.digest, first.record_json)
    assert (again.replayed, fresh.replayed) == (True, False)
    assert other_operator.value.reason == "THREAD_EXISTS"
    assert other_operator.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert other_policy.value.reason == "THREAD_EXISTS"
    assert await ledger.snapshot(thread_id) == before


async def test_initial_state_with_undeclared_key(target: str, pki: Pki, ledger: Ledger) -> None:
    thread = new_thread_id()
    async with client(target, pki.operator()) as operator:
        error = await refused(
            ledger,
            thread,
            operator.create_thread(thread, {"raw_text": "x", "is_admin": True}, policy="pipeline"),
            InvalidRequest,
            "KEY_UNKNOWN",
        )
    assert error.keys == ("is_admin",)
    assert (await ledger.snapshot(thread)).head_version is None


@pytest.mark.parametrize(
    "name",
    ["x" * 5000, "pipeline\n\x1b[31mRED", "<script>alert(1)</script>", "Pipeline"],
    ids=["long", "control", "markup", "not-lower-case"],
)
async def test_a_policy_name_that_is_not_one_is_not_repeated(
    target: str, pki: Pki, ledger: Ledger, name: str
) -> None:
    """CreateThread with a policy name no policy may have: POLICY_NOT_FOUND, the name
    not repeated in the answer (nor so in the rejection it may become), nothing created."""
    thread = new_thread_id()
    async with client(target, pki.operator()) as operator:
        error = await refused(
            ledger,
            thread,
            operator.create_thread(thread, INITIAL, policy=name),
            ZtateError,
            "POLICY_NOT_FOUND",
        )
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert str(error.message) == "no policy by that name is loaded: it is not a policy name"
    assert (await ledger.snapshot(thread)).head_version is None


async def test_unknown_transition(target: str, pki: Pki) -> None:
    async with client(target, pki.operator()) as operator:
        with pytest.raises(NotFound) as caught:
            await operator.get_transition(digest="0" * 64)
    assert caught.value.reason == "TRANSITION_NOT_FOUND"


async def test_creating_a_thread_again_with_another_initial_state_is_thread_exists(
    target: str, pki: Pki, thread_id: str, ledger: Ledger
) -> None:
    """The creator, with the same policy, asking again for a thread it created with
    another initial state (one value changed, one key fewer, one key more) is refused
    THREAD_EXISTS: a retry is only one with the same genesis. The same state with its
    keys in another order is the same genesis (canonical JSON): the replay. Nothing new
    is written, and the genesis keeps its initial state."""
    before = await ledger.snapshot(thread_id)
    others = [
        {**INITIAL, "raw_text": "please refund order A-43"},
        {key: value for key, value in INITIAL.items() if key != "authority"},
        {**INITIAL, "requested_action": act("more")},
    ]
    async with client(target, pki.operator()) as operator:
        genesis = await operator.get_transition(thread_id=thread_id, version=0)
        refusals = []
        for state in others:
            with pytest.raises(ZtateError) as caught:
                await operator.create_thread(thread_id, state, policy="pipeline")
            refusals.append((caught.value.reason, caught.value.code))
        reordered = dict(reversed(list(INITIAL.items())))
        again = await operator.create_thread(thread_id, reordered, policy="pipeline")
    assert refusals == [("THREAD_EXISTS", grpc.StatusCode.ALREADY_EXISTS)] * len(others)
    assert (again.replayed, again.version, again.digest) == (True, 0, genesis.digest)
    assert await ledger.snapshot(thread_id) == before
    assert (await ledger.record(thread_id, 0))["patch"] == INITIAL


OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"  # the planner's change to it is parked


async def lease_row(dsn: str, thread_id: str, node: str) -> tuple[int, str | None, int]:
    """The lease of ``node`` on ``thread_id``: (epoch, holder, handled_version)."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT epoch, holder, handled_version FROM ztate.node_work "
            "WHERE thread_id = $1 AND node = $2",
            thread_id,
            node,
        )
    finally:
        await conn.close()
    assert row is not None, f"{node} has no work on the thread"
    return row["epoch"], row["holder"], row["handled_version"]


async def parked_rows(dsn: str, thread_id: str) -> list[tuple[str, int, str]]:
    """The thread's parked proposals: (node id, base version, status)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT node_id, base_version, status FROM ztate.pending_transitions "
            "WHERE thread_id = $1 ORDER BY parked_at",
            thread_id,
        )
    finally:
        await conn.close()
    return [(r["node_id"], r["base_version"], r["status"]) for r in rows]


async def lost_and_held(dsn: str, thread_id: str, node: str) -> tuple[int, int]:
    """Two grants of ``node``'s lease on the thread: one that lost it (released, then
    granted again) and the one that holds it now; their epochs."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        work = WorkStore(pool)
        lost = await work.acquire(thread_id, node, "test-lost", 60.0)
        assert lost is not None
        assert await work.release(thread_id, node, lost.epoch, -1) is not None
        held = await work.acquire(thread_id, node, "test-held", 60.0)
        assert held is not None
    finally:
        await pool.close()
    return lost.epoch, held.epoch


def planner_refusals(rows: list[asyncpg.Record]) -> list[tuple[str, int]]:
    return [(r["reason"], r["base_version"]) for r in rows if r["node_id"].endswith("/planner")]


async def test_a_risky_proposal_under_a_lost_lease_parks_nothing(
    target: str, pki: Pki, thread_id: str, ledger: Ledger, database_dsn: str
) -> None:
    """A change the policy parks for approval, proposed under a lease grant that lost the
    lease: LEASE_LOST (FAILED_PRECONDITION), on the head the service has cached as on a
    stale version; nothing parked, nothing committed, the refusals recorded, the grant
    holding the lease now untouched. The same change under that grant is parked (the
    change is a risky one) and gives the lease back."""
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("wake")})  # wakes the planner
    lost, held = await lost_and_held(database_dsn, thread_id, "planner")
    before = await ledger.snapshot(thread_id)
    risky = {"target_user_id": OTHER_USER}
    async with client(target, pki.node("planner")) as planner:
        for version, key in [(1, "k-on-the-head"), (0, "k-stale")]:
            with pytest.raises(LeaseLost) as caught:
                await planner.propose(
                    thread_id, version, risky, idempotency_key=key, lease_epoch=lost
                )
            assert (caught.value.reason, caught.value.code) == (
                "LEASE_LOST",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        assert await ledger.snapshot(thread_id) == before
        assert await parked_rows(database_dsn, thread_id) == []
        assert planner_refusals(await ledger.rejections(thread_id)) == [
            ("LEASE_LOST", 1),
            ("LEASE_LOST", 0),
        ]
        assert await lease_row(database_dsn, thread_id, "planner") == (held, "test-held", -1)

        with pytest.raises(AwaitingApproval):
            await planner.propose(thread_id, 1, risky, idempotency_key="k-held", lease_epoch=held)
    planner_id = f"spiffe://{TRUST_DOMAIN}/node/planner"
    assert await parked_rows(database_dsn, thread_id) == [(planner_id, 1, "pending")]
    assert await lease_row(database_dsn, thread_id, "planner") == (held, None, 1)
    assert await ledger.snapshot(thread_id) == before


@pytest.mark.parametrize("epoch", [-1, -(2**63)], ids=["minus-one", "int64-min"])
async def test_a_negative_lease_epoch_is_invalid_and_writes_nothing(
    target: str, pki: Pki, thread_id: str, ledger: Ledger, database_dsn: str, epoch: int
) -> None:
    """A proposal naming a lease epoch below 0 (0 is none; grants start at 1) is refused
    INVALID_ARGUMENT (REQUEST_INVALID), before anything is looked up: a change that would
    commit commits nothing, a change that would be parked parks nothing, and the leases
    are untouched; each refusal is recorded."""
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("wake")})  # wakes the planner
    before = await ledger.snapshot(thread_id)
    leases = [await lease_row(database_dsn, thread_id, n) for n in ("input-parser", "planner")]
    calls = [
        ("input-parser", {"requested_action": act("next")}),
        ("planner", {"target_user_id": OTHER_USER}),
    ]
    for node, patch in calls:
        async with client(target, pki.node(node)) as worker:
            with pytest.raises(InvalidRequest) as caught:
                await worker.propose(thread_id, 1, patch, lease_epoch=epoch)
        assert (caught.value.reason, caught.value.code, caught.value.message) == (
            "REQUEST_INVALID",
            grpc.StatusCode.INVALID_ARGUMENT,
            "lease_epoch must be > 0",
        )
    assert await ledger.snapshot(thread_id) == before
    assert await parked_rows(database_dsn, thread_id) == []
    assert [await lease_row(database_dsn, thread_id, n) for n in ("input-parser", "planner")] == (
        leases
    )
    refusals = [
        (r["node_id"].rsplit("/", 1)[1], r["reason"]) for r in await ledger.rejections(thread_id)
    ]
    assert refusals == [("input-parser", "REQUEST_INVALID"), ("planner", "REQUEST_INVALID")]


async def test_a_lease_epoch_no_grant_reached_is_lease_lost_and_writes_nothing(
    target: str, pki: Pki, thread_id: str, ledger: Ledger, database_dsn: str
) -> None:
    """The largest epoch a request can carry (int64's maximum) names no grant: LEASE_LOST,
    nothing committed or parked, not an error of the database's."""
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("wake")})  # wakes the planner
    before = await ledger.snapshot(thread_id)
    calls = [
        ("input-parser", {"requested_action": act("next")}),
        ("planner", {"target_user_id": OTHER_USER}),
    ]
    for node, patch in calls:
        async with client(target, pki.node(node)) as worker:
            with pytest.raises(LeaseLost) as caught:
                await worker.propose(thread_id, 1, patch, lease_epoch=2**63 - 1)
        assert caught.value.reason == "LEASE_LOST"
    assert await ledger.snapshot(thread_id) == before
    assert await parked_rows(database_dsn, thread_id) == []
    refusals = [
        (r["node_id"].rsplit("/", 1)[1], r["reason"]) for r in await ledger.rejections(thread_id)
    ]
    assert refusals == [("input-parser", "LEASE_LOST"), ("planner", "LEASE_LOST")]
